"""The machine's memory, read without torch: what `unmask show` sizes against and what the
prefix store's default budget is a share of; and this process's resident memory, which the load
log reports."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20
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


@dataclass(frozen=True)
class Resident:
    """This process's resident memory in bytes (Linux's /proc/self/status). `file` counts the
    pages of memory-mapped files (a checkpoint read through its mapping): clean pages the kernel
    drops under pressure without swapping, which `anonymous` (heap, tensors) does not count."""

    anonymous: int  # RssAnon
    file: int  # RssFile
    peak: int  # VmHWM: the most resident at once since the process started, mapped files included

    @property
    def total(self) -> int:
        return self.anonymous + self.file


    def note(self) -> str:
        """The load log's words for it."""
        return (f"process resident {mib(self.total)} ({mib(self.anonymous)} anonymous, "
                f"{mib(self.file)} in mapped files), peak {mib(self.peak)} so far")


def mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB"


_STATUS = {"RssAnon": "anonymous", "RssFile": "file", "VmHWM": "peak"}


def resident(status: Path = Path("/proc/self/status")) -> Resident | None:
    """This process's resident memory, or None where the kernel does not report it (not Linux)."""
    try:
        text = status.read_text()
    except OSError:
        return None
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in _STATUS:
            found[_STATUS[key]] = int(value.split()[0]) * 1024  # "123 kB"
    return Resident(**found) if len(found) == len(_STATUS) else None
