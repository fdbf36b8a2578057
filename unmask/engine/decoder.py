"""One step of one decoder over its batch, in one of two orders (docs/engine.md, "A step's order"):

- forward -> commit -> finish, for a decoder without drafts whose rule runs on the host: each
  row's canvas is forwarded, then the rule's step commits from that forward's scores;
- draft -> forward -> verify -> accept -> finish, for FreeDave and for a rule on the device: the
  rule's step and the drafts commit from the last forward's scores, the forward scores (and
  verifies) them. A row that has just joined has no predictions yet, so its only draft is its
  canvas and its first step is the forward that scores it (`Decoder._prime`).

A plain decoder (static, static-1, threshold) is the one-draft case: its only draft is the rule's
step, which is always accepted. FreeDave adds drafts that commit more of the same ranking and
keeps the longest chain that the rule itself would have produced (docs/design.md § FreeDave).
All rows of the batch and all drafts of a row go through one model call per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from unmask.caching import StepView, make_cache_policy
from unmask.decoding.grammar import Constraint, masks_for
from unmask.decoding.knobs import entry
from unmask.decoding.methods import BlockSchedule, make_method
from unmask.decoding.params import DecodeParams, batch_params
from unmask.decoding.rules import candidate_ranks, select_top
from unmask.engine.batch import DecodeBatch
from unmask.engine.commit import make_commit
from unmask.engine.graphs import CudaGraphs
from unmask.engine.layout import make_layout
from unmask.engine.runner import Forwarded, ForwardPlan, Runner, StoreRead
from unmask.suffix import make_suffix_policy

DRAFT_LOGITS = 1 << 26  # logits a row's drafts may make a step (256 MiB in float32)


@dataclass
class Drafts:
    x: np.ndarray  # (D, S) draft canvases
    parent: np.ndarray  # (D,) row each draft belongs to
    new_entropy: np.ndarray  # (D,) max entropy of the tokens the draft committed (-inf: none)
    added: np.ndarray  # (D, S) bool slots the draft committed
    k: np.ndarray  # (D,) the draft's number within its row (0: the rule's own step)

    def take(self, index: np.ndarray) -> Drafts:
        return Drafts(self.x[index], self.parent[index], self.new_entropy[index],
                      self.added[index], self.k[index])


@dataclass
class StepResult:
    """What a step did to the batch's rows (indexed like the batch before any filtering)."""

    before: np.ndarray  # (R, S) canvases before the step
    drafted: np.ndarray  # (R, S) bool slots accepted from drafts past the rule's own step
    forwarded: np.ndarray  # (R,) bool a model call ran for the row (for any of its drafts)
    refreshed: np.ndarray  # (R,) bool that call was a full refresh of the accepted draft
    kept: np.ndarray | None  # (R, S) bool slots in the row's forward (None: not recorded)
    block_start: np.ndarray  # (R,) slot of each row's current block before the step
    stalled: np.ndarray  # (R,) bool a row that had predictions committed nothing
    finished: np.ndarray  # (R,) bool rows done after this step
    masked: np.ndarray  # (R, G) bool generated slots still [MASK] after the step
    model_calls: int  # model calls the step ran (for some draft: maybe not the accepted one)


