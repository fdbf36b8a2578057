"""Shared test helpers: tiny random models and model folders written by unmask itself.

Import from a test file as ``from helpers import tiny_model_dir`` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unmask.checkpoint import save_checkpoint
from unmask.config import ModelConfig
from unmask.models import build_model
from unmask.training.tokenizer import EOS as EOS_TOKEN
from unmask.training.tokenizer import MASK as MASK_TOKEN
from unmask.training.tokenizer import build_tokenizer, save_tokenizer

SENTENCES = [
    "hello world, this is a tiny tokenizer for tests.",
    "the quick brown fox jumps over the lazy dog.",
    "what is 12 + 34? the answer is 46.",
    "def add(a, b):\n    return a + b\n",
    "masked diffusion language models unmask tokens in parallel.",
    "sort the list [3, 1, 2] to get [1, 2, 3].",
] * 4

# A small, well-conditioned default: big enough weights that logits are far from ties (so batch
# padding or float noise cannot flip an argmax), small enough to run in milliseconds.
TINY = dict(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=64,
            max_sequence_length=256)


def as_torch(*arrays: Any) -> Any:
    """The engine's host arrays (numpy) as CPU tensors, for spies that compare them with torch
    (one value: returned as is; several: a tuple). Shares memory: clone to keep a copy."""
    out = tuple(torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
                for a in arrays)
    return out[0] if len(out) == 1 else out


def tiny_config(model_type: str = "llada", vocab_size: int = 300, **overrides: Any) -> ModelConfig:
    kw: dict[str, Any] = dict(TINY, model_type=model_type, vocab_size=vocab_size,
                              embedding_size=vocab_size, mask_token_id=2, eos_token_id=1)
    if model_type == "Dream":
        kw["qkv_bias"] = True
    if model_type == "sdar":
        kw["block_size"] = 4
    kw.update(overrides)
    return ModelConfig(**kw)


def tiny_model(model_type: str = "llada", seed: int = 0, std: float = 0.3, **overrides: Any):
    """A random model in eval mode; biases are made non-zero so they are exercised too."""
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = build_model(config)
    model.init_weights(std=std)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=std)
            elif p.dim() == 1:  # norm weights
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model.eval()


def tiny_tokenizer_dir(out: str | Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE (special tokens <|bos|>=0, <|eos|>=1, <|mask|>=2, <|user|>, <|assistant|>)
    with a tokenizer_config.json carrying a chat template."""
    tok = build_tokenizer(SENTENCES, vocab_size=vocab_size)
    assert tok.token_to_id(EOS_TOKEN) == 1 and tok.token_to_id(MASK_TOKEN) == 2
    return save_tokenizer(tok, out)


