"""The forward a CUDA graph holds (unmask/engine/buckets.py `BucketCall`, unmask/engine/graphs.py),
run on the CPU as a replay runs it:

- a bucket's call is made once and then called again and again from its persistent buffers,
  the inputs overwritten in place between calls: each call gives the bits of an eager forward
  of the same inputs, reads nothing from the host, and moves no buffer and no K/V storage;
- the engine with graphs on (everything but the capture call: the wrap here hands back the
  first call's output tensors, overwritten by every later call, as a replayed graph does) keeps
  its K/V store where it was allocated through joins and leaves, and decodes today's tokens;
- `--cuda-graphs` refuses what cannot run, in one line.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from helpers import peaky_model

from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig, decode
from unmask.engine import graphs as graphs_mod
from unmask.engine import runner as runner_mod
from unmask.engine.buckets import Bucket, BucketCall, Buckets, CallOut
from unmask.engine.decoder import Decoder
from unmask.engine.graphs import CudaGraphs
from unmask.engine.layout import for_model
from unmask.engine.request import Request
from unmask.errors import InputError
from unmask.kv import Frame, KVStore
from unmask.models import llada2
from unmask.suffix import make_suffix_policy
from unmask.syncs import SyncCounter

VOCAB, MASK, EOS = 64, 63, 1
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20]]
# nothing read on the host: block-causal, and bidirectional (padding keys masked out)
GRAPH_FAMILIES = ["sdar", "Fast_dLLM_Qwen", "llada", "Dream"]
BIDIRECTIONAL = ("llada", "Dream")


def random_inputs(g: torch.Generator, b: Bucket, store_rows: int, width: int,
                  ) -> dict[str, np.ndarray]:
    """Host arrays of bucket b's shapes: rows attending to their own first places and stored
    keys, block-causally, the last row padding."""
    r, t, k = b.rows, b.tokens, b.keys
    n_keys = torch.randint(1, k + 1, (r,), generator=g).numpy()
    start = n_keys  # forwarded positions follow the stored ones
    pos = start[:, None] + np.arange(t)[None]
    key_mask = np.ones((r, t), bool)
    key_mask[-1, 1:] = False  # a padding row: its first place only
    past_pos = np.arange(k)[None].repeat(r, 0)
    return {
        "ids": torch.randint(0, VOCAB - 1, (r, t), generator=g).numpy(),
        "pos": pos, "key_mask": key_mask, "blocks": pos // 4,
        "flat": ((np.arange(r) % store_rows)[:, None] * width + past_pos).reshape(-1),
        "past_mask": past_pos < n_keys[:, None], "past_blocks": past_pos // 4,
        "at_rows": np.repeat(np.arange(r), t), "at_cols": np.tile(np.arange(t), r),
    }


def eager_forward(model, store: KVStore, b: Bucket, a: dict[str, np.ndarray],
                  block_causal: bool) -> CallOut:
    """The same call built from fresh tensors, as a call outside the buckets is."""
    t = {n: torch.from_numpy(v) for n, v in a.items()}
    blocks = (t["blocks"], t["past_blocks"]) if block_causal else (None, None)
    frame = Frame(key_mask=t["key_mask"], past=store.read(t["flat"], (b.rows, b.keys)),
                  past_mask=t["past_mask"], blocks=blocks[0], past_blocks=blocks[1])
    with torch.no_grad():
        logits = model(t["ids"], t["pos"], frame=frame, logits_at=(t["at_rows"], t["at_cols"]))
    return logits, frame.fresh


@pytest.mark.parametrize("kind", GRAPH_FAMILIES)
def test_a_bucket_call_replays_from_its_buffers(kind: str) -> None:
    model = peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)
    c = model.config
    g = torch.Generator().manual_seed(0)
    store = KVStore.empty(c.n_layers, 3, c.n_kv_heads, 32, c.head_dim, torch.float32,
                          torch.device("cpu"))
    store.kv.copy_(torch.randn(store.kv.shape, generator=g))
    b = Bucket(rows=4, tokens=4, keys=16)
    buckets = Buckets("pow2", torch.device("cpu"), min_rows=16)
    block_causal = kind not in BIDIRECTIONAL
    call = buckets.bucket_call(model, b, store, block_causal=block_causal)
    buf = buckets.buffers[b]
    addresses = {n: t.data_ptr() for n, t in vars(buf).items()}
    store_at = store.kv.data_ptr()
    for _ in range(3):
        a = random_inputs(g, b, store.shape[0], store.shape[1])
        buf.fill(a)  # in place, as before a replay
        with SyncCounter(cpu_is_device=True).counting() as reads:
            logits, fresh = call()
        assert reads.total == 0, dict(reads.counts)
        want_logits, want_fresh = eager_forward(model, store, b, a, block_causal)
        assert torch.equal(logits, want_logits)
        for got, want in zip(fresh, want_fresh, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        assert {n: t.data_ptr() for n, t in vars(buf).items()} == addresses
        assert store.kv.data_ptr() == store_at
    assert buckets.bucket_call(model, b, store, block_causal=block_causal) is call  # made once


def replaying(call):
    """A CPU stand-in for `graphs.capture`: the first call's output tensors are the outputs of
    every later call, overwritten in place, as a replayed graph's are."""
    logits, fresh = call()

    def replay() -> CallOut:
        new_logits, new_fresh = call()
        logits.copy_(new_logits)
        for into, got in zip(fresh, new_fresh, strict=True):
            for x, y in zip(into, got, strict=True):
                x.copy_(y)
        return logits, fresh
    return replay


