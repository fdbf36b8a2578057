"""`--cuda-graphs`: one CUDA graph per shape bucket, captured once and replayed every step.

A graph replays the kernels it recorded on the addresses it recorded, so everything it reads
must stay where it was: the bucket's input buffers (unmask/engine/buckets.py, `BucketCall`) and
the K/V store, which is then allocated once at its full size (`CudaGraphs.store_capacity`) and
never compacted (unmask/engine/batch.py; only a row longer than it grows it, and the calls are
then made again). The graph-holdable forward does all the work
and is what the CPU tests run; this module only records it (`capture`) and decides whether to
(`CudaGraphs.active`). The capture call itself runs only on a GPU (scripts/gpu_check.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from unmask.config import ModelConfig
from unmask.engine.prefix_store import free_bytes
from unmask.errors import InputError

log = logging.getLogger("unmask.engine")

MODES = ("auto", "on", "off")
WARMUP_CALLS = 3  # eager calls on a side stream before a capture, as torch.cuda.graphs asks


@dataclass(frozen=True)
class CudaGraphs:
    """Whether an engine's calls replay CUDA graphs, and the K/V store they then need.

    mode: "on" (refused where graphs cannot run), "auto" (on where they can: a CUDA device and a
    build with CUDA; every family's bucketed forward reads nothing from the host), "off".
    rows: the store rows preallocated per decoder batch (the engine's max_running).
    max_keys: the most stored keys a captured bucket reads; a call past it runs eagerly (the
    log says so once): a bucket's buffers and graph grow with its keys."""

    mode: str = "auto"
    rows: int = 16
    max_keys: int = 4096

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"cuda_graphs must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.rows < 1 or self.max_keys < 1:
            raise InputError(f"cuda_graphs needs rows and max_keys >= 1: {self}")

    def active(self, model: nn.Module) -> bool:
        """Whether calls of `model` are captured: "on" where they cannot be (no CUDA, a model
        a graph cannot hold, a store that would not fit) is an InputError saying what works
        instead; "auto" there logs why once and runs eagerly."""
        if self.mode == "off":
            return False
        why = unsupported(model) or self.too_big(model)
        if why is None:
            _once(logging.INFO, self.plan(model))
            return True
        if self.mode == "on":
            raise InputError(f"--cuda-graphs on: {why}; use --cuda-graphs auto or off (eager "
                             "calls, the same tokens)")
        _once(logging.INFO, f"CUDA graphs off: {why}")  # auto
        return False

    def plan(self, model: nn.Module) -> str:
        """The start-up log's line on what graphs hold: the buckets, and the store they read."""
        rows, width = self.store_capacity(model)
        if getattr(model.config, "block_size", None):
            shape = "power-of-two buckets of rows x forwarded tokens x stored keys"
        else:  # unmask.engine.runner, Runner._buckets
            shape = ("buckets of power-of-two rows x forwarded tokens x stored keys at the eager "
                     "call's attention shapes (a bidirectional canvas's padding keys masked)")
        return (f"CUDA graphs on: {type(model).__name__}'s calls in {shape}, padding queries "
                f"dropped, each captured at its first call; calls reading more than "
                f"{self.max_keys} stored keys run eagerly; K/V store preallocated, {rows} rows x "
                f"{width} positions")

    def too_big(self, model: nn.Module) -> str | None:
        """Why one batch's preallocated K/V store would not fit the device's free memory, or
        None."""
        rows, width = self.store_capacity(model)
        need = rows * width * store_bytes_per_position(model)
        free = free_bytes(_device(model))
        if need <= free:
            return None
        return (f"the K/V store graphs preallocate ({rows} rows x {width} positions, "
                f"{need / 2**30:.1f} GiB) does not fit the device's free {free / 2**30:.1f} GiB "
                "(fewer rows: --max-running)")

    def store_capacity(self, model: nn.Module) -> tuple[int, int]:
        """(rows, positions) of a preallocated K/V store: each row as long as the model's
        context (to its last block's end) or max_keys, the fewer: a longer row grows the store,
        which moves it, and the buckets' calls are made again (those past max_keys run eagerly
        anyway). A context of 32k positions for every row would not fit most devices."""
        return self.rows, store_width(model.config, self.max_keys)


def store_width(config: ModelConfig, max_keys: int) -> int:
    """Positions of each row of a preallocated K/V store (`CudaGraphs.store_capacity`): the
    model's context or max_keys, the fewer, to the end of its block."""
    block = config.block_size or 1
    width = min(int(config.max_sequence_length), max_keys)
    return -(-width // block) * block


def unsupported(model: nn.Module) -> str | None:
    """Why calls of `model` cannot be captured here, or None."""
    device = _device(model)
    if device.type != "cuda":
        return f"they need a CUDA device, and the model is on {device.type}"
    if not torch.cuda.is_available():
        return "this torch build has no CUDA"
    return None


def store_bytes_per_position(model: nn.Module) -> int:
    """Bytes of K/V one stored position holds: 2 x layers x K/V heads x head width values."""
    c = model.config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * next(model.parameters()).element_size()


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


_logged: set[str] = set()


def _once(level: int, message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.log(level, message)


def capture_failed(bucket: object, error: Exception) -> None:
    """Log once that a bucket's capture failed and its calls run eagerly."""
    _once(logging.WARNING, f"CUDA graph of bucket {bucket} not captured ({type(error).__name__}: "
          f"{str(error).splitlines()[0] if str(error) else ''}); its calls run eagerly")


def eager(call: Callable[[], Any]) -> Callable[[], Any]:
    """A bucket's call as it is (no capture)."""
    return call


def capturer() -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """`capture` into one memory pool for all the graphs of one runner: its buckets' calls
    never overlap, and each call's outputs are read (scored, stored, or copied out) before the
    next bucket's replay, so they may share their activations' memory."""
    pool = torch.cuda.graph_pool_handle()
    return lambda call: capture(call, pool)


def capture(call: Callable[[], Any], pool: Any = None) -> Callable[[], Any]:
    """`call` recorded as a CUDA graph (in memory `pool`, None: its own): warm-up calls on a
    side stream (torch.cuda.graphs' rule), one captured call, then each call replays it and
    returns the captured call's outputs, overwritten in place by the replay. The log says what
    each capture took."""
    start, held = time.perf_counter(), torch.cuda.memory_reserved()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_CALLS):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = call()
    log.info("CUDA graph of bucket %s captured in %.0f ms, %.1f MiB more reserved",
             getattr(call, "bucket", "?"), 1000 * (time.perf_counter() - start),
             (torch.cuda.memory_reserved() - held) / 2**20)

    def replay() -> Any:
        graph.replay()
        return out
    return replay


def beyond_buckets(what: str) -> None:
    """Log once that calls beyond what graphs hold (`what`) run eagerly."""
    _once(logging.WARNING, f"CUDA graphs: calls {what} run eagerly")
