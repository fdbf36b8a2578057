"""LLaDA2 and Fast-dLLM v2 through every door: tiny random folders with each published config's
keys and vocabulary (their mask and EOS ids are the published ones), served by `unmask serve` to
the real openai client, benchmarked by `unmask bench`, evaluated through the lm-eval adapter,
traced by the live view, described by `unmask show`.

The folders carry the small test tokenizer: the LM head's rows past its vocabulary are zero, so
the model predicts tokens the tokenizer can write out (random logits of the others win).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import httpx
import pytest
import torch
from helpers import LiveServer, tiny_tokenizer_dir
from lm_eval.api.instance import Instance
from test_published_configs import TINY, published

from unmask.api import LLM
from unmask.checkpoint import save_checkpoint
from unmask.cli import main
from unmask.config import ModelConfig
from unmask.evaluation.block_likelihood import estimate_block_bound
from unmask.evaluation.harness import UnmaskLM
from unmask.models import build_model
from unmask.server.app import ServerConfig, build_app
from unmask.server.intake import request_params
from unmask.server.protocol import ChatCompletionRequest

PROMPT = "what is 12 + 34?"
MESSAGES = [{"role": "user", "content": PROMPT}]
# published config, its block size here (LLaDA2's is its generate()'s 32; Fast-dLLM v2's bd_size
# cut to 8 to keep the test quick)
FAMILIES = {"llada2-mini": {}, "fast-dllm-v2-7b": {"bd_size": 8}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw = published(request.param)
    config = ModelConfig.from_dict({**raw, **TINY[raw["model_type"]], **FAMILIES[request.param],
                                    "torch_dtype": "float32"})
    torch.manual_seed(0)
    model = build_model(config)
    model.init_weights(std=0.3)
    out = tmp_path_factory.mktemp(request.param)
    tok = tiny_tokenizer_dir(out / "tok")
    vocab = json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"]
    with torch.no_grad():
        model.lm_head.weight[len(vocab):] = 0
    # The tokenizer's own EOS and mask ids are not the published ones: it names neither.
    settings = json.loads((tok / "tokenizer_config.json").read_text())
    for key in ("eos_token", "pad_token", "mask_token"):
        del settings[key]
    (tok / "tokenizer_config.json").write_text(json.dumps(settings))
    save_checkpoint(model.eval(), out, tokenizer_dir=tok)
    return out


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tokenizer names no EOS: said once, not an error
        return LLM(str(folder), device="cpu")


@pytest.fixture(scope="module")
def server(llm: LLM):
    with LiveServer(build_app(llm, ServerConfig(max_running=8))) as s:
        yield s


@pytest.mark.parametrize("spec", ["threshold,threshold=0.5", "freedave,draft_steps=3"])
def test_openai_client_streams_only_committed_text(server: LiveServer, llm: LLM, folder: Path,
                                                   spec: str) -> None:
    """Streamed chat: every chunk extends a prefix of the offline text (nothing is retracted, so
    nothing uncommitted was sent), block by block, and the chunks make the unstreamed answer."""
    bs = llm.config.block_size
    body = ChatCompletionRequest(messages=MESSAGES, max_tokens=2 * bs, decoder=spec)
    params = request_params(ServerConfig(), body, server.app.state.unmask.model_defaults)
    assert (params.block_length, params.cache) == (bs, "block")
    (want,) = llm.generate([PROMPT], params)
    assert want.text
    client = server.client()
    r = client.chat.completions.create(model=folder.name, messages=MESSAGES, max_tokens=2 * bs,
                                       extra_body={"decoder": spec})
    assert r.choices[0].message.content == want.text
    chunks = client.chat.completions.create(model=folder.name, messages=MESSAGES, max_tokens=2 * bs,
                                            extra_body={"decoder": spec}, stream=True)
    text, pieces = "", 0
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            text += c.choices[0].delta.content
            pieces += 1
            assert want.text.startswith(text), text
    assert text == want.text and pieces > 1


def test_a_steps_floor_is_served_and_a_bad_one_is_a_400(server: LiveServer, llm: LLM) -> None:
    bs = llm.config.block_size
    # 2 (LLaDA2) or 4 (Fast-dLLM v2) steps a block here.
    gen = max(2 * bs, 32)
    spec = f"threshold,threshold=0.9,steps={128 // bs}"
    (want,) = llm.generate([PROMPT], spec, gen_length=gen)
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": MESSAGES, "max_tokens": gen, "decoder": spec})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want.text
    p = len(llm.encode_prompt(PROMPT))
    decode_blocks = -(-(p + gen) // bs) - p // bs  # the prompt's tail opens the first
    per_block = (128 // bs) // (gen // bs)
    assert r.json()["unmask"]["nfe"] == want.nfe <= per_block * decode_blocks
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": MESSAGES, "max_tokens": 2 * bs, "decoder": "freedave++,steps=4"})
    assert r.status_code == 400 and "steps is read by method static / threshold only" in r.text


def test_live_trace_fills_the_models_blocks(server: LiveServer, llm: LLM) -> None:
    bs = llm.config.block_size
    with httpx.stream("POST", f"{server.url}/v1/unmask/trace", timeout=60, json={
            "prompt": PROMPT, "decoders": ["threshold"], "max_tokens": 2 * bs}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    steps = [e for e in events if e["event"] == "step"]
    assert all(hi - lo <= bs and lo <= p < hi for e in steps for lo, hi in [e["block"]]
               for p in e["positions"])
    assert len({tuple(e["block"]) for e in steps}) > 1 and events[-1]["event"] == "done"


def test_bench_reports_the_model_and_its_blocks(folder: Path, llm: LLM, tmp_path: Path) -> None:
    bs = llm.config.block_size
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(["bench", "--model", str(folder), "--task", "math", "--n", "1", "--warmup", "0",
                   "--gen-length", str(2 * bs), "--threads", "1", "--decoder", "static-1",
                   "--decoder", "threshold", "--json", str(js), "--markdown", str(md)])
    assert rc == 0
    doc = json.loads(js.read_text())
    assert doc["model"] == str(folder)
    assert doc["block_length"] == bs and doc["model_keys"]["cache"] == "block"
    assert [r["block_length"] for r in doc["results"]] == [bs, bs]
    assert f"block_length {bs}" in md.read_text() and str(folder) in md.read_text()


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_lm_eval_generates_in_blocks_and_scores_by_the_block_bound(folder: Path, llm: LLM) -> None:
    bs = llm.config.block_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = UnmaskLM(pretrained=str(folder), decoder="threshold", device="cpu", mc_num=4)
    got = lm.generate_until(_requests("generate_until", [(PROMPT, {"max_gen_toks": bs + 1})]))
    (want,) = llm.generate(PROMPT, "threshold", chat=False, gen_length=2 * bs)
    ids = want.token_ids[: bs + 1]
    assert got == [llm.tokenizer.decode(ids, skip_special_tokens=True)] and got[0]
    # the likelihoods: the block-diffusion bound (its own tests: test_block_likelihood.py)
    prompt, target = lm._encode_pair(PROMPT, " 46")
    mask = llm.config.mask_token_id
    ((scored, _),) = lm.loglikelihood(_requests("loglikelihood", [(PROMPT, " 46")]))
    assert scored == estimate_block_bound(llm.model, prompt, target, mask, mc_num=4).logprob
    (rolling,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(PROMPT,)]))
    assert rolling == estimate_block_bound(llm.model, lm._bos(), lm._encode(PROMPT), mask,
                                           mc_num=4).logprob


def test_show_names_the_families_facts(folder: Path, llm: LLM,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"family       {llm.config.model_type}" in out and "float32" in out
    c = llm.config
    if c.num_experts:  # LLaDA2: routed experts, and fewer parameters active than stored
        assert (f"experts      {c.num_experts_per_tok} of {c.num_experts} routed + "
                f"{c.num_shared_experts} shared per token") in out
        assert "parameters active per token" in out
    else:
        assert "experts" not in out