def graphs_decode(kind: str, spec: str, monkeypatch, batch: int, graphs: bool):
    """Each request's outcome, the logits of every call, and the K/V store's address at each
    step of each batch, with graphs on (the CPU standing for a device) or off (today's path:
    the calls as they come, attending in one call per shape as the buckets do)."""
    model = peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)
    seen: list[torch.Tensor] = []
    stores: list[int] = []
    real_score, real_write = runner_mod.score, KVStore.write

    def spy(logits, *a, **k):
        seen.append(logits.detach().clone())
        return real_score(logits, *a, **k)

    def write(self, *a, **k):
        stores.append(self.kv.data_ptr())
        return real_write(self, *a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(graphs_mod, "unsupported", lambda model: None)
        mp.setattr(runner_mod, "capturer", lambda: replaying)
        mp.setattr(runner_mod.Runner, "block_by_block", False)
        mp.setattr(runner_mod, "score", spy)
        mp.setattr(KVStore, "write", write)
        params = DecodeParams.parse(spec, gen_length=16, block_length=4)
        reqs = decode(model, params, PROMPTS, mask_id=MASK, eos_id=EOS, max_running=batch,
                      graphs=CudaGraphs("on") if graphs else None)
    return [(r.token_ids, r.nfe, r.token_forwards) for r in reqs], seen, stores


BLOCK_SPECS = ["threshold,threshold=0.7", "static-1", "freedave++,threshold=0.7"]
# a bidirectional model's caches: the prompt's K/V (prefix), and the suffix's (dual, entropy)
CACHED_SPECS = ["static-1,cache=prefix", "threshold,threshold=0.7,cache=dual", "fast"]


@pytest.mark.parametrize(("kind", "spec"), [
    *((k, s) for k in GRAPH_FAMILIES if k not in BIDIRECTIONAL for s in BLOCK_SPECS),
    *((k, s) for k in BIDIRECTIONAL for s in CACHED_SPECS)])
def test_graphs_on_give_todays_tokens_from_a_store_that_never_moves(kind: str, spec: str,
                                                                    monkeypatch) -> None:
    for batch in (1, 2):  # 2: requests join and leave a batch of 4 prompts
        want, want_logits, _ = graphs_decode(kind, spec, monkeypatch, batch, graphs=False)
        got, got_logits, stores = graphs_decode(kind, spec, monkeypatch, batch, graphs=True)
        assert got == want
        assert len(got_logits) == len(want_logits)
        for a, b in zip(got_logits, want_logits, strict=True):
            if kind in BIDIRECTIONAL:  # buckets of the eager call's attention shapes
                assert torch.equal(a, b)
            else:  # power-of-two buckets: masked padding keys round differently on the CPU
                torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        assert stores and len(set(stores)) == 1  # one store, one address, every step


def test_the_store_is_allocated_once_at_its_capacity(monkeypatch) -> None:
    model = peaky_model("sdar", 0, 4.0, VOCAB, MASK, EOS)
    monkeypatch.setattr(graphs_mod, "unsupported", lambda model: None)
    monkeypatch.setattr(runner_mod, "capturer", lambda: replaying)
    # the exact block cache
    params = for_model(DecodeParams.parse("static-1", gen_length=16, block_length=4), model)
    runner = runner_mod.Runner(model, params, MASK, EOS, make_suffix_policy(params),
                               CudaGraphs("on"))
    assert runner.captures and runner.buckets is not None
    dec = Decoder(model, params, MASK, EOS, CudaGraphs("on", rows=3))
    batch = dec.new_batch()
    assert batch.store.shape == (3, model.config.max_sequence_length)
    at = batch.store.kv.data_ptr()
    batch.extend([Request(PROMPTS[0], params, block_size=4)])
    batch.filter([False])  # the last row leaves: a growing pool would be compacted to nothing
    assert batch.store.shape == (3, model.config.max_sequence_length)
    assert batch.store.kv.data_ptr() == at
    # a long context is cut to max_keys, at a block's end
    assert CudaGraphs("on", rows=2, max_keys=62).store_capacity(model) == (2, 64)
    # eager decoding keeps the growing pool
    assert Decoder(model, params, MASK, EOS).new_batch().store.shape == (0, 0)


def test_cuda_graphs_on_where_they_cannot_run_is_one_line() -> None:
    sdar = peaky_model("sdar", 0, 4.0, VOCAB, MASK, EOS)
    with pytest.raises(InputError, match="need a CUDA device.*use --cuda-graphs auto or off"):
        CudaGraphs("on").active(sdar)
    assert not CudaGraphs("off").active(sdar)
    with pytest.raises(InputError, match="one of auto, on, off"):
        CudaGraphs("sometimes")


def test_auto_runs_eagerly_and_says_why_once(caplog) -> None:
    sdar = peaky_model("sdar", 0, 4.0, VOCAB, MASK, EOS)
    graphs_mod._logged.clear()
    with caplog.at_level(logging.INFO, logger="unmask.engine"):
        for _ in range(3):
            assert not CudaGraphs("auto").active(sdar)
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA graphs off: they need a CUDA device, and the model is on cpu"]


@pytest.mark.parametrize(("kind", "shape"), [
    ("llada", "buckets of power-of-two rows x forwarded tokens x stored keys at the eager call's "
              "attention shapes (a bidirectional canvas's padding keys masked)"),
    ("sdar", "power-of-two buckets of rows x forwarded tokens x stored keys")])
def test_the_start_up_log_says_the_buckets_once(kind: str, shape: str, monkeypatch,
                                                caplog) -> None:
    model = peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)
    monkeypatch.setattr(graphs_mod, "unsupported", lambda model: None)
    graphs_mod._logged.clear()
    with caplog.at_level(logging.INFO, logger="unmask.engine"):
        for _ in range(2):
            Engine(model, SchedulerConfig(max_running=3), MASK, EOS, graphs=CudaGraphs("on"))
    assert [r.getMessage() for r in caplog.records] == [
        f"CUDA graphs on: {type(model).__name__}'s calls in {shape}, padding queries dropped, "
        "each captured at its first call; calls reading more than 4096 stored keys run eagerly; "
        "K/V store preallocated, 3 rows x 128 positions"]