def tiny_model_dir(tmp_path: str | Path, model_type: str = "llada", name: str | None = None,
                   seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random `model_type` checkpoint (config.json, model.safetensors, tokenizer
    files) under tmp_path and return its folder. Overrides go to ModelConfig
    (e.g. max_sequence_length=40, weight_tying=True)."""
    out = Path(tmp_path) / (name or f"tiny-{model_type}")
    tok_dir = tiny_tokenizer_dir(out)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size()
    model = tiny_model(model_type, seed=seed, vocab_size=vocab, **overrides)
    save_checkpoint(model, out)
    return out


# The shared setting of the decode-loop tests (caching, suffix): vocabulary, three prompts with
# different left padding, lengths, and one spec per decoder.
VOCAB, MASK, EOS = 64, 63, 1
KINDS = ("llada", "Dream")
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9]]  # left padding 2 / 4 / 0
GEN, BLOCK = 32, 8
DECODERS = {
    "static": "static,steps=16",
    "static-1": "static-1",
    "threshold": "threshold,threshold=0.5",
    "freedave": "freedave,draft_steps=4",
    "freedave++": "freedave++,draft_steps=4,threshold=0.5",
}


# The block-diffusion families' own keys for a tiny model of blocks of 4: LLaDA2's mixture of
# experts as the published one is cut (shared expert, dense first layer, groups, half the head
# turned by RoPE), smaller.
BLOCK_FAMILIES: dict[str, dict[str, Any]] = {
    "sdar": {"block_size": 4},
    "llada2_moe": {"block_size": 4, "num_experts": 8, "num_experts_per_tok": 3, "n_group": 4,
                   "topk_group": 2, "num_shared_experts": 1, "moe_intermediate_size": 12,
                   "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                   "partial_rotary_factor": 0.5},
    "Fast_dLLM_Qwen": {"block_size": 4},
}


@functools.cache
def peaky_model(kind: str, seed: int, scale: float, vocab: int, mask: int, eos: int) -> torch.nn.Module:
    """A tiny random model with torch's default init scaled up: peaky, varied predictions, so
    threshold decoding commits several tokens and exactness tests have something to check."""
    config = ModelConfig(model_type=kind, d_model=32, n_heads=2,
                         n_kv_heads=1 if kind in ("Dream", "Fast_dLLM_Qwen") else 2,
                         n_layers=2, mlp_hidden_size=64, vocab_size=vocab, embedding_size=vocab,
                         mask_token_id=mask, eos_token_id=eos, max_sequence_length=128,
                         **BLOCK_FAMILIES.get(kind, {}))
    torch.manual_seed(seed)
    model = build_model(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return model.eval()


def assert_batch_invariant(model, make, target: list[int], others: list[tuple[list[int], int]],
                           join_at: int, abort_at: int, mask: int, eos: int) -> None:
    """A block model's request alone == in a batch == joining at step join_at beside `others`
    (prompt, gen_length) at other blocks and stages, running[0] aborted, a request of another
    decoder beside. make(gen_length, seed) -> the target's DecodeParams (seed 3) and the others'."""
    from unmask.engine import Engine, SchedulerConfig, decode

    def outcome(req) -> tuple:
        return req.token_ids, req.nfe, req.token_forwards, req.decided, req.finish_reason

    p = make(16, 3)
    want = outcome(decode(model, p, [target], mask_id=mask, eos_id=eos)[0])
    reqs = decode(model, p, [target] + [q for q, _ in others], mask_id=mask, eos_id=eos)
    assert outcome(reqs[0]) == want
    eng = Engine(model, SchedulerConfig(), mask_id=mask, eos_id=eos)
    running = [eng.add_request(q, make(gen, i)) for i, (q, gen) in enumerate(others)]
    other = type(p).parse("threshold,threshold=0.7", gen_length=16, block_length=p.block_length)
    eng.add_request(target[::-1], other)
    assert outcome(join_and_abort(eng, running, target, p, join_at, abort_at)) == want


def join_and_abort(eng, running: list, target: list[int], params, join_at: int, abort_at: int):
    """Step `eng` join_at times, add `target` with `params`, then run to the end, aborting
    running[0] (a request already in the engine) after abort_at steps; returns target's
    request (batch invariance: it must equal the request decoded alone)."""
    for _ in range(join_at):
        eng.step()
    req = eng.add_request(target, params)
    steps = 0
    while eng.has_unfinished:
        eng.step()
        steps += 1
        if steps == abort_at and not running[0].finished:
            assert eng.abort(running[0].request_id)
    return req


def assert_lm_eval_equals_unmask_eval(out: Path, tmp_path: Path, n: int, eval_args: list[str]) -> float:
    """lm-eval's logged unmask_math samples under `out` (--log_samples --output_path) against
    `unmask eval --task math --n N *eval_args`: same prompts, outputs, scores and accuracy.
    Returns the accuracy."""
    import glob
    import json

    import pytest

    from unmask.cli import main as unmask_main

    samples = [json.loads(line) for f in glob.glob(str(out / "**/samples_unmask_math_*.jsonl"),
                                                   recursive=True) for line in open(f)]
    samples.sort(key=lambda s: s["doc_id"])
    assert len(samples) == n

    ours = tmp_path / "unmask-eval.jsonl"
    assert unmask_main(["eval", "--task", "math", "--n", str(n), *eval_args, "--threads", "1",
                        "--samples", str(ours)]) == 0
    reference = [json.loads(line) for line in ours.open()]
    assert [s["doc"]["prompt"] for s in samples] == [r["prompt"] for r in reference]
    assert [s["resps"][0][0] for s in samples] == [r["text"] for r in reference]
    assert [s["acc"] for s in samples] == [float(r["correct"]) for r in reference]
    results = json.loads(open(glob.glob(str(out / "**/results_*.json"), recursive=True)[0]).read())
    acc = results["results"]["unmask_math"]["acc,none"]
    assert acc == pytest.approx(sum(r["correct"] for r in reference) / n)
    return acc


class LiveServer:
    """An ASGI app under uvicorn on a background thread, bound to 127.0.0.1 on a free port.

    A context manager: whatever happens (the server fails to start, the test fails), leaving
    it stops the server and joins its thread."""

    def __init__(self, app) -> None:
        import socket

        import uvicorn

        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.__exit__()
                raise AssertionError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    @property
    def engine(self):
        """The unmask server's engine (apps built by unmask.server.app.build_app)."""
        return self.app.state.unmask.engine.engine

    def client(self, timeout: float = 120):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=timeout, max_retries=0)


