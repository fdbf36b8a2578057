"""Rows whose stored keys are their first positions attend over their context where it lies
(unmask/kv.py, `InPlace`; unmask/engine/runner.py, `Runner.attend_in_place`): over their store row
(a decode step's current block), or over the context buffer that rows sharing leading blocks fill
one after another (`shared_context`; decode steps and steps forwarding finished blocks alike).
Every call's logits and every stored K/V bit are those of the gathered call, in float32 and
bfloat16, alone, in a batch (unpacked, packed beside rows that attend by group, widened) and with
FreeDave, whose drafts share their row's store row and so never attend in place
(`test_which_rows_qualify`)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import peaky_model
from hypothesis import given, settings
from hypothesis import strategies as st

from unmask import kv as kv_mod
from unmask.decoding.params import DecodeParams
from unmask.engine import decode
from unmask.engine import runner as runner_mod
from unmask.engine.prefix_store import PrefixStore
from unmask.kv import InPlace, KVStore, Past

VOCAB, MASK, EOS = 64, 63, 1
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20],
           [7] * 9, [9, 8, 7, 6, 5]]
# a shared first 13 tokens (3 blocks of 4 stored), then tails of 0-9 tokens: with the prefix
# store, rows join with restored blocks
SHARED = [list(range(3, 16)) + tail for tail in ([], [20], [21, 22, 23, 24, 25], [26] * 9,
                                                 [30, 31], [40, 41, 42, 43])]
# a longer shared start (10 blocks), most of each row's keys: rows share the context buffer
LONG = [list(range(3, 45)) + tail for tail in ([], [50], [51, 52, 53], [54] * 6, [55, 56],
                                                [57, 58, 59, 60, 61], [4, 5], [6] * 3)]


def decoded(kind: str, spec: str, dtype: torch.dtype, on: bool, batch: int, monkeypatch,
            store: bool = False, min_rows: int = 1, prompts: list[list[int]] | None = None,
            places: list | None = None):
    """((token ids, NFE, token-forwards) of each request, every call's logits and stored K/V,
    the count of rows of each call in place); places: given, gets each in-place call's rows'
    (start, span count) (`InPlace.starts`)."""
    model = copy.deepcopy(peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)).to(dtype)
    seen: list[torch.Tensor] = []
    rows: list[int] = []
    real_score, real_write, real_attend = runner_mod.score, KVStore.write, InPlace.attend

    def spy(logits, *a, **k):
        seen.append(logits.detach().clone())
        return real_score(logits, *a, **k)

    def write(self, *a, **k):
        real_write(self, *a, **k)
        # what a later call can read: the slots that hold a token (in-place rows also leave
        # their current block's K/V at slots that hold none, which nothing reads)
        seen.append(self.kv[torch.from_numpy(self.token >= 0)].clone())

    def attend(self, layer, *a, **k):
        if layer == 0:
            rows.append(len(self.rows))
            if places is not None:
                places.append([(st, len(sp)) for st, sp in zip(
                    self.starts, self.spans, strict=True)])
        return real_attend(self, layer, *a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(runner_mod.Runner, "attend_in_place", on)
        mp.setattr(runner_mod, "IN_PLACE_MIN_ROWS", min_rows)
        mp.setattr(runner_mod, "score", spy)
        mp.setattr(KVStore, "write", write)
        mp.setattr(InPlace, "attend", attend)
        params = DecodeParams.parse(spec, gen_length=16, block_length=4)
        prefix = PrefixStore(model.config.block_size, 1 << 24) if store else None
        prompts = prompts or (SHARED if store else PROMPTS)
        reqs = decode(model, params, prompts, mask_id=MASK, eos_id=EOS,
                      max_running=batch, prefix=prefix)
    return [(r.token_ids, r.nfe, r.token_forwards) for r in reqs], seen, rows


@pytest.mark.parametrize("kind", ["sdar", "Fast_dLLM_Qwen", "llada2_moe"])
@pytest.mark.parametrize("spec", ["threshold,threshold=0.7", "static-1", "freedave++,threshold=0.7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_in_place_give_the_gathered_calls_bits(kind, spec, dtype, monkeypatch) -> None:
    for batch in (1, 3, 6):
        want, want_seen, none = decoded(kind, spec, dtype, False, batch, monkeypatch)
        got, got_seen, rows = decoded(kind, spec, dtype, True, batch, monkeypatch)
        assert not none
        assert got == want
        assert len(got_seen) == len(want_seen)
        assert all(torch.equal(a, b) for a, b in zip(got_seen, want_seen, strict=True))
        if kind == "sdar" and not spec.startswith("freedave"):
            assert rows  # decode steps took the path


@pytest.mark.parametrize("kind", ["sdar", "Fast_dLLM_Qwen", "llada2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_joining_with_restored_blocks_attend_in_place_with_the_same_bits(kind, dtype,
                                                                              monkeypatch) -> None:
    """Rows join with restored blocks and forward their tails by span (gathered), then decode
    in place."""
    for batch in (3, 6):  # later rows join after the first ones stored the shared blocks
        want, want_seen, _ = decoded(kind, "static-1", dtype, False, batch, monkeypatch, True)
        got, got_seen, rows = decoded(kind, "static-1", dtype, True, batch, monkeypatch, True)
        assert got == want
        assert len(got_seen) == len(want_seen)
        assert all(torch.equal(a, b) for a, b in zip(got_seen, want_seen, strict=True))
        # Fast-dLLM v2's steps also recompute the slot before their block, which its store
        # holds: in place over the context buffer only, which the shared blocks take them to
        assert rows


@pytest.mark.parametrize("kind", ["sdar", "Fast_dLLM_Qwen", "llada2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("share_min", [0.0, kv_mod.SHARE_MIN])
@pytest.mark.parametrize("store", [False, True])
def test_rows_over_the_context_buffer_give_the_gathered_calls_bits(kind, dtype, share_min, store,
                                                                   monkeypatch) -> None:
    """Rows sharing leading blocks (restored, or computed by each) attend over the context
    buffer one after another, decode steps and steps forwarding finished blocks alike; at
    SHARE_MIN 0 every row goes there, sharing or not."""
    monkeypatch.setattr(kv_mod, "SHARE_MIN", share_min)
    want, want_seen, _ = decoded(kind, "static-1", dtype, False, 8, monkeypatch, store,
                                 prompts=LONG)
    places: list = []
    got, got_seen, _ = decoded(kind, "static-1", dtype, True, 8, monkeypatch, store,
                               prompts=LONG, places=places)
    assert got == want
    assert len(got_seen) == len(want_seen)
    assert all(torch.equal(a, b) for a, b in zip(got_seen, want_seen, strict=True))
    rows = [p for call in places for p in call]
    assert any(st > 0 for st, _ in rows)  # rows joined the row before them in the buffer
    assert any(st >= 0 and spans > 1 for st, spans in rows)  # finished blocks too
    if share_min == 0.0:
        assert all(st >= 0 for st, _ in rows)


def test_shared_context_orders_rows_by_their_blocks() -> None:
    a = np.arange(12)  # 3 blocks of 4
    b = np.concatenate([np.arange(8), [99, 98, 97, 96]])  # shares 2 blocks with a
    c = np.array([50, 51, 52, 53])  # shares none
    d = np.concatenate([np.arange(10), [70, 71]])  # 2 whole blocks (then 2 tokens) with a
    order, starts = kv_mod.shared_context([a, c, b, d], [14, 6, 14, 14], 4)
    assert order == [0, 3, 2, 1]  # a, d, b: one prefix, next to each other; c alone
    # a loads the buffer; d shares 8 of its 14 keys with a, b 8 with d (>= half); c attends
    # over its store row
    assert starts == [0, 8, 8, -1]
    # sharing less than SHARE_MIN of its keys: over its store row
    order, starts = kv_mod.shared_context([a, b], [14, 40], 4)
    assert starts == [-1, -1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=12), st.integers(0, 6)),
                min_size=1, max_size=8), st.sets(st.integers(0, 7)))
def test_shared_context_over_fewer_rows_shares_no_more(rows, dropped) -> None:
    """`Runner._shared`'s look: if some rows of a call share the buffer, all of them do (so a
    call whose rows share nothing has no subset that does)."""
    prefixes = [np.array(p, dtype=np.int64) for p, _ in rows]
    keys = [len(p) + t for p, t in rows]
    some = [i for i in range(len(rows)) if i not in dropped]
    _, sub = kv_mod.shared_context([prefixes[i] for i in some], [keys[i] for i in some], 2)
    _, every = kv_mod.shared_context(prefixes, keys, 2)
    assert max(sub, default=-1) < 0 or max(every) >= 0


def test_calls_of_few_rows_gather(monkeypatch) -> None:
    few = runner_mod.IN_PLACE_MIN_ROWS - 1
    for batch, used in ((few, False), (runner_mod.IN_PLACE_MIN_ROWS, True)):
        prompts = [[5 + i, 6, 7 + i, 8, 9 + i] for i in range(batch)]  # in step: all qualify
        _, _, rows = decoded("sdar", "static-1", torch.float32, True, batch, monkeypatch,
                             min_rows=runner_mod.IN_PLACE_MIN_ROWS, prompts=prompts)
        assert bool(rows) == used and all(r >= runner_mod.IN_PLACE_MIN_ROWS for r in rows)


def test_calls_of_few_rows_sharing_blocks_attend_over_the_buffer(monkeypatch) -> None:
    """Fewer rows than IN_PLACE_MIN_ROWS, sharing most of their keys: over the context buffer,
    with the gathered call's bits; a lone row gathers."""
    for batch in (1, 2, 3):
        want, want_seen, _ = decoded("sdar", "static-1", torch.float32, False, batch,
                                     monkeypatch, prompts=LONG[:3])
        places: list = []
        got, got_seen, rows = decoded("sdar", "static-1", torch.float32, True, batch,
                                      monkeypatch, min_rows=runner_mod.IN_PLACE_MIN_ROWS,
                                      prompts=LONG[:3], places=places)
        assert got == want
        assert all(torch.equal(a, b) for a, b in zip(got_seen, want_seen, strict=True))
        assert bool(rows) == (batch > 1)
        assert all(st >= 0 for call in places for st, _ in call)