def test_what_a_graph_cannot_hold_is_named(monkeypatch) -> None:
    llada = peaky_model("llada", 0, 4.0, VOCAB, MASK, EOS)
    moe = peaky_model("llada2_moe", 0, 4.0, VOCAB, MASK, EOS)
    cuda = torch.device("cuda")
    with monkeypatch.context() as mp:
        mp.setattr(graphs_mod, "_device", lambda model: cuda)
        mp.setattr(torch.cuda, "is_available", lambda: True)
        assert graphs_mod.unsupported(llada) is None  # padding keys masked out
        assert graphs_mod.unsupported(moe) is None  # its calls up to graph_tokens are held
        mp.setattr(torch.cuda, "is_available", lambda: False)
        assert "no CUDA" in graphs_mod.unsupported(llada)


def test_calls_past_the_largest_bucket_run_eagerly_and_say_so_once(caplog) -> None:
    model = peaky_model("sdar", 0, 4.0, VOCAB, MASK, EOS)
    c = model.config
    store = KVStore.empty(c.n_layers, 1, c.n_kv_heads, 64, c.head_dim, torch.float32,
                          torch.device("cpu"))
    wrapped = []
    buckets = Buckets("pow2", torch.device("cpu"), 16, wrap=lambda call: wrapped.append(call) or call,
                      max_keys=16)
    graphs_mod._logged.clear()
    with caplog.at_level(logging.WARNING, logger="unmask.engine"):
        buckets.bucket_call(model, Bucket(4, 4, 16), store, True)
        buckets.bucket_call(model, Bucket(4, 4, 32), store, True)
        buckets.bucket_call(model, Bucket(4, 4, 64), store, True)
    assert len(wrapped) == 1  # the 16-key bucket only
    assert len(caplog.records) == 1 and "more than 16 stored keys run eagerly" in caplog.text


