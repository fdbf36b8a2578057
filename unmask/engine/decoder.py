"""The decode loop shared by every method: draft -> forward -> verify -> accept.

A plain decoder (static, static-1, threshold) is the one-draft case: its only draft is the rule's
step, which is always accepted. FreeDave adds drafts that commit more of the same ranking and
keeps the longest chain that the rule itself would have produced (docs/design.md § FreeDave). All rows of
a batch and all drafts of a row go through one model call per iteration; rows finish
independently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from unmask.caching import StepView, make_cache_policy
from unmask.decoding.params import DecodeParams
from unmask.decoding.rules import select_top, static_count, threshold_count
from unmask.engine.runner import Forwarded, Runner
from unmask.kv import KVStore
from unmask.suffix import keep_mask


@dataclass
class DecodeResult:
    token_ids: list[int]  # the gen_length generated tokens
    nfe: int  # model calls this row took part in
    token_forwards: int  # token positions those calls processed for this row
    seconds: float  # wall time until this row finished


@dataclass
class Drafts:
    x: Tensor  # (R, S) draft canvases
    parent: Tensor  # (R,) row each draft belongs to
    new_entropy: Tensor  # (R,) max entropy of the tokens the draft committed
    added: Tensor  # (R, S) bool slots the draft committed


class Decoder:
    def __init__(self, model: nn.Module, params: DecodeParams, mask_id: int, eos_id: int) -> None:
        self.model, self.params = model, params
        self.mask_id, self.eos_id = mask_id, eos_id
        self.runner = Runner(model, params, mask_id, eos_id)
        self.cache = make_cache_policy(params)
        self.device = self.runner.device
        self.n_drafts = params.draft_steps if params.method.startswith("freedave") else 1

    # --- the loop --------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]]) -> list[DecodeResult]:
        p = self.params
        dev = self.device
        b = len(prompts)
        self.P = max(len(q) for q in prompts)
        s = self.P + p.gen_length
        self.slots = torch.arange(s, device=dev)
        self.pad = torch.tensor([self.P - len(q) for q in prompts], device=dev)
        x = torch.full((b, s), self.mask_id, dtype=torch.long, device=dev)
        for i, q in enumerate(prompts):
            x[i, : self.pad[i]] = self.eos_id  # left padding, never attended to
            x[i, self.pad[i] : self.P] = torch.tensor(q, dtype=torch.long)
        self.x = x
        self.commit_step = torch.full((b, s), -1, dtype=torch.long, device=dev)
        self.step = torch.zeros(b, dtype=torch.long, device=dev)
        self.store_block = torch.full((b,), -1, dtype=torch.long, device=dev)
        self.block_seen = torch.full((b,), -1, dtype=torch.long, device=dev)
        self.block_m = torch.zeros(b, dtype=torch.long, device=dev)
        self.block_step = torch.zeros(b, dtype=torch.long, device=dev)
        self.nfe = torch.zeros(b, dtype=torch.long, device=dev)
        self.tok_fw = torch.zeros(b, dtype=torch.long, device=dev)
        self.done = torch.zeros(b, dtype=torch.bool, device=dev)
        self.seconds = [0.0] * b
        self.store = self._new_store(b, s) if self.cache.uses_store else None
        self.preds: Forwarded | None = None
        t0 = time.perf_counter()

        rows = torch.arange(b, device=dev)
        first = Drafts(x.clone(), rows, torch.full((b,), float("-inf"), device=dev),
                       torch.zeros_like(x, dtype=torch.bool))
        need = torch.ones(b, dtype=torch.bool, device=dev)
        fw = self._forward(first, need)
        self._count(first, fw, need)
        self._accept(first, fw, rows, need)
        self._finish(t0)
        while not bool(self.done.all()):
            drafts = self._draft()
            # Complete drafts need no call, nor (with early exit) drafts committed up to an EOS:
            # the row stops there whatever the forward would predict.
            need = (drafts.x[:, self.P :] == self.mask_id).any(-1)
            if self.params.early_exit:
                need &= ~self._exit_ready(drafts.x)
            fw = self._forward(drafts, need)
            self._count(drafts, fw, need)
            chosen = self._verify(drafts, fw, need)
            self._accept(drafts, fw, chosen, need)
            self._finish(t0)
        return [DecodeResult(self.x[i, self.P :].tolist(), int(self.nfe[i]), int(self.tok_fw[i]),
                             self.seconds[i]) for i in range(b)]

    # --- pieces ----------------------------------------------------------------------------
    def _blocks(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(block_start, block_end) of each row's current block: the first with a mask."""
        masked = (x == self.mask_id) & (self.slots >= self.P)
        first = torch.where(masked.any(-1), masked.float().argmax(-1), self.slots[-1])
        bl = self.params.block_length
        start = self.P + ((first - self.P).clamp_min(0) // bl) * bl
        return start, start + bl

    def _candidates(self, x: Tensor, fresh: Tensor) -> Tensor:
        start, end = self._blocks(x)
        in_block = (self.slots >= start[:, None]) & (self.slots < end[:, None])
        cand = (x == self.mask_id) & in_block
        # Only positions scored from the current canvas may be committed, never stale ones.
        assert bool((fresh | ~cand).all()), "a commit candidate has no fresh prediction"
        return cand

    def _rule_count(self, conf: Tensor, cand: Tensor) -> Tensor:
        """How many candidates the reference rule commits in one step (static-1 / threshold)."""
        if self.params.method in ("threshold", "freedave++"):
            return threshold_count(conf, cand, self.params.threshold)
        return cand.any(-1).long()

    def _draft(self) -> Drafts:
        live = (~self.done).nonzero(as_tuple=True)[0]
        x, pr = self.x[live], self.preds
        conf = pr.conf[live]
        cand = self._candidates(x, pr.fresh[live])
        if self.params.method == "static":
            n0 = self._static_count(live, x, cand)
        else:
            n0 = self._rule_count(conf, cand)
        # Drafts past the block's end would repeat; drafts adding unconfident positions are
        # unlikely to pass verification.
        n_max = ((conf >= self.params.draft_conf) & cand).sum(-1)
        xs, parents, ents, added = [], [], [], []
        for k in range(self.n_drafts):
            sel = select_top(conf, cand, n0 + k)
            keep = (n0 + k <= n_max) | (k == 0)
            if not bool(keep.any()):
                break
            sel, rows = sel[keep], live[keep]
            xk = torch.where(sel, pr.token[rows], x[keep])
            ent = pr.entropy[rows].masked_fill(~sel, float("-inf")).amax(-1)
            xs.append(xk), parents.append(rows), ents.append(ent), added.append(sel)
        return Drafts(torch.cat(xs), torch.cat(parents), torch.cat(ents), torch.cat(added))

    def _static_count(self, live: Tensor, x: Tensor, cand: Tensor) -> Tensor:
        start, _ = self._blocks(x)
        new = start != self.block_seen[live]
        self.block_seen[live] = start
        self.block_step[live] = torch.where(new, 0, self.block_step[live])
        self.block_m[live] = torch.where(new, cand.sum(-1), self.block_m[live])
        count = static_count(self.block_m[live], self.params.steps_per_block,
                             self.block_step[live])
        self.block_step[live] += 1
        return count.clamp_min(1)

    def _forward(self, d: Drafts, need: Tensor) -> Forwarded | None:
        """Forward the drafts with masks left (`need`); returns their rows in order."""
        if not bool(need.all()):
            sub = need.nonzero(as_tuple=True)[0]
            if sub.numel() == 0:
                return None
            d = Drafts(d.x[sub], d.parent[sub], d.new_entropy[sub], d.added[sub])
        x, parent = d.x, d.parent
        start, end = self._blocks(x)
        step = self.step[parent]
        commit_step = torch.where(d.added, step[:, None], self.commit_step[parent])
        masked = x == self.mask_id
        # Slots whose stored K/V was computed from another token (committed since): [MASK] K/V.
        # Only policies that read it pay for the (R, S) comparison.
        stale = (self.store.token[parent] != x) if self.cache.reads_stale else torch.zeros_like(masked)
        view = StepView(self.slots, start, end, d.new_entropy, commit_step,
                        self.store_block[parent], masked, stale)
        visible = (self.slots >= self.pad[parent][:, None]) & keep_mask(self.params, self.slots, end)
        refresh, recompute = self.cache.plan(view)
        store = None
        if self.store is None:
            active = visible
        else:
            valid = self.store.valid[parent]
            active = torch.where(refresh[:, None], visible, (recompute | ~valid) & visible)
            if not bool(refresh.all()):
                same = parent.numel() == self.x.shape[0] and bool(
                    (parent == torch.arange(parent.numel(), device=parent.device)).all())
                # One draft per row reads the store in place; several drafts need their own rows.
                store = self.store if same else self.store.rows(parent)
        masked = masked & visible
        predict = masked & view.in_block
        if self.params.inject > 0:
            predict |= masked & active & (self.slots >= end[:, None])
        prev = self.preds.token[parent] if self.preds is not None else torch.full_like(x, self.mask_id)
        return self.runner.forward(x, self.pad[parent], visible, active, predict, refresh, store,
                                   prev, self._noise(x, start), start)

    def _noise(self, x: Tensor, start: Tensor) -> Tensor | None:
        """Per-row uniforms keyed by (seed, tokens committed so far): the same canvas state
        always sees the same noise, whichever decoder reached it and in which batch."""
        p = self.params
        if p.temperature == 0 and p.remasking != "random":
            return None
        n_committed = (x[:, self.P :] != self.mask_id).sum(-1).tolist()
        vocab = self.model.config.vocab_size
        out = []
        for n in n_committed:
            g = torch.Generator().manual_seed(p.seed * 1_000_003 + n)
            out.append(torch.rand(p.block_length, vocab, generator=g, dtype=torch.float64))
        return torch.stack(out).to(self.device)

    def _count(self, d: Drafts, fw: Forwarded | None, need: Tensor) -> None:
        if fw is None:
            return
        parents = d.parent[need]
        took_part = torch.zeros_like(self.done)
        took_part[parents] = True
        self.nfe += took_part.long()
        self.tok_fw.index_add_(0, parents, fw.n_tokens)

    def _verify(self, d: Drafts, fw: Forwarded | None, need: Tensor) -> Tensor:
        """Index (into d) of the accepted draft of each live row, by the chain rule."""
        rows = d.parent.tolist()
        kids_of: dict[int, list[int]] = {}  # row -> its drafts, in order
        for i, r in enumerate(rows):
            kids_of.setdefault(r, []).append(i)
        if self.n_drafts == 1:
            return torch.tensor([v[0] for v in kids_of.values()], device=self.device)
        # target_j = draft_j plus one reference step from draft_j's own predictions.
        target = d.x.clone()
        if fw is not None:
            fx = d.x[need]
            cand = self._candidates(fx, fw.fresh)
            sel = select_top(fw.conf, cand, self._rule_count(fw.conf, cand))
            target[need] = torch.where(sel, fw.token, fx)
        # A draft at which early exit stops the reference ends the chain there too.
        stops = self._exit_ready(d.x).tolist() if self.params.early_exit else [False] * len(rows)
        chosen = []
        for kids in kids_of.values():
            best = 0
            while not stops[kids[best]]:
                tgt = target[kids[best]]
                nxt = [j for j in range(best + 1, len(kids)) if torch.equal(d.x[kids[j]], tgt)]
                if not nxt:
                    break
                best = nxt[-1]
            chosen.append(kids[best])
        return torch.tensor(chosen, device=self.device)

    def _accept(self, d: Drafts, fw: Forwarded | None, chosen: Tensor, need: Tensor) -> None:
        rows = d.parent[chosen]
        self.x[rows] = d.x[chosen]
        self.commit_step[rows] = torch.where(d.added[chosen], self.step[rows, None],
                                             self.commit_step[rows])
        self.step[rows] += 1
        if fw is None:
            return
        fwd_index = torch.cumsum(need.long(), 0) - 1
        has = need[chosen]
        rows, fi = rows[has], fwd_index[chosen[has]]
        if rows.numel() == 0:
            return
        pr = self.preds
        if pr is None:
            self.preds = fw  # the first forward covers every row
        else:
            keep_old = ~fw.fresh[fi]
            pr.token[rows] = torch.where(keep_old, pr.token[rows], fw.token[fi])
            pr.conf[rows] = torch.where(keep_old, float("-inf"), fw.conf[fi])
            pr.entropy[rows] = fw.entropy[fi]
            pr.fresh[rows] = fw.fresh[fi]
        if self.store is not None:
            refreshed = fw.refresh[fi]
            self.store.invalidate(rows[refreshed])
            self.store.write(rows, fw.idx[fi], [(k[fi], v[fi]) for k, v in fw.kv], fw.ok[fi],
                             fw.ids[fi])
            start, _ = self._blocks(self.x[rows])
            self.store_block[rows] = torch.where(refreshed, start, self.store_block[rows])

    def _finish(self, t0: float) -> None:
        """Mark finished rows; with early_exit, a row whose canvas is committed up to an EOS
        is done and its remaining positions become EOS."""
        gen = self.x[:, self.P :]
        masked = gen == self.mask_id
        if self.params.early_exit:
            stop = self._exit_ready(self.x) & ~self.done
            if bool(stop.any()):
                gen[stop] = torch.where(masked[stop], self.eos_id, gen[stop])
                masked = gen == self.mask_id
        newly = ~masked.any(-1) & ~self.done
        now = time.perf_counter() - t0
        for i in newly.nonzero(as_tuple=True)[0].tolist():
            self.seconds[i] = now
        self.done |= newly

    def _exit_ready(self, x: Tensor) -> Tensor:
        """(R,) rows with masks left whose canvas is committed up to an EOS."""
        gen = x[:, self.P :]
        masked = gen == self.mask_id
        first_mask = torch.where(masked.any(-1), masked.float().argmax(-1), gen.shape[1])
        before = torch.arange(gen.shape[1], device=x.device)[None] < first_mask[:, None]
        return ((gen == self.eos_id) & before).any(-1) & masked.any(-1)

    def _new_store(self, b: int, s: int) -> KVStore:
        c = self.model.config
        dtype = next(self.model.parameters()).dtype
        return KVStore.empty(c.n_layers, b, c.n_kv_heads, s, c.head_dim, dtype, self.device)
