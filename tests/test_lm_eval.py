"""unmask inside lm-evaluation-harness: the `unmask` model, its likelihood bound, the shipped tasks,
and how lm-eval finds the model (unmask_lm_eval.pth's hook, _unmask_lm_eval.py).

lm-eval's CLI indexes its thousands of built-in tasks at every start (~15 s here), so the default
suite has one full CLI run (plain `lm_eval`, accuracy against `unmask eval`) and two runs that
stop at the model's arguments (`lm-eval run`, `unmask-lm-eval`); the other CLI runs are slow.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import (
    assert_lm_eval_equals_unmask_eval,
    math_choice_wins,
    tiny_model,
    tiny_model_dir,
)

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from unmask.checkpoint import CheckpointError  # noqa: E402
from unmask.decoding.params import DecodeParams, SpecError, same_decoder  # noqa: E402
from unmask.errors import InputError  # noqa: E402
from unmask.evaluation import TASKS_DIR  # noqa: E402
from unmask.evaluation.cli import with_task_folder  # noqa: E402
from unmask.evaluation.harness import UnmaskLM, cut_at_stops  # noqa: E402
from unmask.evaluation.likelihood import draw_masks, estimate_bound, sample_seed  # noqa: E402
from unmask.evaluation.tasks import MATH_JSONL, MATH_N, gsm8k_results, math_results  # noqa: E402
from unmask.tasks import TASKS  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def lm_eval_cli(tmp_path: Path, *args: str, command: str = "unmask-lm-eval") -> subprocess.CompletedProcess:
    """Run an lm-eval command line offline, one thread: `unmask-lm-eval` (lm-eval's CLI with
    `unmask` registered and the task folder added) or lm-eval's own console script, `lm_eval` or
    `lm-eval run`, which find `--model unmask` through the installed .pth (given the task folder)."""
    bin_dir = Path(sys.executable).parent
    if command == "unmask-lm-eval":
        script = bin_dir / command
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "unmask.evaluation"]
    else:
        name, *sub = command.split()
        cmd = [str(bin_dir / name), *sub]
        args = (*args, "--include_path", str(TASKS_DIR))
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")}
    return subprocess.run([*cmd, *args, "--device", "cpu"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def embedded() -> UnmaskLM:
    return UnmaskLM(device="cpu", mc_num=16, greedy_check=False)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: tiny_model_dir(root, kind) for kind in ("llada", "Dream")}


# --------------------------------------------------------------------------- lm-eval's CLI


def test_cli_accuracy_equals_unmask_eval(tmp_path: Path) -> None:
    """Plain `lm_eval --model unmask --tasks unmask_math` (lm-eval's own console script; nothing
    imports unmask first) scores the problems `unmask eval --task math` scores, with the same
    outputs, so the same accuracy."""
    n, decoder, gen = 12, "threshold", 128
    run = lm_eval_cli(tmp_path, "--model", "unmask", "--model_args",
                      f"decoder={decoder},gen_length={gen},block_length=32",
                      "--tasks", "unmask_math", "--apply_chat_template", "--limit", str(n),
                      "--batch_size", "4", "--log_samples", "--output_path", str(tmp_path / "out"),
                      command="lm_eval")
    assert run.returncode == 0, run.stderr[-3000:]
    acc = assert_lm_eval_equals_unmask_eval(tmp_path / "out", tmp_path, n, [
        "--decoder", decoder, "--gen-length", str(gen), "--block-length", "32"])
    assert acc >= 0.5  # the embedded model scores ~84% on these problems


@pytest.mark.parametrize("command", ["lm-eval run", "unmask-lm-eval"])
def test_cli_finds_the_model_and_names_a_bad_decoder(tmp_path: Path, command: str) -> None:
    """The other two commands, up to the model: `--model unmask` resolves (UnmaskLM rejects
    decoder=warp), and the error is one line naming the decoder (`unmask-lm-eval`: exit code 2;
    lm-eval's own CLI: its exit code for an uncaught error, 1)."""
    run = lm_eval_cli(tmp_path, "--model", "unmask", "--model_args", "decoder=warp",
                      "--tasks", "unmask_math", "--limit", "1", command=command)
    last = run.stderr.strip().splitlines()[-1]
    assert "unknown decoder 'warp'" in last, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "no model for this name" not in run.stderr
    prog = command.split()[0]
    assert last.startswith(f"{prog}: error: ")
    assert run.returncode == (2 if command == "unmask-lm-eval" else 1)


@pytest.mark.slow
@pytest.mark.parametrize("model_args, names", [
    ("decoder=threshold,colour=red", "unknown --model_args key 'colour'"),
    ("pretrained=/no/such/folder", "/no/such/folder"),
])
def test_cli_bad_model_args_fail_in_one_line(tmp_path: Path, model_args: str, names: str) -> None:
    run = lm_eval_cli(tmp_path, "--model", "unmask", "--model_args", model_args,
                      "--tasks", "unmask_math", "--limit", "1")
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("unmask-lm-eval: error: ") and names in last


@pytest.mark.slow
def test_cli_gsm8k_from_a_local_file(tmp_path: Path) -> None:
    """unmask_gsm8k reads the JSONL given with --metadata; nothing is downloaded."""
    rows = [{"question": e.prompt, "answer": f"worked\n#### {e.answer}"}
            for e in TASKS["math"].load("heldout", 4)]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = lm_eval_cli(tmp_path, "--model", "unmask", "--model_args", "decoder=fast,gen_length=128",
                      "--tasks", "unmask_gsm8k", "--apply_chat_template",
                      "--metadata", f"gsm8k_path={data}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "unmask_gsm8k" in run.stdout and "exact_match" in run.stdout


# --------------------------------------------------------------------------- the .pth hook


# Run in a fresh interpreter of this environment: what unmask_lm_eval.pth did at its start.
FRESH_PROCESS = """
import sys
assert "_unmask_lm_eval" in sys.modules, "unmask_lm_eval.pth did not run"
loaded = [m for m in ("lm_eval", "torch", "unmask") if m in sys.modules]
assert not loaded, f"imported at startup: {loaded}"

from lm_eval.api.registry import get_model, model_registry
assert "unmask" not in model_registry  # not before lm-eval's own models: that would hide them
assert get_model("dummy").__name__ == "DummyLM"  # imports lm_eval.models (registry empty)
assert "unmask" in model_registry and "unmask" not in sys.modules, "unmask is not lazy"
assert get_model("unmask").__module__ == "unmask.evaluation.harness"
assert get_model("local-completions").__name__ == "LocalCompletionsAPI"
try:
    assert get_model("hf").__name__ == "HFLM"
except ModuleNotFoundError as e:  # found; lm-eval[hf] (accelerate) is not installed
    print("hf:", e)
print("ok")
"""


def test_pth_hook_is_lazy_and_keeps_builtin_models(tmp_path: Path) -> None:
    """A fresh interpreter (this environment's install, editable or not) has the hook and nothing
    else: no lm_eval, torch or unmask. lm-eval then finds `unmask` without anything importing
    unmask first, and its built-in models are all still there."""
    run = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, **OFFLINE}, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_hook_registers_once_and_steps_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    import lm_eval.api.registry as registry

    import _unmask_lm_eval as hook

    # This process imported the harness: `unmask` is registered, the hook leaves it alone; the
    # harness imported lm-eval's own models before registering (or they would be hidden).
    assert registry.get_model("unmask") is UnmaskLM and not hook.register()
    assert registry.get_model("dummy").__name__ == "DummyLM"
    # A registry without it: the lazy placeholder, once.
    monkeypatch.setattr(registry, "model_registry", registry.Registry("model"))
    assert hook.register() and not hook.register()
    assert registry.model_registry.get("unmask") is UnmaskLM
    # An lm-eval that discovers entry points itself: nothing.
    monkeypatch.setattr(registry, "model_registry", registry.Registry("model"))
    monkeypatch.setattr(registry, "load_plugins", lambda *a: [], raising=False)
    assert not hook.register() and "unmask" not in registry.model_registry
    # Its own failure (here a frozen registry) is a warning, not an error.
    monkeypatch.delattr(registry, "load_plugins")
    registry.model_registry.freeze()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hook._register_or_warn()
    assert [w.category for w in caught] == [RuntimeWarning]
    assert "--model unmask" in str(caught[0].message)


@pytest.mark.slow
def test_wheel_puts_the_pth_at_the_root(tmp_path: Path) -> None:
    """The non-editable install: the wheel (built as pip builds it, setuptools from the index)
    carries unmask_lm_eval.pth and its module at its root, listed in RECORD."""
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(root), "-w",
                          str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = tmp_path.glob("unmask-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
        pth = z.read("unmask_lm_eval.pth").decode()
    assert {"unmask_lm_eval.pth", "_unmask_lm_eval.py"} <= {n for n in names if "/" not in n}
    assert "\nunmask_lm_eval.pth,sha256=" in record
    assert pth.startswith("import ") and pth.count("\n") == 1 and "_unmask_lm_eval" in pth


def test_entry_point_and_task_folder() -> None:
    eps = importlib.metadata.entry_points(group="lm_eval.models")
    assert any(ep.name == "unmask" and ep.load() is UnmaskLM for ep in eps)
    assert with_task_folder(["--model", "unmask"])[-2:] == ["--include_path", str(TASKS_DIR)]
    assert with_task_folder(["--include_path=x", "--model", "unmask"]) == ["--include_path=x",
                                                                            "--model", "unmask"]
    assert with_task_folder(["-h"]) == ["-h"]


# --------------------------------------------------------------------------- model arguments


@pytest.mark.parametrize("kwargs, error, names", [
    ({"colour": "red"}, InputError, "'colour'"),
    ({"decoder": "warp"}, SpecError, "'warp'"),
    ({"decoder": "threshold", "threshold": 2}, SpecError, "threshold"),
    ({"gen_length": 100, "block_length": 32}, SpecError, "multiple of block_length"),
    ({"mc_num": 0}, InputError, "mc_num"),
    ({"compile": "yes"}, InputError, "compile must be true or false"),
    ({"quantize": "int3"}, InputError, "int3"),
    ({"pretrained": "/no/such/folder"}, CheckpointError, "/no/such/folder"),
])
def test_bad_model_args_name_the_problem(kwargs: dict, error: type, names: str) -> None:
    with pytest.raises(error, match=names) as info:
        UnmaskLM(device="cpu", **kwargs)
    assert "\n" not in str(info.value)


def test_model_args_make_the_decoder_spec() -> None:
    lm = UnmaskLM(device="cuda:0" if torch.cuda.is_available() else "cpu", decoder="fast",
                  gen_length=128, block_length=16, threshold=0.8, batch_size="auto")
    assert same_decoder(lm.params, DecodeParams.parse("fast,threshold=0.8", gen_length=128,
                                                      block_length=16))
    assert lm.batch_size == 8
    # lm-eval's --device defaults to cuda:0: without CUDA that means the CPU.
    assert UnmaskLM(device="cuda:0").llm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_quantize_and_compile_reach_the_model(tiny_dirs: dict[str, Path]) -> None:
    """--quantize and --compile as model args: the adapter's model is the one `unmask generate
    --quantize int8` loads (its linear layers quantized), and compile reaches LLM."""
    pytest.importorskip("torchao")
    from unmask.quantize import quantized_scheme

    lm = UnmaskLM(pretrained=str(tiny_dirs["llada"]), device="cpu", quantize="int8")
    assert quantized_scheme(lm.llm.model) == "int8"
    seen = {}

    def fake_llm(*args: object, **kwargs: object) -> object:
        seen.update(kwargs)
        raise InputError("stop here")

    import unmask.evaluation.harness as harness
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness, "LLM", fake_llm)
        with pytest.raises(InputError, match="stop here"):
            UnmaskLM(device="cpu", compile=True)
    assert seen["compile"] is True


# --------------------------------------------------------------------------- generate_until


def test_cut_at_stops() -> None:
    assert cut_at_stops("a\n\nb Question: c", ["Question:", "\n\n"]) == "a"
    assert cut_at_stops("abc", []) == "abc"
    assert cut_at_stops("abc", ["", "z"]) == "abc"


def test_generate_until_batches_stops_and_limits(tiny_dirs: dict[str, Path]) -> None:
    lm = UnmaskLM(pretrained=str(tiny_dirs["llada"]), decoder="static-1", block_length=8,
                  gen_length=16, batch_size=2, device="cpu")
    prompts = ["hello", "what is 12 + 34?", "sort the list", "def add(a, b):"]
    alone = {p: lm.llm.generate(p, "static-1", chat=False, gen_length=16, block_length=8)[0]
             for p in prompts}
    # No max_gen_toks: the spec's gen_length; the batch of 2 gives what each prompt gives alone.
    got = lm.generate_until(requests("generate_until", [(p, {"until": []}) for p in prompts]))
    assert got == [alone[p].text for p in prompts]
    # max_gen_toks 5 -> canvas 8 (rounded up to block_length), text of its first 5 tokens.
    got = lm.generate_until(requests("generate_until", [(p, {"max_gen_toks": 5}) for p in prompts]))
    canvas8 = lm.llm.generate(prompts, "static-1", chat=False, gen_length=8, block_length=8)
    for text, g in zip(got, canvas8, strict=True):
        ids = g.token_ids[:5]
        ids = ids[: ids.index(1)] if 1 in ids else ids
        assert text == lm.llm.tokenizer.decode(ids, skip_special_tokens=True)
    # until: cut at the first stop string found in the text.
    first = alone[prompts[0]].text
    if len(first) > 2:
        stop = first[1:3]
        got = lm.generate_until(requests("generate_until", [(prompts[0], {"until": [stop, "zzz"]})]))
        assert got == [first[: first.find(stop)]]


def test_max_batch_size_caps_auto(tiny_dirs: dict[str, Path]) -> None:
    """lm-eval's --max_batch_size used to be accepted and ignored (0 or 'abc' too)."""
    def lm(**kwargs: object) -> UnmaskLM:
        return UnmaskLM(pretrained=str(tiny_dirs["llada"]), device="cpu", **kwargs)

    assert lm(batch_size="auto", max_batch_size=2).batch_size == 2
    assert lm(batch_size="auto", max_batch_size=64).batch_size == 8
    assert lm(batch_size=16, max_batch_size=2).batch_size == 16  # only auto is capped, as in lm-eval
    for bad in (0, -1, "abc"):
        with pytest.raises(InputError, match="max_batch_size must be a positive integer"):
            lm(batch_size="auto", max_batch_size=bad)


def test_generate_until_bad_lengths_and_kwargs_name_the_problem(tiny_dirs: dict[str, Path]) -> None:
    lm = UnmaskLM(pretrained=str(tiny_dirs["llada"]), block_length=8, gen_length=16, device="cpu")
    # The engine's message blamed "gen_length (100000)", which nobody set.
    for size in (100_000, 256):
        with pytest.raises(InputError, match=f"max_gen_toks {size} .*max_sequence_length 256"):
            lm.generate_until(requests("generate_until", [("hi", {"max_gen_toks": size})]))
    # gen_kwargs must be a dict: None used to raise AttributeError.
    with pytest.raises(InputError, match="gen_kwargs a dict"):
        lm.generate_until(requests("generate_until", [("hi", None)]))


def test_generate_until_mixed_lengths_keep_request_order(tiny_dirs: dict[str, Path]) -> None:
    """Requests are grouped by canvas and batched; answers still come back in request order,
    each what the request gives alone, whatever the batch size."""
    prompts = ["hello", "what is 12 + 34?", "sort the list", "def add(a, b):", "x"]
    reqs = [(p, {"max_gen_toks": m, "until": []}) for p, m in zip(prompts, [3, 16, 5, 9, 1], strict=True)]
    got = {}
    for bs in (1, 2, 8):
        lm = UnmaskLM(pretrained=str(tiny_dirs["llada"]), decoder="threshold,threshold=0.5",
                      block_length=8, gen_length=16, batch_size=bs, device="cpu")
        got[bs] = lm.generate_until(requests("generate_until", reqs))
    alone = [lm.generate_until(requests("generate_until", [r]))[0] for r in reqs]
    assert got[1] == got[2] == got[8] == alone


def test_apply_chat_template_matches_unmask_prompts(embedded: UnmaskLM) -> None:
    text = embedded.apply_chat_template([{"role": "user", "content": "What is 47 + 38?"}])
    assert embedded.llm.tokenizer.encode(text, add_special_tokens=False) == \
        embedded.llm.encode_prompt("What is 47 + 38?")


# --------------------------------------------------------------------------- loglikelihood


def test_loglikelihood_prefers_the_true_answer(embedded: UnmaskLM) -> None:
    """Context: a held-out prompt (chat template); continuations: its worked solution ending in
    the true `#### answer`, or the same solution ending in a wrong one. The true one should win
    far more often than chance (1 in 4)."""
    wins, n, chance = math_choice_wins(embedded, 12)
    assert wins / n >= 0.75 > 2 * chance


def test_loglikelihood_is_deterministic_and_order_free(embedded: UnmaskLM) -> None:
    args = [("What is 2 + 3?", " #### 5"), ("Sort 3, 1.", " #### 1, 3"), ("", "hello")]
    a = embedded.loglikelihood(requests("loglikelihood", args))
    b = embedded.loglikelihood(requests("loglikelihood", args[::-1]))[::-1]
    assert a == b
    other = UnmaskLM(device="cpu", mc_num=16, greedy_check=False, seed=1)
    assert other.loglikelihood(requests("loglikelihood", args[:1])) != a[:1]


def test_spread_shrinks_as_mc_num_grows(embedded: UnmaskLM) -> None:
    """Std over seeds of the estimate, summed over three held-out solutions: the per-sample loss
    is heavy-tailed (one hard token masked alone weighs L times), so use a wide mc_num gap."""
    llm = embedded.llm
    spread = dict.fromkeys((2, 32), 0.0)
    for ex in TASKS["math"].load("heldout", 3):
        prompt = llm.encode_prompt(ex.prompt)
        target = llm.tokenizer.encode(ex.response, add_special_tokens=False)
        for mc in spread:
            values = [estimate_bound(llm.model, prompt, target, llm.config.mask_token_id, mc_num=mc,
                                     batch_size=32, seed=s).logprob for s in range(8)]
            spread[mc] += statistics.stdev(values)
    # 16x the samples: 4x less spread for independent draws; ask for 2x.
    assert spread[32] < spread[2] / 2, spread


def test_draw_masks_stratifies_the_masked_count() -> None:
    g = torch.Generator().manual_seed(0)
    masked, count = draw_masks(10, 20, g)
    assert masked.sum(1).tolist() == count.tolist()
    assert count.min() >= 1 and count.max() <= 10
    # 20 stratified ratios over 10 tokens: every count 1..10 twice.
    assert sorted(count.tolist()) == sorted(list(range(1, 11)) * 2)
    assert sample_seed(0, [1], [2]) != sample_seed(1, [1], [2]) != sample_seed(0, [1, 2], [])


@pytest.mark.parametrize("kind", ["llada", "Dream"])
def test_bound_matches_a_full_logits_reference(kind: str) -> None:
    """estimate_bound reads only the masked positions' logits (shifted by one for Dream); a
    reference computes full logits, shifts them as DESIGN.md says, and sums the same terms."""
    model = tiny_model(kind, vocab_size=64, max_sequence_length=64)
    prompt, target, mask_id, mc = [5, 6, 7], [8, 9, 10, 11, 12], 2, 6
    got = estimate_bound(model, prompt, target, mask_id, mc_num=mc, batch_size=4, seed=3)
    g = torch.Generator().manual_seed(sample_seed(3, prompt, target))
    masked, count = draw_masks(len(target), mc, g)
    losses = []
    for j in range(mc):
        ids = torch.tensor([prompt + target])
        ids[0, len(prompt):][masked[j]] = mask_id
        with torch.no_grad():
            logits = model(ids, torch.arange(ids.shape[1])[None])
        if kind == "Dream":
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        logp = torch.log_softmax(logits[0, len(prompt):].float(), -1)
        nll = -logp[torch.arange(len(target)), torch.tensor(target)]
        losses.append((nll * masked[j]).sum().item() * len(target) / count[j].item())
    assert got.logprob == pytest.approx(-statistics.mean(losses), rel=1e-5)


def test_is_greedy_is_static1_reproducing_the_continuation(tiny_dirs: dict[str, Path]) -> None:
    lm = UnmaskLM(pretrained=str(tiny_dirs["llada"]), device="cpu", mc_num=2)
    prompt = lm.llm.encode_prompt("hello", chat=False)
    params = DecodeParams(method="static-1", gen_length=6, block_length=6)
    greedy = lm.llm.generate_ids([prompt], params)[0].token_ids
    assert lm._is_greedy(prompt, greedy)
    assert not lm._is_greedy(prompt, greedy[:-1] + [(greedy[-1] + 1) % 50 + 3])
    # an empty continuation is reproduced by any decoding (lm-eval's HF model: all() of nothing)
    assert lm._is_greedy(prompt, [])


def test_loglikelihood_rolling(tiny_dirs: dict[str, Path]) -> None:
    lm = UnmaskLM(pretrained=str(tiny_dirs["Dream"]), device="cpu", mc_num=4)
    (value,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [("hello world",)]))
    assert value < 0
    too_long = "hello world " * 400
    with pytest.raises(InputError, match="no rolling"):
        lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(too_long,)]))


