"""The allocator setting for CPU forwards (unmask/engine/allocator.py): process-wide, so each case
runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Page faults of a batched decode on the embedded model, after a first decode has warmed up the
# heap; the engine sets the allocator itself (or, with UNMASK_MALLOC=system, does not).
PROBE = """
import resource
import torch
from unmask.api import LLM
from unmask.engine.allocator import tune_malloc
torch.set_num_threads(1)
llm = LLM()
prompts = [f"What is {a} + {b}?" for a, b in [(47, 38), (12, 9), (305, 417), (8, 8), (66, 71),
                                              (120, 5), (9, 99), (31, 13)]]
llm.generate(prompts[:1], "threshold", gen_length=64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
llm.generate(prompts, "threshold", gen_length=128, batch_size=8)
print(tune_malloc(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(code: str = PROBE, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "UNMASK_MALLOC")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, check=True,
                         capture_output=True, text=True, timeout=300).stdout.split()
    return out[-2], int(out[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_decode_reuses_freed_activations_instead_of_faulting_them_in() -> None:
    state, tuned = _probe()
    if state == "not glibc":
        pytest.skip("this C library is not glibc")
    assert state == "set"
    off, untuned = _probe(UNMASK_MALLOC="system")
    assert off == "off"
    # Measured: 34,000-45,000 faults untuned, ~7,500 tuned (first touches of the heap remain).
    assert tuned < untuned / 3, (tuned, untuned)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_users_own_thresholds_win() -> None:
    code = "from unmask.engine.allocator import tune_malloc; print(tune_malloc(), 0)"
    assert _probe(code, MALLOC_TRIM_THRESHOLD_="131072")[0] in ("user", "not glibc")
    assert _probe(code, GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")[0] in ("user", "not glibc")
    assert _probe(code, MALLOC_ARENA_MAX="2")[0] in ("set", "not glibc")  # not a threshold
