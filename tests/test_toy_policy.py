"""A new policy is one class and one registry call (unmask.decoding.knobs): this file adds a toy
K/V cache policy and shows that the spec grammar, the refusal of keys it does not read, the
engine, `LLM.generate`, `unmask bench` and the OpenAI server all take it, with no other file
edited."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import EOS, MASK, PROMPTS, VOCAB, peaky_model, tiny_model_dir

from unmask.caching import CachePolicy, StepView, StoreKnobs
from unmask.decoding.knobs import Facts, register
from unmask.decoding.params import DecodeParams, SpecError
from unmask.engine import decode


class BlockOnly(CachePolicy):
    """Full forward when a row's block changes; otherwise only the block (`block_recompute`
    says which of its slots), every other slot read from the store: what `dual` does, written
    again here so that its output can be checked against dual's."""

    def plan(self, v: StepView) -> tuple[np.ndarray, np.ndarray]:
        return v.block_changed, self.block(v)


register("cache", "toy-block", BlockOnly, (StoreKnobs,), Facts(uses_store=True))


def test_the_grammar_takes_it_and_its_knobs() -> None:
    p = DecodeParams.parse("threshold,cache=toy-block,block_recompute=masked")
    assert (p.cache, p.block_recompute) == ("toy-block", "masked")
    assert DecodeParams.parse(p.spec) == p


@pytest.mark.parametrize("key", ["entropy_tau=1", "recent_k=2", "refresh_on_block=true"])
def test_keys_it_does_not_read_are_refused(key: str) -> None:
    with pytest.raises(SpecError, match=key.split("=")[0]) as e:
        DecodeParams.parse(f"threshold,cache=toy-block,{key}")
    assert "entropy" in str(e.value)  # the policy that does read it


@pytest.mark.parametrize("spec", ["threshold,threshold=0.5", "freedave,draft_steps=3",
                                  "static-1,temperature=0.8,seed=2"])
def test_the_engine_runs_it(spec: str) -> None:
    """Same tokens and cost as dual (the same plan), fewer token-forwards than no cache: the
    engine ran the toy policy and kept a K/V store for it."""
    model = peaky_model("llada", 0, 4.0, VOCAB, MASK, EOS)

    def run(cache: str) -> list[tuple]:
        p = DecodeParams.parse(f"{spec},cache={cache}", gen_length=32, block_length=8)
        return [(r.token_ids, r.nfe, r.token_forwards)
                for r in decode(model, p, PROMPTS, mask_id=MASK, eos_id=EOS)]

    toy, dual, none = run("toy-block"), run("dual"), run("none")
    assert toy == dual
    assert sum(t[2] for t in toy) < sum(t[2] for t in none)


def test_llm_generate_and_bench_take_it(tmp_path: Path) -> None:
    from unmask import LLM
    from unmask.cli import main

    folder = tiny_model_dir(tmp_path)
    llm = LLM(folder)
    toy, dual = (llm.generate(["2 + 2 ="], f"threshold,cache={c}", gen_length=16, block_length=8)
                 for c in ("toy-block", "dual"))
    assert toy[0].token_ids == dual[0].token_ids
    js = tmp_path / "bench.json"
    assert main(["bench", "--model", str(folder), "--task", "math", "--n", "2", "--warmup", "0",
                 "--decoder", "threshold,cache=dual", "--decoder", "threshold,cache=toy-block",
                 "--gen-length", "16", "--block-length", "8", "--threads", "1",
                 "--json", str(js)]) == 0
    dual_row, toy_row = json.loads(js.read_text())["results"]
    assert toy_row["decoder"] == "threshold,cache=toy-block"
    assert toy_row["token_forwards"] == dual_row["token_forwards"]


def test_the_server_serves_it() -> None:
    """An OpenAI request with the toy policy in its `decoder` field, through the real client
    against a live server, answers what LLM.generate gives with the same spec."""
    from helpers import LiveServer

    from unmask import LLM
    from unmask.server.app import ServerConfig, build_app

    llm, spec = LLM(), "threshold,cache=toy-block,block_recompute=masked"
    with LiveServer(build_app(llm, ServerConfig(decoder="threshold"))) as s:
        out = s.client().chat.completions.create(
            model="unmask-llada", messages=[{"role": "user", "content": "What is 47 + 38?"}],
            max_tokens=96, extra_body={"decoder": spec})
    expected = llm.generate(["What is 47 + 38?"], spec, gen_length=96)[0].text
    assert out.choices[0].message.content == expected and "####" in expected


TOY_RULE = '''
from dataclasses import dataclass
import numpy as np
from unmask.decoding.knobs import Facts, Knobs, at_least, knob, register
from unmask.decoding.methods import Rule


@dataclass(frozen=True)
class EveryKnobs(Knobs):
    every: int = knob(2, ">= 1", at_least(1), per_row=True, dtype="int64")


class Every(Rule):
    """Commits `every` candidates a step (fewer when fewer are left)."""

    def count(self, conf, cand, schedule, knobs):
        return np.minimum(cand.sum(-1), knobs["every"])


register("method", "toy-every", Every, (EveryKnobs,))
'''


def test_a_rule_with_its_own_knob_needs_only_its_module(tmp_path: Path) -> None:
    """A rule with a knob no other policy has: its module registers it and is imported before
    the grammar; nothing else is edited. The key parses, is range-checked, refused for other
    methods, becomes a per-row column, and the engine commits by it (every=4 takes half the
    forwards of every=2)."""
    import subprocess
    import sys

    (tmp_path / "toy_every.py").write_text(TOY_RULE)
    script = f'''
import sys
sys.path.insert(0, {str(tmp_path)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
import toy_every  # registers before the grammar is built
from helpers import EOS, MASK, PROMPTS, VOCAB, peaky_model
from unmask.decoding.params import ROW_DTYPE, DecodeParams, SpecError
from unmask.engine import decode
p = DecodeParams.parse("toy-every,every=4", gen_length=32, block_length=8)
assert p.every == 4 and "every" in ROW_DTYPE.names
for bad in ("toy-every,every=0", "threshold,every=2"):
    try:
        DecodeParams.parse(bad)
        raise SystemExit("accepted " + bad)
    except SpecError as e:
        assert "every" in str(e), e
model = peaky_model("llada", 0, 4.0, VOCAB, MASK, EOS)
nfe = {{k: [r.nfe for r in decode(model, DecodeParams.parse(f"toy-every,every={{k}}", gen_length=32,
                                    block_length=8), PROMPTS, mask_id=MASK, eos_id=EOS)]
       for k in (2, 4)}}
assert nfe[2] == [16] * len(PROMPTS) and nfe[4] == [8] * len(PROMPTS), nfe
print("ok")
'''
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