def unpacked_call(ids: torch.Tensor, pos: torch.Tensor, frame, logits_at):
    """A model call's inputs as (B, T) rows, whether or not the runner packed them: for test
    models that compute per row. Returns ids, pos and logits_at as (row, column) pairs."""
    if frame is None or not frame.packed:
        return ids, pos, logits_at
    where = frame.key_mask.nonzero()  # (N, 2): packed token -> (row, column)
    at = None if logits_at is None else (where[logits_at[1], 0], where[logits_at[1], 1])
    return frame.rows(ids), frame.rows(pos), at


def edit_config(folder: Path, **change: Any) -> None:
    """Set keys of folder's config.json (a value of ... removes the key)."""
    raw = json.loads((folder / "config.json").read_text())
    for k, v in change.items():
        if v is ...:
            raw.pop(k)
        else:
            raw[k] = v
    (folder / "config.json").write_text(json.dumps(raw))


def kv_forward(model: torch.nn.Module, block_size: int):
    """tests/block_reference.py's KVForward through our model (blocks of block_size): stored
    K/V attended with no mask (generate()'s block cache steps), or none and block-causal
    attention among the forwarded tokens."""
    from unmask.kv import Frame, PastKV

    def forward(ids: torch.Tensor, pos: torch.Tensor, past):
        if past is None:
            frame = Frame(blocks=pos // block_size)
        else:  # the frame's stored keys are position-major
            frame = Frame(past=PastKV([k.transpose(1, 2) for k, _ in past],
                                      [v.transpose(1, 2) for _, v in past]),
                          past_mask=torch.ones(1, past[0][0].shape[2], dtype=torch.bool))
        return model(ids, pos, frame=frame), frame.fresh

    return forward


def wrong_answers(answer: str) -> list[str]:
    """Up to three wrong answers of the same family as a held-out math answer."""
    if answer.isdigit():
        n = int(answer)
        return [str(n + 1), str(n + 10), str(n - 1) if n > 0 else str(n + 2)]
    parts = answer.split(", ")
    wrong = [", ".join(reversed(parts)), ", ".join(parts[1:] + parts[:1]),
             ", ".join(parts[:-1] + [str((int(parts[-1]) + 1) % 10)])]
    return [w for w in dict.fromkeys(wrong) if w != answer]


def math_choice_wins(lm: Any, n: int) -> tuple[int, int, float]:
    """The first n held-out math problems as multiple choice through an UnmaskLM's loglikelihood:
    context the prompt (chat template), continuations its worked solution ending in the true
    `#### answer` or in a wrong one (`wrong_answers`). Returns (problems whose true continuation
    scores above every wrong one, n, chance: the mean of 1 / choices)."""
    from lm_eval.api.instance import Instance

    from unmask.tasks import TASKS

    args, groups = [], []
    for ex in TASKS["math"].load("heldout", n):
        context = lm.apply_chat_template([{"role": "user", "content": ex.prompt}])
        body = ex.response[: ex.response.rindex("####") + 4]
        choices = [ex.answer, *wrong_answers(ex.answer)]
        groups.append(range(len(args), len(args) + len(choices)))
        args += [(context, f"{body} {a}") for a in choices]
    scores = [lp for lp, _ in lm.loglikelihood([Instance("loglikelihood", {}, a, i)
                                                for i, a in enumerate(args)])]
    wins = sum(all(scores[g[0]] > scores[j] for j in g[1:]) for g in groups)
    return wins, n, sum(1 / len(g) for g in groups) / n


def reads_per_model_step(eng) -> list[int]:
    """Device reads (unmask.syncs.SyncCounter, the CPU standing for a device) of each step of
    `eng` that called the model, run until its requests finish."""
    from unmask.syncs import SyncCounter

    counts = []
    while eng.has_unfinished:
        calls = eng.model_calls
        with SyncCounter(cpu_is_device=True).counting() as c:
            eng.step()
        if eng.model_calls > calls:
            counts.append(c.total)
    return counts
