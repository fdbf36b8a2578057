"""A request: one prompt's decode, from admission to its finish, and the events a step reports.

The request owns what is per-user: prompt, decoder parameters, its seed-derived noise key,
counters and timing. Its arrays (canvas row, K/V rows) live in the batch of its decoder
(`unmask.engine.batch`), addressed by the request's row there.
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from unmask.decoding.grammar import Constraint
from unmask.decoding.params import DecodeParams
from unmask.engine.layout import canvas_length

# Why a request finished. `eos`/`length` are the decode's own ends (OpenAI's "stop" and
# "length"); `stop`: a caller saw a stop string; `abort`: cancelled; `error`: failed alone.
FINISH_REASONS = ("eos", "length", "stop", "abort", "error")

_ids = itertools.count()


def useful_length(token_ids: list[int], eos_id: int) -> int:
    """Tokens up to (not including) the first EOS."""
    return token_ids.index(eos_id) if eos_id in token_ids else len(token_ids)


def noise_key(seed: int, prompt_ids: list[int]) -> int:
    """The request's sampling-noise key: its seed mixed with its prompt, so two prompts with the
    same seed draw different noise while the same (prompt, seed) always draws the same."""
    digest = zlib.crc32(",".join(map(str, prompt_ids)).encode())
    return (seed * 2_654_435_761 + digest) % (1 << 61)


@dataclass
class Request:
    prompt_ids: list[int]
    params: DecodeParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    trace: bool = False  # events carry per-step detail (suffix positions) for visual clients
    block_size: int | None = None  # the model's, when it is block-causal (sets the canvas)
    arrival: float = field(default_factory=time.perf_counter)
    constraint: Constraint | None = None  # structured output: what the row's commits must keep
    status: str = "waiting"  # waiting | running | finished
    # --- filled by the engine
    token_ids: list[int] | None = None  # the gen_length generated tokens, once finished
    useful: int = 0  # of those, the tokens up to the first EOS (the answer's length)
    nfe: int = 0  # model calls this request took part in
    token_forwards: int = 0  # token positions those calls processed for it
    decided: int = 0  # generated positions committed by a forward's decision (not EOS fill)
    cached_tokens: int = 0  # prompt positions whose K/V came from the prefix store, not forwarded
    # the prefix store's keys of its prompt's blocks, hashed once (prefix_store.PromptKeys)
    prompt_keys: Iterable[bytes] | None = field(default=None, repr=False, compare=False)
    steps: int = 0
    started: float | None = None  # when its first step began
    finished_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        self.noise_key = noise_key(self.params.seed, self.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def gen_length(self) -> int:
        return self.params.gen_length

    @property
    def canvas(self) -> int:
        """Generated positions on its canvas: gen_length, or for a block-causal model up to the
        end of the block holding the last of them (unmask.engine.layout.canvas_length)."""
        return canvas_length(self.prompt_len, self.gen_length, self.block_size)

    @property
    def slots(self) -> int:
        """Canvas positions the request holds: prompt + generated."""
        return self.prompt_len + self.canvas

    @property
    def seconds(self) -> float:
        """Wall time from its first step to its finish (0 before)."""
        if self.started is None or self.finished_at is None:
            return 0.0
        return self.finished_at - self.started

    @property
    def tpf(self) -> float:
        """Tokens per forward: generated positions committed by forwards' decisions, per model
        call the request took part in (docs/design.md § Metrics)."""
        return self.decided / self.nfe if self.nfe else 0.0

    @property
    def tps(self) -> float:
        """Useful tokens per second of its decode (0 before it finishes)."""
        return self.useful / self.seconds if self.seconds > 0 else 0.0

    @property
    def finished(self) -> bool:
        return self.status == "finished"


@dataclass
class StepEvent:
    """What one engine step did for one request. Positions are offsets into the generated
    region (0 .. gen_length-1)."""

    request_id: str
    step: int  # the request's step count after this step
    positions: list[int]  # committed this step (EOS fill by early exit included)
    tokens: list[int]  # the tokens at `positions`
    drafted: list[int]  # of `positions`, those accepted from FreeDave drafts past the rule's step
    forwarded: bool  # a model call ran for this request in this step
    refreshed: bool  # that call recomputed every position (a full K/V refresh)
    block: tuple[int, int]  # the current block [start, end) before this step's commits
    prefix: int  # generated positions committed contiguously from the start
    nfe: int  # running totals
    token_forwards: int
    decided: int
    suffix_kept: list[int] | None = None  # trace only: suffix offsets that took part
    finished: str | None = None  # a FINISH_REASONS value once the request is done
    error: str | None = None