# --------------------------------------------------------------------------- shipped tasks


def test_shipped_math_jsonl_is_the_heldout_split() -> None:
    rows = [json.loads(line) for line in MATH_JSONL.open()]
    want = TASKS["math"].load("heldout", MATH_N, seed=0)
    assert [(r["prompt"], r["answer"]) for r in rows] == [(e.prompt, e.answer) for e in want]
    assert {p.name for p in TASKS_DIR.glob("*.yaml")} == {"unmask_math.yaml", "unmask_gsm8k.yaml"}


@pytest.mark.parametrize("row, names", [
    ({"question": 5, "answer": "#### 3"}, "must be text"),
    ({"question": " ", "answer": "#### 3"}, "'question' is empty"),
    ({"question": "q", "answer": "#### abc"}, "has no number"),
])
def test_gsm8k_dataset_rejects_rows_unmask_eval_rejects(tmp_path: Path, row: dict, names: str) -> None:
    """unmask_gsm8k used to score such a file (every output wrong) instead of naming the row."""
    from unmask.evaluation.tasks import gsm8k_dataset

    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps(row) + "\n")
    with pytest.raises(InputError, match=names):
        gsm8k_dataset(gsm8k_path=str(data))
    with pytest.raises(InputError, match="is a folder"):
        gsm8k_dataset(gsm8k_path=str(tmp_path))