def test_a_capture_that_fails_runs_eagerly_and_says_so_once(caplog) -> None:
    model = peaky_model("sdar", 0, 4.0, VOCAB, MASK, EOS)

    def failing(call):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    buckets = Buckets("pow2", torch.device("cpu"), 16, wrap=failing)
    graphs_mod._logged.clear()
    b = Bucket(4, 4, 0)
    with caplog.at_level(logging.WARNING, logger="unmask.engine"):
        call = buckets.bucket_call(model, b, None, True)
        assert buckets.bucket_call(model, b, None, True) is call  # tried once
    assert isinstance(call, BucketCall)  # the eager call, which still runs
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA graph of bucket Bucket(rows=4, tokens=4, keys=0) not captured (RuntimeError: CUDA "
        "error: operation not permitted when stream is capturing); its calls run eagerly"]


def test_a_store_that_would_not_fit_is_refused_before_any_request(monkeypatch, caplog) -> None:
    model = peaky_model("sdar", 0, 4.0, VOCAB, MASK, EOS)
    monkeypatch.setattr(graphs_mod, "unsupported", lambda model: None)
    # 2 x 2 layers x 2 K/V heads x 16 wide x 4 bytes = 512 bytes a position, 128 positions a row
    monkeypatch.setattr(graphs_mod, "free_bytes", lambda device: 512 * 128 * 3)
    assert CudaGraphs("on", rows=3).active(model)
    with pytest.raises(InputError, match=r"--cuda-graphs on: the K/V store graphs preallocate "
                                         r"\(4 rows x 128 positions, 0.0 GiB\) does not fit.*"
                                         r"--max-running.*use --cuda-graphs auto or off"):
        Engine(model, SchedulerConfig(max_running=4), MASK, EOS, graphs=CudaGraphs("on"))
    graphs_mod._logged.clear()
    with caplog.at_level(logging.INFO, logger="unmask.engine"):
        engine = Engine(model, SchedulerConfig(max_running=4), MASK, EOS,
                        graphs=CudaGraphs("auto"))
    assert engine.graphs is None and "does not fit" in caplog.text
    assert Engine(model, SchedulerConfig(max_running=3), MASK, EOS,
                  graphs=CudaGraphs("auto")).graphs is not None


def test_llada2_calls_past_its_fixed_experts_run_eagerly_and_say_so_once(caplog) -> None:
    """LLaDA2's experts run at fixed shapes up to FIXED_TOKENS tokens a call (no host read:
    unmask.models.llada2); a bucket of more tokens would read the expert counts, so it is not
    captured, and the log says so once."""
    model = peaky_model("llada2_moe", 0, 4.0, VOCAB, MASK, EOS)
    most = llada2.FIXED_TOKENS
    assert model.graph_tokens == most
    wrapped = []
    buckets = Buckets("pow2", torch.device("cpu"), 16, wrap=lambda call: wrapped.append(call) or call)
    graphs_mod._logged.clear()
    with caplog.at_level(logging.WARNING, logger="unmask.engine"):
        for rows in (most // 4, most // 4 * 2, most // 4 * 4):
            buckets.bucket_call(model, Bucket(rows, 4, 0), None, True)
    assert len(wrapped) == 1  # the bucket of FIXED_TOKENS tokens only
    assert len(caplog.records) == 1
    assert f"calls of more than {most} tokens (LLaDA2Model's expert counts) run eagerly" in caplog.text
