"""The engine: requests in, one `step()` at a time, events out.

`step()` = schedule -> run -> postprocess. The scheduler (plain Python) admits waiting
requests; each admitted request joins the batch of its decoder. Requests whose decoder specs
differ only in per-row knobs (seed, lengths, temperature, top_p, threshold, ...:
unmask.decoding.params.PER_ROW) share a decoder, hence a batch and one model call per step;
requests of different decoders (method and draft count, cache, suffix, block length, ...) are
in different batches, run one after another within the same step (interleaved, not fused). Finished and
aborted requests leave their batch at once.

A request's tokens never depend on who else is in its batch (tested): every per-row quantity
(blocks, suffix positions, cache decisions, sampling noise) is computed from the row's own
canvas, prompt and seed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from unmask.decoding.grammar import Constraint, check_decoder
from unmask.decoding.params import DecodeParams, batch_params
from unmask.engine.allocator import tune_for
from unmask.engine.batch import DecodeBatch
from unmask.engine.decoder import Decoder, StepResult
from unmask.engine.graphs import CudaGraphs
from unmask.engine.layout import block_size_of, canvas_length, for_model
from unmask.engine.prefix_store import PrefixStore, reuses
from unmask.engine.request import Request, StepEvent, useful_length
from unmask.engine.scheduler import JOINERS_FIRST_TOKENS, Scheduler, SchedulerConfig
from unmask.errors import CanvasTooLong, InputError

log = logging.getLogger("unmask.engine")


def decoder_key(params: DecodeParams) -> Hashable:
    """What decides which batch a request joins: its parameters, per-row knobs aside."""
    return batch_params(params)


@dataclass(frozen=True, eq=False)
class CheckedPrompt:
    """A prompt's token ids as `Engine.check` accepted them for `params` on `engine`."""

    ids: tuple[int, ...]
    params: DecodeParams
    engine: Engine