def test_task_checkers() -> None:
    assert math_results({"answer": "1, 2, 3"}, ["... \n#### 1,2, 3."]) == {"acc": 1.0}
    assert math_results({"answer": "85"}, ["#### 75"]) == {"acc": 0.0}
    doc = {"answer": "Natalia sold 48/2 = 24 clips.\n#### 1,072"}
    assert gsm8k_results(doc, ["so 1072 in all\n#### $1,072"]) == {"exact_match": 1.0}
    assert gsm8k_results(doc, ["the answer is 1071"]) == {"exact_match": 0.0}


# --------------------------------------------------------------------------- as lm-eval sends them


def test_model_args_may_hold_lm_evals_own_flags(caplog: pytest.LogCaptureFixture) -> None:
    """`--model_args batch_size=4` (or device=cpu) was passed twice by lm-eval's merge with its
    flags, which its command line always sends (defaults 1 and cuda:0): a TypeError. The model's
    own arguments win, with a warning naming both."""
    flags = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}
    with caplog.at_level("WARNING", logger="unmask.evaluation.harness"):
        lm = UnmaskLM.create_from_arg_string("batch_size=4,device=cpu,gen_length=32", flags)
    assert lm.batch_size == 4 and lm.llm.device.type == "cpu" and lm.params.gen_length == 32
    assert "batch_size=4" in caplog.text and "batch_size 1" in caplog.text
    lm = UnmaskLM.create_from_arg_obj({"max_batch_size": 2, "batch_size": "auto"},
                                      {"batch_size": "auto", "device": "cpu"})
    assert lm.batch_size == 2