def test_which_rows_qualify() -> None:
    store = KVStore.empty(2, 3, 1, 16, 2, torch.float32, torch.device("cpu"))
    store.token[:, :8] = 5  # rows hold positions 0..7
    store.token[2, 9] = 5  # row 2 holds a slot of its next block (a stale kept K/V)
    rows = np.array([0, 1, 2])
    n = np.array([8, 4, 8])
    pos = np.tile(np.arange(8), (3, 1))
    past = Past(store, rows, pos, pos < n[:, None], n, n, pos // 4)
    positions = np.array([[8, 9, 10, 11], [8, 9, 10, 11], [8, 9, 10, 11]])
    t = np.array([4, 4, 4])
    # row 1's stored keys stop at 4 but its tokens start at 8; row 2's next slots hold a token:
    # it may attend in place over the context buffer only
    lined, free = past.in_place(positions, t)
    assert lined.tolist() == [True, False, True]
    assert free.tolist() == [True, False, False]
    # tokens after a gap, or past the store's width
    assert not past.in_place(positions + 2, t)[0][0]
    assert not past.in_place(positions + 6, np.array([4, 4, 4]))[0][0]
    # two call rows on one store row (drafts): none attends in place
    shared = Past(store, np.array([0, 0]), pos[:2], (pos < 8)[:2], np.array([8, 8]),
                  np.array([8, 8]), (pos // 4)[:2])
    assert not np.concatenate(shared.in_place(positions[:2], t[:2])).any()


def test_rows_outputs_are_joined_only_where_they_tile_the_call() -> None:
    """kv._tiling: the rows' outputs go out in one copy only when, in call order, they fill the
    call's output: whole unpacked rows (dim 0), or packed places covering its one row with no
    gap, overlap or extra places (dim 2); anything else writes row by row."""
    shape = torch.Size
    assert kv_mod._tiling([(1, 0, 4), (0, 0, 4)], shape([2, 4, 4, 8])) == (0, True)
    assert kv_mod._tiling([(0, 4, 8), (0, 0, 4)], shape([1, 4, 12, 8])) == (2, True)
    assert not kv_mod._tiling([(0, 0, 4), (0, 5, 4)], shape([1, 4, 9, 8]))[1]  # a gap
    assert not kv_mod._tiling([(0, 0, 4), (0, 4, 4)], shape([1, 4, 12, 8]))[1]  # extra places
    assert not kv_mod._tiling([(0, 0, 4)], shape([2, 4, 4, 8]))[1]  # another row's
    assert not kv_mod._tiling([(0, 0, 3), (1, 0, 4)], shape([2, 4, 4, 8]))[1]  # a short row
