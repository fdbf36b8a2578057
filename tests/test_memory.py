"""This process's resident memory as unmask.memory reads it, and the load log that reports it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from unmask import LLM
from unmask.memory import Resident, resident

STATUS = """Name:\tpython
VmPeak:\t 1000000 kB
VmHWM:\t  300000 kB
VmRSS:\t  250000 kB
RssAnon:\t  200000 kB
RssFile:\t   50000 kB
RssShmem:\t       0 kB
"""


def test_resident_reads_the_anonymous_and_mapped_pages_and_the_peak(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text(STATUS)
    r = resident(status)
    assert r == Resident(anonymous=200000 * 1024, file=50000 * 1024, peak=300000 * 1024)
    assert r.total == 250000 * 1024
    assert r.note() == ("process resident 244.1 MiB (195.3 MiB anonymous, 48.8 MiB in mapped "
                        "files), peak 293.0 MiB so far")


@pytest.mark.parametrize("text", ["Name:\tpython\nVmRSS:\t 1 kB\n", None])
def test_resident_is_none_where_the_kernel_does_not_say(tmp_path: Path, text: str | None) -> None:
    status = tmp_path / "status"
    if text is not None:
        status.write_text(text)
    assert resident(status) is None


@pytest.mark.skipif(resident() is None, reason="no /proc/self/status here")
def test_the_load_log_says_the_process_memory(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="unmask"):
        llm = LLM(device="cpu")
    assert isinstance(llm.load_memory, Resident)
    line = next(r.getMessage() for r in caplog.records if r.name == "unmask")
    assert line.endswith(f"{llm.load_note}; {llm.load_memory.note()}")
    assert "; process resident " in line