def test_model_args_as_lm_eval_parses_them() -> None:
    """lm-eval's parser turns `none` into None and `64.0` into a float; the spec read them as
    'None' (a SpecError for cache=none) and refused the float as an int."""
    from lm_eval.utils import simple_parse_args_string

    text = "decoder=threshold,cache=none,gen_length=64.0,mc_num=16.0,batch_size=2.0"
    assert simple_parse_args_string(text)["cache"] is None  # the premise
    lm = UnmaskLM.create_from_arg_string(text, {"device": "cpu"})
    assert (lm.params.cache, lm.params.gen_length, lm.mc_num, lm.batch_size) == ("none", 64, 16, 2)
    lm = UnmaskLM.create_from_arg_string("decoder=static,steps=none,gen_length=64", {"device": "cpu"})
    assert lm.params.steps is None
    with pytest.raises(SpecError, match="gen_length='64.5'"):
        UnmaskLM.create_from_arg_string("gen_length=64.5", {"device": "cpu"})


def _no_decoding(lm: UnmaskLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("decoded before every request was checked")
    monkeypatch.setattr(lm.llm, "generate", refuse)
    monkeypatch.setattr(lm.llm, "generate_ids", refuse)


def test_static_steps_and_another_max_gen_toks_fail_before_decoding(
        tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """steps=4 is written for gen_length 16 (2 blocks of 8); a task's max_gen_toks 24 makes 3
    blocks. It failed mid-run with a message about a canvas nobody wrote; now before the first
    batch, naming the request, its max_gen_toks, steps and the way out."""
    lm = UnmaskLM(pretrained=str(tiny_dirs["llada"]), decoder="static", steps=4, block_length=8,
                  gen_length=16, device="cpu")
    _no_decoding(lm, monkeypatch)
    reqs = requests("generate_until", [("hi", {"max_gen_toks": 16}), ("hi", {"max_gen_toks": 24})])
    with pytest.raises(InputError, match=r"request 1: its max_gen_toks 24 .*3 blocks of 8.* steps=4"
                                         r".*--gen_kwargs max_gen_toks=16, or drop steps"):
        lm.generate_until(reqs)


def test_generate_until_names_the_bad_request(tiny_dirs: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty context was 'empty prompt (prompt 0)', 0 being its place in a batch; the mask
    token failed in the engine without naming the request. Both now name it (task, document),
    before anything is decoded."""
    lm = UnmaskLM(pretrained=str(tiny_dirs["llada"]), block_length=8, gen_length=16, device="cpu")
    _no_decoding(lm, monkeypatch)
    mask = lm.llm.tokenizer.convert_ids_to_tokens(lm.llm.config.mask_token_id)

    def reqs(bad: str) -> list[Instance]:
        return [Instance("generate_until", {}, (c, {"until": []}), 0, metadata=("t", d, 1))
                for d, c in enumerate(["hello", "what is 2 + 3?", bad])]

    with pytest.raises(InputError, match=r"request 2 \(t, doc 2\): the context is empty"):
        lm.generate_until(reqs("  "))
    with pytest.raises(InputError, match=r"request 2 \(t, doc 2\): the context holds the mask"):
        lm.generate_until(reqs(f"a {mask} b"))


def test_likelihood_refuses_the_mask_token(embedded: UnmaskLM) -> None:
    """Only the greedy check (a decode) refused the mask token; with greedy_check=false, and in
    loglikelihood_rolling, it was scored as a position to fill, silently."""
    assert not embedded.greedy_check
    mask = embedded.llm.tokenizer.convert_ids_to_tokens(embedded.llm.config.mask_token_id)
    ok = ("What is 2 + 3?", " 5")
    for args, part in [((f"a {mask} b", " c"), "context"), (("x", f" {mask}"), "continuation")]:
        with pytest.raises(InputError, match=f"loglikelihood request 1: the {part} holds the mask"):
            embedded.loglikelihood(requests("loglikelihood", [ok, args]))
    with pytest.raises(InputError, match="loglikelihood_rolling request 0: the document holds"):
        embedded.loglikelihood_rolling(requests("loglikelihood_rolling", [(f"a {mask} b",)]))


def test_a_lone_surrogate_is_named_not_a_tokenizer_type_error(embedded: UnmaskLM) -> None:
    """A context with a lone surrogate (a bad \\ud800 escape) stopped the run with the
    tokenizer's bare "TextEncodeInput must be Union[...]" TypeError."""
    bad = "hi \ud800 there"
    with pytest.raises(InputError, match="generate_until request 0.*lone surrogate"):
        embedded.generate_until(requests("generate_until", [(bad, {"until": ["\n"]})]))
    with pytest.raises(InputError, match="loglikelihood request 0.*lone surrogate"):
        embedded.loglikelihood(requests("loglikelihood", [(bad, " x")]))
    with pytest.raises(InputError, match="loglikelihood_rolling request 0.*lone surrogate"):
        embedded.loglikelihood_rolling(requests("loglikelihood_rolling", [(bad,)]))


@pytest.mark.parametrize("gold, output, right", [
    (".5", "#### 0.5", True), ("5", "#### .5", False),
    ("-.25", "so -0.25", True), ("25", "#### -.25", False),
    ("\u22125", "#### -5", True), ("5", "the answer is \u22125", False),
    ("1/2", "#### 0.5", True), ("1", "#### 1/2", False),
    ("1e3", "#### 1,000", True), ("1", "#### 1e3", False),
    ("1,234", "#### $1,234.00", True), ("5", "it costs $5.", True), ("5.00", "#### 5", True),
])
def test_gsm8k_reads_whole_numbers(gold: str, output: str, right: bool) -> None:
    """'.5' read as 5, '-.25' as 25, '1/2' as 1, '1e3' as 1 and a U+2212 minus as nothing, in
    the gold answer and the output alike: wrong outputs scored as right."""
    got = gsm8k_results({"answer": f"worked\n#### {gold}"}, [output])
    assert got == {"exact_match": float(right)}


def test_gsm8k_dataset_refuses_an_unreadable_gold_number(tmp_path: Path) -> None:
    from unmask.evaluation.tasks import gsm8k_dataset

    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "#### 4"}) + "\n"
                    + json.dumps({"question": "q", "answer": "#### 1/0"}) + "\n")
    with pytest.raises(InputError, match=r"g.jsonl:2: the answer's final '####' line has no "
                                         r"number: '1/0'"):
        gsm8k_dataset(gsm8k_path=str(data))


