"""glibc's malloc, set for forward passes on the CPU (BENCHMARKS.md, "Host memory").

Each layer of a CPU forward allocates and frees activation tensors of ~0.1-30 MB. With glibc's
defaults, a freed block of that size goes back to the kernel (an munmap, or a trim of the heap's
top once more than ~2x the largest freed block is free there), so the next allocation faults its
pages in again, zeroed by the kernel: a `fast` decode of 32 prompts took ~200,000 page faults.
Two settings let the allocator keep and reuse those blocks instead:

- M_MMAP_THRESHOLD 32 MiB (glibc's upper limit on 64-bit): blocks up to that size come from the
  heap, not from mmap;
- M_TRIM_THRESHOLD 64 MiB: the heap's top is handed back only past that much free memory (twice
  the mmap threshold, glibc's own ratio; 256 MiB saved no more faults, and a server's threads
  each have a heap that may keep this much).

Set once per process, the first time an engine runs a model on the CPU. Not set when the user
set these thresholds themselves (MALLOC_MMAP_THRESHOLD_ and the like, or GLIBC_TUNABLES) or turned it off
(UNMASK_MALLOC=system), nor where the C library is not glibc (its mallopt does not exist there,
and a preloaded jemalloc or tcmalloc ignores glibc's settings anyway).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

from torch import nn

log = logging.getLogger("unmask")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20  # twice the mmap threshold, as glibc's own adjustment sets it
# The settings that a user's own choice of these thresholds goes by (MALLOC_<KEY>_ or
# GLIBC_TUNABLES=glibc.malloc.<key>=...); MALLOC_ARENA_MAX and the like do not count.
USER_KEYS = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")
OFF_SWITCH = "UNMASK_MALLOC"  # "system": leave the allocator as the C library set it

_state: str | None = None  # why it is or is not set, once decided


def tune_malloc() -> str:
    """Set the two thresholds once per process when they apply; returns what was decided:
    "set", or the reason it was not ("off", "user", "not glibc", "refused")."""
    global _state
    if _state is None:
        _state = _decide()
        log.debug("malloc thresholds for CPU forwards: %s", _state)
    return _state


def state() -> str | None:
    """What tune_malloc decided in this process (None: not yet)."""
    return _state


def tune_for(model: nn.Module) -> None:
    """tune_malloc when `model` runs on the CPU (a GPU's activations are not malloc's); looks
    at the model only until the process has decided."""
    if _state is None and next(model.parameters()).device.type == "cpu":
        tune_malloc()


def _decide() -> str:
    if os.environ.get(OFF_SWITCH, "").lower() == "system":
        return "off"
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(f"MALLOC_{k.upper()}_" in os.environ or f"glibc.malloc.{k}" in tunables for k in USER_KEYS):
        return "user"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    libc = ctypes.CDLL(None)
    # mallopt returns 1 on success; setting either also ends glibc's own adjustment of both.
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    return "set" if ok else "refused"