def _locked(method: Callable) -> Callable:
    """One engine call at a time: an abort from another thread in the middle of a step used to
    shrink the batch under it, and every other request of that batch failed with it."""
    @functools.wraps(method)
    def run(self: Engine, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


class Engine:
    def __init__(self, model: nn.Module, config: SchedulerConfig | None = None,
                 mask_id: int | None = None, eos_id: int | None = None,
                 prefix: PrefixStore | None = None, graphs: CudaGraphs | None = None) -> None:
        """mask_id / eos_id default to the model config's (tests override them). prefix: the
        store of finished blocks this engine reads and feeds (block-causal models' exact block
        cache only; several engines of one model may share one), or None: no reuse. graphs:
        whether calls replay CUDA graphs where they can (unmask.engine.graphs; None: never),
        with a K/V store of max_running rows per batch."""
        self.model = model
        # set for a block-causal model: its blocks, canvas and cache (unmask.engine.layout)
        self.block_size = block_size_of(model)
        if prefix is not None and prefix.block_size != self.block_size:
            raise InputError(f"a prefix store of blocks of {prefix.block_size} cannot serve a "
                             f"model of blocks of {self.block_size}")
        self.prefix = prefix
        c = model.config
        self.mask_id = c.mask_token_id if mask_id is None else mask_id
        self.eos_id = c.eos_token_id if eos_id is None else eos_id
        self.max_sequence_length = c.max_sequence_length
        self.scheduler = Scheduler(config or SchedulerConfig(), lambda r: decoder_key(r.params))
        # decided once, before any request (never mid-serve): the decoders capture iff set
        sized = dataclasses.replace(graphs, rows=self.scheduler.config.max_running) if graphs else None
        self.graphs = sized if sized is not None and sized.active(model) else None
        self.decoders: dict[Hashable, Decoder] = {}
        self.batches: dict[Hashable, DecodeBatch] = {}
        self.requests: dict[str, Request] = {}  # waiting or running
        self._pending: list[StepEvent] = []  # events of aborts between steps
        # Engine-wide NFE: forward passes, one per decoder batch per step that forwarded (the
        # runner makes one model call for the batch, however its attention is grouped), and one
        # more where rows joining a decoding batch first forward alone (Decoder._prime: the
        # decoders that commit before they forward); a step of joiners alone (joiners first)
        # is their batch's call of that step.
        self.model_calls = 0
        self.max_idle = 8  # decoders kept while they have no rows (_drop_idle)
        self.token_forwards = 0  # token positions those calls processed
        self._alone = False  # the last step was joining requests' alone (_joiners_first)
        self._lock = threading.RLock()  # add_request, abort and step (_locked)
        tune_for(model)  # a CPU forward's activations reuse freed memory (allocator.py)

    # --- requests ----------------------------------------------------------------------------
    @_locked
    def add_request(self, prompt_ids: list[int] | CheckedPrompt, params: DecodeParams,
                    request_id: str | None = None, trace: bool = False,
                    constraint: Constraint | None = None) -> Request:
        """Queue a request; it joins the running batch at the next step. A `CheckedPrompt` this
        engine's `check` made for these params is taken as checked (a server checks every prompt
        of an HTTP request before it submits any: each prompt is checked once)."""
        if isinstance(prompt_ids, CheckedPrompt):
            if prompt_ids.engine is self and prompt_ids.params is params:
                ids = list(prompt_ids.ids)
            else:
                ids = self.check_prompt(list(prompt_ids.ids), params)
        else:
            ids = self.check_prompt(prompt_ids, params)
        if request_id is not None and not isinstance(request_id, str):
            raise InputError(f"request_id must be a string, got {type(request_id).__name__}")
        kw = {} if request_id is None else {"request_id": request_id}
        params = self.params_for(params)
        if constraint is not None:
            check_decoder(constraint, params)
        req = Request(ids, params, trace=trace, block_size=self.block_size,
                      constraint=constraint, **kw)
        if req.request_id in self.requests:
            raise InputError(f"request id {req.request_id!r} is already in use")
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        return req

    def check(self, prompt_ids: list[int], params: DecodeParams) -> CheckedPrompt:
        """check_prompt's result, which add_request then takes without checking it again."""
        return CheckedPrompt(tuple(self.check_prompt(prompt_ids, params)), params, self)

    def params_for(self, params: DecodeParams) -> DecodeParams:
        """`params` as this engine's model decodes them (a block-causal model's own block length
        and cache), or the DecoderMismatch of a key that cannot apply to it."""
        return for_model(params, self.model)

    def check_prompt(self, prompt_ids: list[int], params: DecodeParams) -> list[int]:
        """The prompt's token ids as Python ints, or the InputError add_request would raise for
        this prompt and spec (a server checks every prompt of a request before it submits one).
        A canvas too long is a CanvasTooLong, since the spec's gen_length may be what the
        caller set. Token ids come as a list or tuple of integers (numpy's included) or a 1-D
        integer numpy array or torch tensor."""
        if not isinstance(params, DecodeParams):
            raise InputError(f"params must be a DecodeParams, got {type(params).__name__}")
        if isinstance(prompt_ids, (np.ndarray, torch.Tensor)):
            integer = (np.issubdtype(prompt_ids.dtype, np.integer)
                       if isinstance(prompt_ids, np.ndarray)
                       else not (prompt_ids.is_floating_point() or prompt_ids.is_complex()
                                 or prompt_ids.dtype == torch.bool))
            if prompt_ids.ndim != 1 or not integer:
                raise InputError(f"prompt_ids as an array must be 1-D of integers, got "
                                 f"{prompt_ids.ndim}-D {prompt_ids.dtype}")
            prompt_ids = prompt_ids.tolist()
        if not isinstance(prompt_ids, (list, tuple)):
            raise InputError(f"prompt_ids must be a list of token ids, got "
                             f"{type(prompt_ids).__name__}")
        if not prompt_ids:
            raise InputError("empty prompt: give the model something to answer")
        vocab = self.model.config.embedding_size
        # bool is an int to Python (numpy's bool_ is no Integral), but True as token id 1 is a
        # mistake, not a token; type(t) is int first, as numbers.Integral's ABC check costs ~20x
        bad = [t for t in prompt_ids if type(t) is not int and (
            not isinstance(t, numbers.Integral) or isinstance(t, (bool, np.bool_)))
            or not 0 <= t < vocab]
        if bad:
            raise InputError(f"prompt token ids must be integers in the model's vocabulary "
                             f"(0..{vocab - 1}); got {bad[0]!r:.40}")
        prompt_ids = list(map(int, prompt_ids))
        if self.mask_id in prompt_ids:
            # LLaDA's reference can fill it (its confidence competes with the current block's:
            # only positions past the block are cut), the engine would keep it masked: refused,
            # so that neither happens silently
            raise InputError(f"the prompt holds the mask token (id {self.mask_id}) at position "
                             f"{prompt_ids.index(self.mask_id)}: only the generated canvas is "
                             f"filled; infilling inside the prompt is not supported")
        params = self.params_for(params)
        total = len(prompt_ids) + canvas_length(len(prompt_ids), params.gen_length, self.block_size)
        if total > self.max_sequence_length:
            rounded = (f", {total} positions in the model's whole blocks"
                       if total != len(prompt_ids) + params.gen_length else "")
            raise CanvasTooLong(f"prompt ({len(prompt_ids)} tokens) + gen_length "
                                f"({params.gen_length}){rounded} exceeds max_sequence_length "
                                f"{self.max_sequence_length}; valid total: "
                                f"<= {self.max_sequence_length}")
        return prompt_ids

    @_locked
    def abort(self, request_id: str, reason: str = "abort") -> bool:
        """Stop a waiting or running request now (reason `abort`, or `stop` when the caller saw a
        stop string). Its event comes with the next `step()`. False if it is not in the engine."""
        if reason not in ("abort", "stop"):
            raise InputError(f"an abort's reason is 'abort' or 'stop', got {reason!r}")
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status == "waiting":
            self.scheduler.remove_waiting(request_id)
        else:
            key = decoder_key(req.params)
            b = self.batches[key]
            row = b.requests.index(req)
            req.token_ids = b.x[row, b.P : b.P + req.gen_length].tolist()
            if self._reuses(self.decoders[key]):  # a stopped answer's blocks: the next turn's
                self.prefix.offer(b, np.arange(len(b)) == row)
            b.filter([r is not req for r in b.requests])
        self._retire(req, reason)
        self._pending.append(self._final_event(req))
        return True

    def uncached(self, req: Request) -> int:
        """How many of a just-added request's prompt tokens its first step would forward: those
        the prefix store does not hold now (all of them when its decoder does not reuse the
        store, or there is none). A read-only look (PrefixStore.held), for the admission window."""
        if self.prefix is None or not reuses(req.params):
            return req.prompt_len
        return req.prompt_len - self.prefix.held(req)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    @property
    def n_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def n_running(self) -> int:
        return len(self.scheduler.running)

    # --- the step ----------------------------------------------------------------------------
    @_locked
    @torch.no_grad()
    def step(self) -> list[StepEvent]:
        events, self._pending = self._pending, []
        now = time.perf_counter()
        joining: dict[Hashable, list[Request]] = {}
        for req in self.scheduler.schedule():
            req.status, req.started = "running", now
            key = decoder_key(req.params)
            if key in self.decoders:  # most recently used last
                self.decoders[key] = self.decoders.pop(key)
                self.batches[key] = self.batches.pop(key)
            else:
                self.decoders[key] = Decoder(self.model, req.params, self.mask_id, self.eos_id,
                                             self.graphs)
                self.batches[key] = self.decoders[key].new_batch()
            joining.setdefault(key, []).append(req)
        for key, reqs in joining.items():  # one resize of each batch, whoever joins
            self.batches[key].extend(reqs)
            if self._reuses(self.decoders[key]):
                self.prefix.restore(self.batches[key], reqs)
        # never twice in a row: joins at every step would starve the batch
        self._alone = not self._alone and self._joiners_first(joining)
        if self._alone:
            for key, reqs in joining.items():  # they are their batch's last rows (extend)
                b = self.batches[key]
                events += self._run_rows(self.decoders[key], b,
                                         np.arange(len(b) - len(reqs), len(b)))
        else:
            for key, b in list(self.batches.items()):
                if len(b):
                    events += self._run(self.decoders[key], b)
        self._drop_idle()
        return events

    def _joiners_first(self, joining: dict[Hashable, list[Request]]) -> bool:
        """Whether this step is the joining requests' alone (SchedulerConfig.joiners_first):
        some join a batch whose rows are already decoding, and every batch they join commits in
        a row's first step (a decoder that commits before it forwards commits nothing there:
        its joiners take that forward in the batch's step, `Decoder._prime`), and their prompts'
        tokens the prefix store did not hold are at most JOINERS_FIRST_TOKENS (a short step).
        Their first tokens then leave after a step of their rows only, not of the whole batch;
        the batch's other rows, and batches nobody joined, take their step next time, which is
        never such a step again (`step`: requests joining then step with the batch)."""
        if not (joining and self.scheduler.config.joiners_first):
            return False
        reqs = [r for rs in joining.values() for r in rs]
        return (any(len(self.batches[k]) > len(r) for k, r in joining.items())
                and all(self.decoders[k].commits_first_step for k in joining)
                and sum(r.prompt_len - r.cached_tokens for r in reqs) <= JOINERS_FIRST_TOKENS)

    def _drop_idle(self) -> None:
        """Forget all but the `max_idle` most recently used decoders with no rows. An empty
        batch holds no canvas, so keeping a few saves the next request of their spec building
        them again (~0.15 ms); a server sees many specs, so not all. Of their K/V pools only the
        most recently used one's stays (`DecodeBatch.release_store`): the next burst of
        requests takes its rows instead of faulting in a new pool's memory."""
        idle = [key for key, b in self.batches.items() if not len(b)]
        for key in idle[: max(len(idle) - self.max_idle, 0)]:
            del self.batches[key], self.decoders[key]
        for key in idle[:-1]:  # the most recently used keeps its K/V pool for the next burst
            if key in self.batches:
                self.batches[key].release_store()

    def _run(self, dec: Decoder, b: DecodeBatch) -> list[StepEvent]:
        events, gone = self._stepped(dec, b)
        if gone.any():
            b.filter((~gone).tolist())
        return events

    def _run_rows(self, dec: Decoder, b: DecodeBatch, rows: np.ndarray) -> list[StepEvent]:
        """A step of b's rows `rows` (R',) alone (the whole batch when they are all of it):
        they step as a batch of their own would (`DecodeBatch.subset`, the same K/V store),
        and their state goes back to b."""
        if rows.size == len(b):
            return self._run(dec, b)
        sub = b.subset(rows)
        events, gone = self._stepped(dec, sub)
        b.put(rows, sub)
        if gone.any():
            keep = np.ones(len(b), dtype=bool)
            keep[rows[gone]] = False
            b.filter(keep.tolist())
        return events

    def _stepped(self, dec: Decoder, b: DecodeBatch) -> tuple[list[StepEvent], np.ndarray]:
        """A step of b: its events and (R,) the rows leaving it after the step (the caller
        drops them)."""
        trace = any(r.trace for r in b.requests)
        tok_fw_before = int(b.rows.tok_fw.sum())
        try:
            res = dec.step(b, trace=trace)
        except Exception as e:  # noqa: BLE001 - a failing batch must not take the engine down
            log.exception("a decoder step failed; its %d requests fail with it", len(b))
            return self._fail(b, f"{type(e).__name__}: {e}"), np.ones(len(b), dtype=bool)
        self.model_calls += res.model_calls
        gone = res.finished | res.stalled  # (R,) rows leaving the batch after this step
        if self._reuses(dec):
            self.prefix.offer(b, gone)
        self.token_forwards += int(b.rows.tok_fw.sum()) - tok_fw_before
        return self._events(dec, b, res), gone

    def _reuses(self, dec: Decoder) -> bool:
        """Whether `dec` reads and feeds the prefix store."""
        return self.prefix is not None and reuses(dec.params)

    def _events(self, dec: Decoder, b: DecodeBatch, res: StepResult) -> list[StepEvent]:
        gen = slice(b.P, b.S)
        x = b.x[:, gen]
        # Events report the gen_length positions a request asked for: a block-causal model's
        # canvas may reach further (to its last block's end), and its first block starts in the
        # prompt (unmask.engine.layout).
        budget = np.array([r.gen_length for r in b.requests], dtype=np.int64)
        inside = np.arange(x.shape[1])[None, :] < budget[:, None]
        # All rows' commits at once, (row, position) pairs in row order, split into rows.
        rows, cols = np.nonzero((x != res.before[:, gen]) & inside)
        d_rows, d_cols = np.nonzero(res.drafted[:, gen] & inside)
        masked = res.masked
        prefix = np.minimum(np.where(masked.any(-1), masked.argmax(-1), b.rows.end - b.P),
                            budget).tolist()
        start = res.block_start - b.P
        block_end = np.minimum(start + dec.params.block_length, budget).tolist()
        start = np.minimum(np.maximum(start, 0), budget).tolist()
        per_row = _split_rows(rows, cols.tolist(), len(b))
        tok_row = _split_rows(rows, x[rows, cols].tolist(), len(b))
        drafted_rows = _split_rows(d_rows, d_cols.tolist(), len(b))
        nfe, tok_fw, decided, steps = (b.rows.nfe.tolist(), b.rows.tok_fw.tolist(), b.rows.decided.tolist(),
                                       b.rows.step.tolist())
        forwarded, refreshed = res.forwarded.tolist(), res.refreshed.tolist()
        finished, stalled = res.finished.tolist(), res.stalled.tolist()
        now = time.perf_counter()
        events = []
        for i, req in enumerate(b.requests):
            req.nfe, req.token_forwards, req.decided, req.steps = nfe[i], tok_fw[i], decided[i], steps[i]
            ev = StepEvent(req.request_id, req.steps, per_row[i], tok_row[i], drafted_rows[i],
                           forwarded[i], refreshed[i], (start[i], block_end[i]), prefix[i],
                           req.nfe, req.token_forwards, req.decided)
            if req.trace and res.kept is not None:
                ev.suffix_kept = (np.nonzero(res.kept[i, b.P + block_end[i] : b.P + budget[i]])[0]
                                  + block_end[i]).tolist()
            if finished[i] or stalled[i]:
                req.token_ids = x[i, : req.gen_length].tolist()
                req.finished_at = now
                if stalled[i]:
                    req.error = ("no progress: a step committed nothing (the scores are not "
                                 "finite; check temperature and the model's logits)")
                    reason = "error"
                else:
                    reason = "eos" if self.eos_id in req.token_ids else "length"
                self._retire(req, reason)
                ev.finished, ev.error = reason, req.error
            events.append(ev)
        return events

    def _fail(self, b: DecodeBatch, message: str) -> list[StepEvent]:
        """Every request of b failed (the caller drops its rows)."""
        events = []
        for req in list(b.requests):
            req.error = message
            req.finished_at = time.perf_counter()
            self._retire(req, "error")
            events.append(self._final_event(req))
        return events

    def _retire(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = "finished", reason
        if req.token_ids is not None:
            req.useful = useful_length(req.token_ids, self.eos_id)
        if req.finished_at is None:
            req.finished_at = time.perf_counter()
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)
        if self.prefix is not None:
            self.prefix.forget(req.request_id)

    def _final_event(self, req: Request) -> StepEvent:
        return StepEvent(req.request_id, req.steps, [], [], [], False, False, (0, 0), 0, req.nfe,
                         req.token_forwards, req.decided, finished=req.finish_reason,
                         error=req.error)

    # --- a whole decode ----------------------------------------------------------------------
    def run(self, on_event: Callable[[StepEvent], None] | None = None) -> None:
        """Step until every request in the engine has finished; on_event sees every event."""
        while self.has_unfinished:
            for ev in self.step():
                if on_event is not None:
                    on_event(ev)


def _split_rows(rows: np.ndarray, values: list[int], n: int) -> list[list[int]]:
    """values (one per entry of `rows`, rows sorted) as n lists, one per row."""
    if n == 1:
        return [values]
    ends = np.searchsorted(rows, np.arange(n), side="right").tolist()  # past each row's last
    return [values[a:e] for a, e in zip([0, *ends[:-1]], ends, strict=True)]


@torch.no_grad()
def decode(model: nn.Module, params: DecodeParams, prompts: list[list[int]],
           max_running: int | None = None, mask_id: int | None = None,
           eos_id: int | None = None,
           on_event: Callable[[StepEvent], None] | None = None,
           constraints: list[Constraint | None] | None = None,
           prefix: PrefixStore | None = None,
           graphs: CudaGraphs | None = None) -> list[Request]:
    """Decode token-id prompts to completion (all admitted at once unless max_running);
    constraints: each prompt's structured-output constraint (None: none); prefix: the store of
    finished blocks' K/V to read and feed (None: no reuse); graphs: CUDA graphs (None: none)."""
    engine = Engine(model, SchedulerConfig(max_running=max_running or max(len(prompts), 1)),
                    mask_id, eos_id, prefix, graphs)
    constraints = constraints or [None] * len(prompts)
    reqs = [engine.add_request(p, params, constraint=c)
            for p, c in zip(prompts, constraints, strict=True)]
    engine.run(on_event)
    return reqs
