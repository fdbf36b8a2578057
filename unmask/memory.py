"""The machine's memory, read without torch: what `unmask show` sizes against and what the
prefix store's default budget is a share of."""

from __future__ import annotations

import os
from pathlib import Path

GIB = 1 << 30
# The prefix store's default budget: this share of the memory free on the model's device once
# it is loaded (docs/engine.md, "Prefix reuse").
PREFIX_SHARE = 0.1


def available_ram() -> int:
    """MemAvailable of /proc/meminfo (Linux: what can be allocated without swapping), else
    the free pages sysconf reports."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
