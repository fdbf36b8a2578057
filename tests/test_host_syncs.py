"""Device-to-host crossings per engine step (unmask/syncs.py), counted on the CPU as a GPU would
make them: every `.item()`, `.cpu()`, `.tolist()`, `.numpy()`, tensor in an `if` and
`torch.nonzero` during `Engine.step`, the CPU-only shortcuts left out.

A step that forwards reads its scores once (`to_host`); the counts of each preset and family
are pinned here (docs/engine.md, "Host syncs"), so a read that slips into the hot path fails.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import peaky_model, reads_per_model_step

from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.syncs import SyncCounter, cpu_only, to_host, unpack

VOCAB, MASK, EOS = 64, 63, 1
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10], [20]]

# (family, decoder) -> device reads per step that calls the model. Every decoder reads its
# scores once; sampling reads once more (a huge temperature's fallback check, scoring._sample).
# LLaDA2's mixture of experts reads nothing in calls of up to FIXED_TOKENS tokens (its experts
# at fixed shapes, unmask.models.llada2; each MoE layer's counts above: test_llada2.py).
EXPECTED = {
    ("sdar", "threshold"): 1,
    ("sdar", "static"): 1,
    ("sdar", "static-1"): 1,
    ("sdar", "freedave++"): 1,
    ("sdar", "exact"): 1,
    ("sdar", "threshold,temperature=0.7"): 2,
    ("sdar", "fast"): 1,
    ("sdar", "balanced"): 1,
    ("llada", "static-1"): 1,
    ("llada", "threshold"): 1,
    ("llada", "static"): 1,
    ("llada", "exact"): 1,
    ("llada", "fast"): 1,
    ("llada", "balanced"): 1,
    ("llada2_moe", "threshold"): 1,
    ("llada2_moe", "static-1"): 1,
    ("llada2_moe", "exact"): 1,
    ("llada2_moe", "fast"): 1,
    ("Fast_dLLM_Qwen", "threshold"): 1,
    ("Fast_dLLM_Qwen", "static"): 1,
    ("Fast_dLLM_Qwen", "fast"): 1,
}


def syncs_per_call(kind: str, spec: str, concurrency: int) -> list[int]:
    """Device reads of each engine step that called the model (concurrency requests at once)."""
    model = peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)
    block = {"block_length": 4} if kind != "llada" else {"block_length": 8}
    params = DecodeParams.parse(spec, gen_length=16, **block)
    eng = Engine(model, SchedulerConfig(), mask_id=MASK, eos_id=EOS)
    for p in PROMPTS[:concurrency]:
        eng.add_request(p, params)
    return reads_per_model_step(eng)


@pytest.mark.parametrize(("kind", "spec"), list(EXPECTED))
def test_reads_per_step(kind: str, spec: str) -> None:
    for concurrency in (1, 4):
        counts = syncs_per_call(kind, spec, concurrency)
        assert counts and set(counts) == {EXPECTED[kind, spec]}, (concurrency, counts)


def test_counter_counts_each_kind_of_read() -> None:
    t = torch.arange(4.0)
    with SyncCounter(cpu_is_device=True).counting() as c:
        t[0].item()
        t.tolist()
        host = t.cpu()
        host.numpy()  # the host copy itself: no second crossing
        if t.sum():
            pass
        int(t[1])
        float(t[2])
        torch.nonzero(t)
        t.nonzero()
        [0, 1][t[1].long()]  # __index__
        torch.equal(t, t)
    assert dict(c.counts) == {"item": 1, "tolist": 1, "cpu": 1, "__bool__": 1, "__int__": 1,
                              "__float__": 1, "nonzero": 2, "__index__": 1, "equal": 1}
    with SyncCounter().counting() as c:  # a CPU run, not standing for a device
        t.tolist()
    assert c.total == 0
    t.tolist()  # uninstalled
    assert c.total == 0


def test_cpu_only_reads_are_not_counted() -> None:
    @cpu_only
    def shortcut(t: torch.Tensor) -> np.ndarray:
        return t.numpy()

    with SyncCounter(cpu_is_device=True).counting() as c:
        shortcut(torch.ones(2))
    assert c.total == 0


def test_to_host_is_one_read_and_exact() -> None:
    token = torch.tensor([0, 5, (1 << 53) - 1, 151_000])
    conf = torch.tensor([1.0, float("-inf"), float("nan"), 0.1 + 1e-8], dtype=torch.float32)
    ent = torch.tensor([0.0, 1e-30, 3.4e38, 2.5], dtype=torch.float32)
    with SyncCounter(cpu_is_device=True).counting() as c:
        out = to_host(token, conf, ent)
    assert c.total == 1
    # the device path: one packed float64 copy, unpacked to each dtype bit for bit
    packed = torch.cat([t.double() for t in (token, conf, ent)])
    for got in (out, unpack(packed, (token, conf, ent))):
        for a, want in zip(got, (token, conf, ent), strict=True):
            assert a.dtype == want.numpy().dtype
            assert a.tobytes() == want.numpy().tobytes()