def test_one_line_errors_under_python_m_lm_eval(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    """`python -m lm_eval` (argv[0] lm_eval/__main__.py) printed a traceback where `lm_eval`
    printed one line: the hook looked at argv[0]'s name only."""
    import types

    from unmask.evaluation import harness

    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="lm_eval.__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/venv/lib/site-packages/lm_eval/__main__.py", "--model"])
    monkeypatch.setattr(sys, "excepthook", lambda *a: print("traceback", file=sys.stderr))
    harness._one_line_errors()
    sys.excepthook(InputError, InputError("unknown --model_args key 'x'"), None)
    sys.excepthook(RuntimeError, RuntimeError("a bug"), None)
    assert capsys.readouterr().err == ("lm_eval: error: unknown --model_args key 'x'\n"
                                       "traceback\n")


@pytest.mark.slow
def test_python_m_lm_eval_fails_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")}
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "unmask", "--model_args",
                          "badkey=1", "--tasks", "unmask_math", "--include_path", str(TASKS_DIR),
                          "--limit", "1", "--device", "cpu"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1].startswith("lm_eval: error: unknown --model_args "
                                                          "key 'badkey'")


@pytest.mark.parametrize("preset", ["fast", "balanced"])
def test_a_preset_runs_on_a_block_diffusion_model(tmp_path: Path, preset: str) -> None:
    """`--model_args pretrained=unmask-sdar,decoder=fast` failed mid-run ("suffix=structured
    cannot apply"): the spec was parsed before the model was known. It decodes as `unmask
    generate` decodes it (the model's blocks and cache)."""
    folder = tiny_model_dir(tmp_path, "sdar")
    lm = UnmaskLM(pretrained=str(folder), decoder=preset, gen_length=16, device="cpu")
    assert (lm.params.block_length, lm.params.cache, lm.params.suffix) == (4, "block", "full")
    (got,) = lm.generate_until(requests("generate_until", [("hello", {"until": []})]))
    assert got == lm.llm.generate("hello", preset, chat=False, gen_length=16)[0].text
    with pytest.raises(InputError, match="block_length=32 cannot apply"):
        UnmaskLM(pretrained=str(folder), decoder=preset, block_length=32, device="cpu")
