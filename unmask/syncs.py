"""Device-to-host crossings: reading a step's results in one copy (`to_host`), and counting the
crossings a piece of code makes (`SyncCounter`).

On a GPU every read of device memory from Python (`.item()`, `.cpu()`, `.tolist()`, a tensor in
an `if`, `torch.nonzero`) waits for the device to finish all the work queued before it: the host
then queues the next kernels only after the read returns, and the device idles meanwhile. A step
that reads its results once waits once. On the CPU the "device" is the host, and nothing waits,
so the counter can count the reads the same code would make on a GPU (`cpu_is_device=True`).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

F = TypeVar("F", bound=Callable[..., Any])

# Functions whose host reads happen only when their tensor is already on the CPU (a faster CPU
# path beside the device's own): the counter leaves them out, so that a CPU run counts what the
# same step would read on a GPU.
_CPU_ONLY: set[CodeType] = set()
_counters: list[SyncCounter] = []  # those installed (`SyncCounter.counting`), innermost last


def cpu_only(fn: F) -> F:
    """Marks `fn` as reading tensors on the host only when they are CPU tensors (its device path
    reads nothing): `SyncCounter` does not count its reads."""
    _CPU_ONLY.add(fn.__code__)
    return fn


@cpu_only
def to_host(*tensors: Tensor) -> list[np.ndarray]:
    """Tensors of one device (each 1-D, of any lengths: int64 below 2^53, float32 or bool) as
    numpy arrays, in one device-to-host copy: on a device they are packed into one float64
    tensor, which holds each of those values exactly, and unpacked on the host. CPU tensors are
    read in place."""
    if tensors[0].device.type == "cpu":
        for c in _counters:
            c.note("to_host")  # the one copy a device would make
        return [t.numpy() for t in tensors]
    return unpack(torch.cat([t.double() for t in tensors]).cpu(), tensors)


NUMPY_DTYPE = {torch.int64: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


def unpack(packed: Tensor, like: tuple[Tensor, ...]) -> list[np.ndarray]:
    """float64 host tensor of `like`'s values one after another -> arrays of their lengths and
    dtypes."""
    flat = packed.numpy()
    ends = np.cumsum([t.shape[0] for t in like]).tolist()
    return [flat[end - t.shape[0] : end].astype(NUMPY_DTYPE[t.dtype])
            for end, t in zip(ends, like, strict=True)]


def _in_cpu_only(frame: FrameType | None) -> bool:
    """Whether the frame is a `cpu_only` function's, or a comprehension inside one."""
    while frame is not None and frame.f_code.co_name.startswith("<"):  # <listcomp>, <genexpr>
        frame = frame.f_back
    return frame is not None and frame.f_code in _CPU_ONLY


# Tensor methods that move a tensor's data to the host (Python numbers, numpy or a CPU copy),
# and torch functions that do (a data-dependent shape, a Python bool).
READS = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
         "nonzero", "equal")
FREE_READS = ("nonzero", "equal")


class SyncCounter:
    """Counts device-to-host reads by name (`counts`, `total`) while installed (`counting`).

    cpu_is_device: count reads of CPU tensors too (a CPU run standing for a GPU one), except the
    result of a counted `.cpu()` (the host copy itself) and reads inside `cpu_only` functions.
    Otherwise only tensors on another device count."""

    def __init__(self, cpu_is_device: bool = False) -> None:
        self.cpu_is_device = cpu_is_device
        self.counts: Counter[str] = Counter()
        self._thread = threading.get_ident()  # reads of other threads (a server's) are theirs

    def note(self, name: str) -> None:
        """Count one crossing that a CPU path stands for (`to_host`), on this counter's thread."""
        if self.cpu_is_device and threading.get_ident() == self._thread:
            self.counts[name] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _crosses(self, t: Tensor, caller: FrameType) -> bool:
        if threading.get_ident() != self._thread:
            return False
        if t.device.type != "cpu":
            return True
        return (self.cpu_is_device and not getattr(t, "_unmask_host", False)
                and not _in_cpu_only(caller))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(t: Tensor, *args: Any, **kwargs: Any) -> Any:
            crossing = self._crosses(t, sys._getframe(1))
            out = original(t, *args, **kwargs)
            if crossing:
                self.counts[name] += 1
                if name == "cpu" and out is t:
                    # on the CPU, .cpu() is the tensor itself: mark an alias as the host copy
                    out = t.detach()
                    out._unmask_host = True
            return out
        return read

    @contextmanager
    def counting(self) -> Iterator[SyncCounter]:
        methods = {n: getattr(Tensor, n) for n in READS}
        functions = {n: getattr(torch, n) for n in FREE_READS}
        try:
            for owner, saved in ((Tensor, methods), (torch, functions)):
                for n, f in saved.items():
                    setattr(owner, n, self._wrap(n, f))
            _counters.append(self)
            yield self
        finally:
            _counters.remove(self)
            for owner, saved in ((Tensor, methods), (torch, functions)):
                for n, f in saved.items():
                    setattr(owner, n, f)