class Decoder:
    """The decoding method, cache policy and suffix policy of one decoder spec, its per-row knobs
    aside (unmask.decoding.params.PER_ROW): each row's are in its batch's `rows.knobs`."""

    def __init__(self, model: nn.Module, params: DecodeParams, mask_id: int, eos_id: int,
                 graphs: CudaGraphs | None = None) -> None:
        """graphs: set when the runner's calls replay CUDA graphs (None: never); the batches'
        K/V stores are then preallocated (unmask.engine.graphs)."""
        # per-row knobs at their defaults, so that nothing here reads one request's values
        params = batch_params(params)
        self.model, self.params = model, params
        self.mask_id, self.eos_id = mask_id, eos_id
        self.method = make_method(params)
        # All of a row's drafts go through one model call, each scoring up to block_length
        # positions over the vocabulary: a row's drafts are capped so their logits stay within
        # DRAFT_LOGITS values. The cap depends on the spec and the model only, never on the
        # batch, and fewer drafts change no token (FreeDave is lossless), only the speed.
        vocab = model.config.vocab_size
        self.n_drafts = min(self.method.n_drafts,
                            1 + max(DRAFT_LOGITS // (params.block_length * vocab), 1))
        self.cache = make_cache_policy(params)
        self.layout = make_layout(model, params)  # where blocks lie (block-causal or not)
        self.always_draws = entry("remasking", params.remasking).facts.needs_noise
        self.suffix = make_suffix_policy(params)
        self.runner = Runner(model, params, mask_id, eos_id, self.suffix, graphs)
        self.device = self.runner.device
        # where the rule runs, and so when a forward's scores are read (unmask.engine.commit)
        self.commit = make_commit(self.device, self.method)
        # A step's order (docs/engine.md, "A step's order"). Forward, then commit from that
        # forward's scores, where the rule reads them at once: a row's first step commits its
        # first tokens, and a step's commits reach the client without waiting for another
        # forward. Commit, then forward (the rule reads the last step's scores) where a forward
        # verifies the drafts committed before it (FreeDave), and where the rule runs on the
        # device, whose scores are read when the next step needs them (unmask.engine.commit).
        forward_first = self.commit.reads_at_once and not self.method.drafts
        self._order: Callable[[DecodeBatch, bool], StepResult] = (
            self._forward_then_commit if forward_first else self._commit_then_forward)
        self.commits_first_step = forward_first  # a row's first step commits its first tokens
        self.store_capacity = graphs.store_capacity(model) if self.runner.captures else None

    def new_batch(self) -> DecodeBatch:
        shape = None
        if self.cache.uses_store:
            c = self.model.config
            shape = (c.n_layers, c.n_kv_heads, c.head_dim, next(self.model.parameters()).dtype)
        return DecodeBatch(self.mask_id, self.eos_id, self.device, shape, self.store_capacity)

    # --- the step ----------------------------------------------------------------------------
    def step(self, b: DecodeBatch, trace: bool = False) -> StepResult:
        """One step of the batch's rows, in this decoder's order (`__init__`)."""
        return self._order(b, trace)

    def _forward_then_commit(self, b: DecodeBatch, trace: bool) -> StepResult:
        """Forward each row's canvas, then commit the rule's step from those scores (one draft
        a row: the rule's own)."""
        before = b.x.copy()
        rows = np.arange(len(b))
        cons = self._constraints(b, rows)
        if cons is not None:
            self._scaffold(b, cons)
        gen_masked = self._gen_masked(b, b.x)  # (R, G)
        start = self._block_start(b, gen_masked, b.rows.pad)
        # the canvas as its own draft: what the last rule step committed (the cache plan reads it)
        canvas = Drafts(b.x, rows, b.rows.new_entropy, np.zeros(b.x.shape, dtype=bool),
                        np.zeros_like(rows))
        # A row still here is not ready to exit: the commits that made it so finished it. Only
        # a scaffold written this step can have settled a canvas up to an EOS.
        exit_ready = None if cons is None else self._ready_to_exit(b, canvas, gen_masked)
        need = gen_masked.any(-1) if exit_ready is None else gen_masked.any(-1) & ~exit_ready
        fw = self._forward(b, canvas, need, start, cons)
        fi = np.arange(int(need.sum()))  # (R',) the forwarded rows' places in `fw`
        if fw is not None:
            self.commit.scored(b, fw)
            self._count(b, canvas, fw, need)
            self._take_predictions(b, fw, rows[need], fi, start[need])
        refreshed, kept = self._called(b, fw, need, fi, trace)
        masked_before = gen_masked.sum(-1)
        had_preds = b.rows.has_preds.copy()
        drafts = self._draft(b, start, cons)
        masked = self._gen_masked(b, drafts.x)
        self._take_canvas(b, drafts, rows)
        b.rows.new_entropy = drafts.new_entropy
        stalled = had_preds & (masked.sum(-1) == masked_before) & (masked_before > 0)
        finished, masked = self._finish(b, masked, self._ready_to_exit(b, drafts, masked))
        return StepResult(before, np.zeros(b.x.shape, dtype=bool), need, refreshed, kept, start,
                          stalled, finished, masked, int(fw is not None))

    def _commit_then_forward(self, b: DecodeBatch, trace: bool) -> StepResult:
        """Commit the rule's step (and drafts) from the last forward's scores, then forward the
        drafts, verify them and accept the longest chain."""
        primed = self._prime(b)
        before = b.x.copy()
        # each row's structured-output constraint, read once a step (None: no row has one)
        cons = self._constraints(b, np.arange(len(b)))
        if cons is not None:
            self._scaffold(b, cons)  # what a constraint fixes is the first step's commit
        # Each canvas (before, drafts) is scanned for masks once; everything below reads these.
        gen_masked = self._gen_masked(b, b.x)  # (R, G)
        masked_before = gen_masked.sum(-1)
        had_preds = b.rows.has_preds.copy()
        start = self._block_start(b, gen_masked, b.rows.pad)
        drafts = self._draft(b, start, cons)
        draft_masked = self._gen_masked(b, drafts.x)  # (D, G)
        draft_pad = b.rows.pad[drafts.parent]
        draft_start = self._block_start(b, draft_masked, draft_pad)
        # Complete drafts need no call, nor (with early exit) drafts committed up to an EOS:
        # the row stops there whatever the forward would predict.
        need = draft_masked.any(-1)
        exit_ready = self._ready_to_exit(b, drafts, draft_masked)
        if exit_ready is not None:
            need &= ~exit_ready
        fw = self._forward(b, drafts, need, draft_start, cons)
        if fw is not None:
            self.commit.scored(b, fw)
        self._count(b, drafts, fw, need)
        chosen = self._verify(b, drafts, fw, need, draft_start, exit_ready, cons)
        first = np.arange(len(b))  # each row's first draft: the rule's step
        fwd_index = need.cumsum() - 1  # (D,) each forwarded draft's row in `fw`
        forwarded = need[chosen]
        refreshed, kept = self._called(b, fw, forwarded, fwd_index[chosen[forwarded]], trace)
        drafted = drafts.added[chosen] & ~drafts.added[first]
        # A row took part in the call if any of its drafts did, as its NFE counts (_count); the
        # accepted draft may be one that needed none (complete, or ready to exit).
        called = np.zeros(len(b), dtype=bool)
        called[drafts.parent[need]] = True
        self._accept(b, drafts, fw, chosen, need, fwd_index, draft_start)
        masked_after = draft_masked[chosen]  # b.x is now drafts.x[chosen]
        stalled = had_preds & (masked_after.sum(-1) == masked_before) & (masked_before > 0)
        # The accepted canvases are drafts: their early-exit state is already known.
        finished, masked_after = self._finish(
            b, masked_after, None if exit_ready is None else exit_ready[chosen])
        return StepResult(before, drafted, called, refreshed, kept, start, stalled, finished,
                          masked_after, primed + (fw is not None))

    def _prime(self, b: DecodeBatch) -> int:
        """Rows that joined a batch with rows already decoding take their first step, which only
        forwards (a row commits from the predictions of its last forward), in a call of their
        own before the batch's: the batch's step then commits their first tokens, a step sooner
        (time to first token at a busy server). Each row runs the same steps as without this,
        and a row's results do not depend on its batch. Returns the model calls it ran (0 or 1).
        Rows with a constraint are left out: their first step also writes their scaffold, which
        the batch step's event reports."""
        if b.rows.has_preds.all() or not b.rows.has_preds.any():
            return 0  # none joined, or all did (the batch's own step is the forward alone)
        free = np.array([r.constraint is None for r in b.requests])
        rows = np.flatnonzero(~b.rows.has_preds & free)  # (R',)
        if rows.size == 0:
            return 0
        sub = b.subset(rows)
        res = self.step(sub)
        b.put(rows, sub)
        return res.model_calls

    def _ready_to_exit(self, b: DecodeBatch, d: Drafts, masked: np.ndarray) -> np.ndarray | None:
        """(D,) canvases d.x (masked: (D, G) their generated slots still [MASK]) whose row
        stops at a committed EOS and that are committed up to one (`_exit_ready`); None when no
        row stops early."""
        early = b.rows.knobs["early_exit"] | self.layout.stops_at_eos
        if not early.any():
            return None
        return self._exit_ready(b, d.x, masked, b.rows.pad[d.parent]) & early[d.parent]

    @staticmethod
    def _called(b: DecodeBatch, fw: Forwarded | None, forwarded: np.ndarray, fi: np.ndarray,
                trace: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """(R,) whether each row's forward was a full refresh, and with `trace` (R, S) the slots
        that took part in it (None without), for rows `forwarded` (R,) bool, whose rows in
        the forward are `fi`."""
        refreshed = np.zeros(len(b), dtype=bool)
        kept = None
        if fw is not None:
            refreshed[forwarded] = fw.refresh[fi]
            if trace:
                kept = np.zeros(b.x.shape, dtype=bool)
                kept[forwarded] = fw.visible[fi]
        return refreshed, kept

    # --- pieces ------------------------------------------------------------------------------
    def _gen_masked(self, b: DecodeBatch, x: np.ndarray) -> np.ndarray:
        """(R, G) bool: the generated slots of canvases x still [MASK]."""
        return x[:, b.P :] == self.mask_id

    def _block_start(self, b: DecodeBatch, gen_masked: np.ndarray, pad: np.ndarray) -> np.ndarray:
        """(R,) first slot of each row's current block: the first block with a mask, where the
        layout puts blocks (pad: (R,) the rows' left padding)."""
        first = np.where(gen_masked.any(-1), gen_masked.argmax(-1), gen_masked.shape[1] - 1)
        return self.layout.block_start(b.P + first, pad, b.P)

    def _candidates(self, b: DecodeBatch, x: np.ndarray, start: np.ndarray, fresh: np.ndarray,
                    scored: np.ndarray) -> np.ndarray:
        masked = x == self.mask_id
        cand = masked & self._in_window(b.slots, *self.layout.window(masked, start))
        # Only positions scored from the current canvas may be committed, never stale ones.
        assert (fresh | ~cand | ~scored[:, None]).all(), "a commit candidate has no fresh prediction"
        return cand

    @staticmethod
    def _in_window(slots: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """(R, S) bool: slots in [lo, hi) (lo, hi: (R,))."""
        return (slots >= lo[:, None]) & (slots < hi[:, None])

    def _draft(self, b: DecodeBatch, start: np.ndarray,
               cons: list[Constraint | None] | None) -> Drafts:
        """Each row's rule step and FreeDave's drafts (cons: each row's constraint, or None)."""
        x, pr, hp = b.x, b.preds, b.rows.has_preds
        conf = pr.conf
        cand = self._candidates(b, x, start, pr.fresh, hp) & hp[:, None]
        schedule = self._schedule(b, start, cand) if self.method.uses_schedule else None
        n0 = np.where(hp, self.commit.count(b, self.method, cand, schedule), 0)
        rows = np.arange(len(b))
        # Drafts past the block's end would repeat; drafts adding unconfident positions are
        # unlikely to pass verification. draft_conf 0 filters nothing, whatever the ranking
        # score's range (negative entropy, alg_temp's log-scores).
        dc = b.rows.knobs["draft_conf"][:, None]  # float32, like conf
        n_max = (((conf >= dc) | (dc <= 0)) & cand).sum(-1)
        ranks = candidate_ranks(conf, cand)  # draft k commits the n0 + k best candidates
        sel0 = (ranks < n0[:, None]) & cand
        if cons is not None:  # the rule's step, cut to what keeps the canvas completable
            sel0 = self._restrict(b, x, cons, sel0, pr.token, ranks)
            n0 = sel0.sum(-1)
        drafts = []
        for k in range(self.n_drafts):
            sel, kept = sel0, rows  # draft 0: every row's rule step
            if k:
                sel = (ranks < (n0 + k)[:, None]) & cand
                keep = (n0 + k <= n_max) & hp
                if cons is not None:  # a draft no completion extends is never the rule's
                    keep &= self._completable(b, np.where(sel, pr.token, x), cons, keep)
                if not keep.any():
                    break
                sel, kept = sel[keep], rows[keep]
            dx = np.where(sel, pr.token[kept], x[kept])
            if cons is not None:  # what the commits fixed (not committed by the rule: `sel`)
                dx = self._settle(b, dx, self._of(cons, kept))
            drafts.append(Drafts(dx, kept, self._max_entropy(pr.entropy[kept], sel), sel,
                                 np.full_like(kept, k)))
        if len(drafts) == 1:
            return drafts[0]
        return Drafts(*(np.concatenate([getattr(d, f.name) for d in drafts])
                        for f in dataclasses.fields(Drafts)))

    # --- structured output (unmask.decoding.grammar) ----------------------------------------
    @staticmethod
    def _constraints(b: DecodeBatch, parent: np.ndarray) -> list[Constraint | None] | None:
        """Each canvas's constraint (parent: (D,) its row), or None when none has one."""
        cons = [b.requests[p].constraint for p in parent.tolist()]
        return None if all(c is None for c in cons) else cons

    @staticmethod
    def _of(row_cons: list[Constraint | None] | None,
            parent: np.ndarray) -> list[Constraint | None] | None:
        """The constraints of canvases whose rows are `parent` (D,), from the rows' own."""
        return None if row_cons is None else [row_cons[p] for p in parent.tolist()]

    def _scaffold(self, b: DecodeBatch, row_cons: list[Constraint | None]) -> None:
        """Constrained rows that have not stepped yet start from their scaffold."""
        for i in np.flatnonzero(b.rows.step == 0).tolist():
            c = row_cons[i]
            if c is not None:
                g = c.initial
                gen = b.x[i, b.P : b.P + g.size]
                b.x[i, b.P : b.P + g.size] = np.where(g != self.mask_id, g, gen)

    def _restrict(self, b: DecodeBatch, x: np.ndarray, cons: list[Constraint | None],
                  sel: np.ndarray, token: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """(D, S) the commits of sel (D, S) each canvas x (D, S) keeps under its constraint
        (token, ranks: (D, S) the tokens they write and their commit order)."""
        sel = sel.copy()
        g = slice(b.P, None)
        for i, c in enumerate(cons):
            if c is not None and sel[i].any():
                sel[i, g] = c.restrict(x[i, g], sel[i, g], token[i, g], ranks[i, g])
        return sel

    @staticmethod
    def _settle(b: DecodeBatch, x: np.ndarray, cons: list[Constraint | None]) -> np.ndarray:
        """x (D, S) with what each canvas's commits fixed written in (`Constraint.settle`),
        after every rule step: a key, a closing quote or brace is written as soon as it is the
        only way on, instead of waiting for a forward to score it with confidence 1."""
        for i, c in enumerate(cons):
            if c is not None:
                x[i, b.P :] = c.settle(x[i, b.P :])
        return x

    @staticmethod
    def _completable(b: DecodeBatch, x: np.ndarray, cons: list[Constraint | None],
                     check: np.ndarray) -> np.ndarray:
        """(D,) bool: canvases x (D, S) their constraint can still complete (checked where
        `check`; unconstrained: True)."""
        return np.array([c is None or not check[i] or c.feasible(x[i, b.P :])
                         for i, c in enumerate(cons)], dtype=bool)

    @staticmethod
    def _max_entropy(entropy: np.ndarray, sel: np.ndarray) -> np.ndarray:
        """(D,) max entropy of the selected slots (-inf: none)."""
        return np.where(sel, entropy, np.float32(-np.inf)).max(-1, initial=np.float32(-np.inf))

    def _schedule(self, b: DecodeBatch, start: np.ndarray, cand: np.ndarray) -> BlockSchedule:
        """LLaDA's per-block schedule, advanced for the rows that draft this step."""
        hp = b.rows.has_preds
        new = (start != b.rows.block_seen) & hp
        b.rows.block_seen = np.where(hp, start, b.rows.block_seen)
        b.rows.block_step = np.where(new, 0, b.rows.block_step)
        b.rows.block_m = np.where(new, self.layout.schedule_size(cand), b.rows.block_m)
        schedule = BlockSchedule(b.rows.block_m, b.rows.block_step.copy(), b.rows.steps_per_block)
        b.rows.block_step = b.rows.block_step + hp
        return schedule

    def _forward(self, b: DecodeBatch, d: Drafts, need: np.ndarray, start: np.ndarray,
                 row_cons: list[Constraint | None] | None) -> Forwarded | None:
        """Forward the drafts with masks left (`need`); returns their rows in order."""
        if not need.all():
            sub = np.nonzero(need)[0]
            if sub.size == 0:
                return None
            d, start = d.take(sub), start[sub]
        x, parent = d.x, d.parent
        slots = b.slots
        end = start + self.params.block_length
        # written this step: the draft's commits and what settling wrote with them
        written = x != b.x[parent]
        commit_step = np.where(written, b.rows.step[parent][:, None], b.commit_step[parent])
        masked = x == self.mask_id
        # The token each slot's stored K/V was computed from (-1: none); a slot whose K/V comes
        # from another token (committed since) holds [MASK] K/V.
        stored = b.stored_tokens(parent) if b.store is not None else None
        # Only policies that read staleness pay for the (D, S) comparison.
        stale = (stored != x) if self.cache.reads_stale else np.zeros_like(masked)
        knobs = b.rows.knobs[parent]
        lo, hi = self.layout.window(masked, start)
        view = StepView(slots, start, end, d.new_entropy, commit_step, b.rows.store_block[parent],
                        masked, stale, knobs, lo, hi)
        pad = b.rows.pad[parent]
        horizon = self.layout.horizon(start, lo, end, b.rows.end[parent])
        visible = (slots >= pad[:, None]) & self.suffix.keep(slots, pad, end, horizon)
        refresh, recompute = self.cache.plan(view)
        read = None
        if stored is None:
            active = visible
        else:
            valid = stored >= 0
            active = np.where(refresh[:, None], visible, (recompute | ~valid) & visible)
            read = StoreRead(b.store, b.store_row[parent], pad, valid)
        # The window's masks are scored even where the forward stops before them (a block's
        # first slot alone, predicted from the slot before it: SubBlockLayout).
        predict = masked & self._in_window(slots, lo, hi)
        if self.params.inject > 0:
            predict |= masked & visible & active & (slots >= end[:, None])
        noise = self._noise(b, x, parent, knobs)
        cons = self._of(row_cons, parent)
        masks = None if cons is None else masks_for(x, b.P, cons)
        # The runner's "block" starts at the window: the slot it recomputes before it is the
        # one that predicts the window's first slot (in the block, or the previous block's last)
        return self.runner.forward(ForwardPlan(x, pad, visible, active, predict, refresh, read,
                                               b.preds.token[parent], noise, lo, knobs, masks))

    def _noise(self, b: DecodeBatch, x: np.ndarray, parent: np.ndarray,
               knobs: np.ndarray) -> Tensor | None:
        """(D, block_length, V + 1) uniforms keyed by (request noise key, tokens committed so far):
        the same canvas state of a request always sees the same noise, whichever decoder
        reached it and whoever shares its batch. Drawn on the model's device, for the drafts
        whose row samples (knobs: (D,) their rows' knobs); None when none does."""
        p = self.params
        draws = (knobs["temperature"] > 0) | (knobs["alg_temp"] > 0) | self.always_draws
        if not draws.any():
            return None
        n_committed = (x[:, b.P :] != self.mask_id).sum(-1) - (b.S - b.rows.end[parent])
        vocab = self.model.config.vocab_size + 1  # one column per token, one for the position
        # The rows of drafts that do not sample are left as allocated: scoring never reads them.
        out = torch.empty(x.shape[0], p.block_length, vocab, dtype=torch.float64, device=self.device)
        gen = torch.Generator(device=self.device)
        for i in np.flatnonzero(draws).tolist():
            row, n = int(parent[i]), int(n_committed[i])
            gen.manual_seed((b.requests[row].noise_key * 1_000_003 + n) % (1 << 63))
            torch.rand(p.block_length, vocab, generator=gen, dtype=torch.float64,
                       device=self.device, out=out[i])
        return out

    def _count(self, b: DecodeBatch, d: Drafts, fw: Forwarded | None, need: np.ndarray) -> None:
        if fw is None:
            return
        parents = d.parent[need]
        b.rows.nfe += np.minimum(np.bincount(parents, minlength=len(b)), 1)
        b.rows.tok_fw += np.bincount(parents, weights=fw.n_tokens, minlength=len(b)).astype(np.int64)

    def _verify(self, b: DecodeBatch, d: Drafts, fw: Forwarded | None, need: np.ndarray,
                start: np.ndarray, exit_ready: np.ndarray | None,
                row_cons: list[Constraint | None] | None) -> np.ndarray:
        """Index (into d) of the accepted draft of each row, by the chain rule. Drafts 0..R-1
        are the rows' own rule steps, in row order; further drafts follow."""
        r = len(b)
        rows = np.arange(r)
        if d.x.shape[0] == r:  # one draft per row: the rule's step, always accepted
            return rows
        n = int(d.k.max()) + 1  # the drafts made, not draft_steps: at most a block's candidates
        # target_j = draft_j plus one reference step from draft_j's own predictions.
        target = d.x.copy()
        if fw is not None:
            fx = d.x[need]
            cand = self._candidates(b, fx, start[need], fw.fresh, np.ones(fx.shape[0], dtype=bool))
            count = self.method.count(fw.conf, cand, None, b.rows.knobs[d.parent[need]],
                                      fw.entropy)
            sel = select_top(fw.conf, cand, count)
            cons = self._of(row_cons, d.parent[need])
            if cons is not None:
                sel = self._restrict(b, fx, cons, sel, fw.token, candidate_ranks(fw.conf, cand))
            target[need] = np.where(sel, fw.token, fx)
            if cons is not None:  # the reference step settles what it fixed, as the drafts did
                target[need] = self._settle(b, target[need], cons)
        # The chain on arrays (no per-row loop): kid[r, k] = draft k of row r (-1: none);
        # eq[r, i, j] = draft j of row r equals the target of its draft i.
        kid = np.full((r, n), -1, dtype=np.int64)
        kid[d.parent, d.k] = np.arange(d.x.shape[0])
        valid = kid >= 0
        safe = np.maximum(kid, 0)
        # A row's drafts commit one more position each, so a target can equal only the draft
        # with its count of commits: one canvas comparison per draft, not per pair of drafts
        # ((R, n, S), not (R, n, n, S): gigabytes for a large block and draft_steps).
        filled = (d.x != self.mask_id).sum(-1)[safe]  # (R, n)
        same_count = ((target != self.mask_id).sum(-1)[safe][:, :, None] == filled[:, None, :]) \
            & valid[:, None, :]  # (R, n, n)
        j_of = same_count.argmax(-1)  # (R, n) the one draft a target may equal
        eq = np.zeros((r, n, n), dtype=bool)
        eq[rows[:, None], np.arange(n)[None, :], j_of] = same_count.any(-1) & (
            target[safe] == d.x[safe[rows[:, None], j_of]]).all(-1)
        # A draft at which early exit stops the reference ends the chain there too.
        stop = (exit_ready[safe] & valid) if exit_ready is not None else np.zeros_like(valid)
        j = np.arange(n)
        best = np.zeros(r, dtype=np.int64)
        for _ in range(n - 1):  # the chain moves strictly forward: at most n - 1 moves
            moves = eq[rows, best] & valid & (j[None, :] > best[:, None])
            nxt = np.where(moves, j[None, :], -1).max(-1)  # the largest such draft
            best = np.where((nxt >= 0) & ~stop[rows, best], nxt, best)
        return kid[rows, best]

    def _accept(self, b: DecodeBatch, d: Drafts, fw: Forwarded | None, chosen: np.ndarray,
                need: np.ndarray, fwd_index: np.ndarray, draft_start: np.ndarray) -> None:
        self._take_canvas(b, d, chosen)
        if fw is None:
            return
        has = need[chosen]
        if has.any():
            self._take_predictions(b, fw, np.flatnonzero(has), fwd_index[chosen[has]],
                                   draft_start[chosen[has]])

    @staticmethod
    def _take_canvas(b: DecodeBatch, d: Drafts, chosen: np.ndarray) -> None:
        """Every row's canvas := its accepted draft `chosen` (R,)."""
        added = d.added[chosen]
        written = d.x[chosen] != b.x  # the commits and what settling wrote with them
        b.x = d.x[chosen]
        b.commit_step = np.where(written, b.rows.step[:, None], b.commit_step)
        b.rows.decided += added.sum(-1)
        b.rows.step += 1

    def _take_predictions(self, b: DecodeBatch, fw: Forwarded, rows: np.ndarray, fi: np.ndarray,
                          start: np.ndarray) -> None:
        """Batch rows `rows` (R',) take the scores and K/V of the forward's rows `fi` (R'),
        whose canvases' blocks start at `start` (R',)."""
        pr = b.preds
        keep_old = ~fw.fresh[fi]
        pr.token[rows] = np.where(keep_old, pr.token[rows], fw.token[fi])
        pr.conf[rows] = np.where(keep_old, np.float32(-np.inf), fw.conf[fi])
        pr.entropy[rows] = fw.entropy[fi]
        pr.fresh[rows] = fw.fresh[fi]
        self.commit.accepted(b, fw, rows, fi)
        b.rows.has_preds[rows] = True
        if b.store is not None:
            refreshed = fw.refresh[fi]
            store_rows = b.store_row[rows]
            b.store.invalidate(store_rows[refreshed])
            ok = fw.ok
            storable = self.cache.storable(fw.idx[fi], start)
            if storable is not None:
                ok = ok.copy()
                ok[fi] &= storable
            b.store.write(store_rows, b.rows.pad[rows], fi, fw.idx, fw.kv, fw.kv_at, ok, fw.ids)
            b.rows.store_block[rows] = np.where(refreshed, start, b.rows.store_block[rows])

    def _finish(self, b: DecodeBatch, masked: np.ndarray,
                exit_ready: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Mark finished rows; returns them and the rows' generated-slot masks after the step
        (masked: (R, G) those of the accepted canvases). With early_exit (exit_ready: (R,)
        `_exit_ready` of the accepted canvases), a row whose canvas is committed up to an EOS
        is done and its remaining positions become EOS."""
        if exit_ready is not None:
            stop = exit_ready & ~b.rows.done
            if stop.any():
                gen = b.x[:, b.P :]
                gen[stop] = np.where(masked[stop], self.eos_id, gen[stop])
                masked = gen == self.mask_id
        newly = ~masked.any(-1) & ~b.rows.done
        b.rows.done |= newly
        return newly, masked

    def _exit_ready(self, b: DecodeBatch, x: np.ndarray, masked: np.ndarray,
                    pad: np.ndarray) -> np.ndarray:
        """(D,) rows with masks left whose canvas is committed up to an EOS (masked: (D, G)
        the canvases' generated slots still [MASK]; pad: (D,) their rows' left padding): up to
        the first mask, or with a block-causal model up to the block holding it."""
        gen = x[:, b.P :]
        any_masked = masked.any(-1)
        first_mask = np.where(any_masked, masked.argmax(-1), gen.shape[1])
        settled = self.layout.settled(b.P + first_mask, pad, b.P) - b.P
        before = np.arange(gen.shape[1])[None] < settled[:, None]
        return ((gen == self.eos_id) & before).any(-1) & any_masked
