"""Prefix reuse across requests (unmask.engine.prefix_store) on block-causal models.

(a) reuse on == reuse off, bit for bit: tokens, every step's scores, every step's stored K/V,
    for random shared prefixes, joins, aborts and 1-16 requests at once (hypothesis);
(b) a finished block's K/V is the same bits whichever call computed it (kv.Frame.spans): a
    prefill reaching farther, or the decode step after the block finished;
(c) eviction under pressure while readers run: the store stays under budget, nothing changes;
(d) budgets: bad ones refused in one line, a prompt longer than the budget runs unstored.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import numpy as np
import pytest
import torch
from helpers import BLOCK_FAMILIES, peaky_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.engine import prefix_store as prefix_store_mod
from unmask.engine import runner as runner_mod
from unmask.engine.prefix_store import PrefixStore, check_budget, make_prefix_store
from unmask.errors import InputError

VOCAB, MASK, EOS, BS = 64, 63, 1, 4
SPECS = ["static-1", "threshold,threshold=0.5", "freedave,draft_steps=3",
         "threshold,threshold=0.7,temperature=0.8"]


@functools.cache
def model(family: str, dtype: torch.dtype) -> torch.nn.Module:
    return copy.deepcopy(peaky_model(family, 0, 4.0, VOCAB, MASK, EOS)).to(dtype)


def params(spec: str, gen: int, seed: int) -> DecodeParams:
    return DecodeParams.parse(spec, gen_length=gen, block_length=BS, seed=seed)


def decode_all(m, jobs, prefix: PrefixStore | None, max_running: int, join_at: list[int],
               abort: tuple[int, int] | None) -> dict:
    """Run `jobs` (prompt, spec, gen) on one engine: job i joins at step join_at[i]; abort
    (job, step) aborts that job then. Returns, by (job, step), what the engine held for it after
    the step: canvas, predictions, confidences (bits) and stored K/V by position; and by job
    its outcome."""
    eng = Engine(m, SchedulerConfig(max_running=max_running), mask_id=MASK, eos_id=EOS,
                 prefix=prefix)
    seen, reqs, step = {}, {}, 0
    while len(reqs) < len(jobs) or eng.has_unfinished:
        for i, (prompt, spec, gen) in enumerate(jobs):
            if i not in reqs and join_at[i] <= step:
                reqs[i] = eng.add_request(prompt, params(spec, gen, i))
        if abort is not None and abort[1] == step and abort[0] in reqs:
            eng.abort(reqs[abort[0]].request_id)
        eng.step()
        step += 1
        label = {r.request_id: i for i, r in reqs.items()}
        for b in eng.batches.values():
            for row, r in enumerate(b.requests):
                pad = int(b.rows.pad[row])
                # copies: the batch's arrays change in place at later steps
                state = [b.x[row, pad:].copy(), b.preds.token[row, pad:].copy(),
                         b.preds.conf[row, pad:].view(np.int32).copy()]
                srow = int(b.store_row[row])
                held = b.store.token[srow, : r.slots].copy()
                state += [held, b.store.kv[srow, : r.slots][torch.from_numpy(held >= 0)].clone()]
                seen[(label[r.request_id], step)] = state
        assert step < 500
    outcome = {i: (r.token_ids, r.nfe, r.decided, r.finish_reason) for i, r in reqs.items()}
    return {"steps": seen, "outcome": outcome,
            "cached": {i: r.cached_tokens for i, r in reqs.items()}}


def assert_same(a: dict, b: dict) -> None:
    assert a["outcome"] == b["outcome"]
    assert a["steps"].keys() == b["steps"].keys()
    for key, state in a["steps"].items():
        for x, y in zip(state, b["steps"][key], strict=True):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), key
            else:
                np.testing.assert_array_equal(x, y, err_msg=str(key))


tokens = st.integers(3, VOCAB - 3)


# --- (a) reuse on == reuse off, bit for bit ----------------------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), family=st.sampled_from(list(BLOCK_FAMILIES)),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       shared=st.lists(tokens, min_size=0, max_size=14), n=st.integers(1, 16),
       max_running=st.integers(1, 16), spec=st.sampled_from(SPECS),
       chunk=st.sampled_from([8, runner_mod.SPAN_CHUNK]),
       tight=st.booleans())
def test_reuse_changes_no_bit(data, family, dtype, shared, n, max_running, spec, chunk,
                              tight) -> None:
    """Requests sharing a prefix (or parts of it), joining at random steps, one aborted: with a
    store (fed by a first round, then by the requests themselves) every step's canvas, scores
    and stored K/V are the bits of the same requests without one. Finished blocks attend in
    chunks of `chunk` positions (8: two blocks, so that short prompts span several); `tight`:
    the pool's segments hold one block, so that the store lets blocks go and grows as they are
    asked for again."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_mod, "SPAN_CHUNK", chunk)
        if tight:
            mp.setattr(prefix_store_mod, "SEGMENT_BYTES", 1)
        check_reuse_changes_no_bit(data, family, dtype, shared, n, max_running, spec, tight)


def check_reuse_changes_no_bit(data, family, dtype, shared, n, max_running, spec,
                               tight) -> None:
    m = model(family, dtype)
    jobs = [(shared[: data.draw(st.integers(0, len(shared)))]
             + data.draw(st.lists(tokens, min_size=1, max_size=6)), spec,
             data.draw(st.sampled_from([4, 8, 12]))) for _ in range(n)]
    join_at = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    abort = data.draw(st.none() | st.tuples(st.integers(0, n - 1), st.integers(1, 8)))
    store = PrefixStore(BS, 1 << 30)
    off = decode_all(m, jobs, None, max_running, join_at, abort)
    first = decode_all(m, jobs, store, max_running, join_at, abort)
    again = decode_all(m, jobs, store, max_running, join_at, abort)  # the store warm
    assert_same(off, first)
    assert_same(off, again)
    # every prompt's whole blocks but the one holding its last token came from the store (a
    # tight pool may still be growing to hold them all)
    for i, (prompt, _, _) in enumerate(jobs):
        if not tight and (abort is None or abort[0] != i):
            assert again["cached"][i] == (len(prompt) - 1) // BS * BS


# --- (b) a finished block's K/V does not depend on the call ---------------------------------------
def first_step_kv(m, prompt: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """After a prompt's first step: the tokens its store row holds K/V of, and that K/V."""
    eng = Engine(m, mask_id=MASK, eos_id=EOS)
    eng.add_request(prompt, params("static-1", 4, 0))
    eng.step()
    b = next(iter(eng.batches.values()))
    row = int(b.store_row[0])
    return b.store.token[row].copy(), b.store.kv[row].clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("chunk", [8, runner_mod.SPAN_CHUNK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_finished_blocks_kv_is_the_same_bits_from_any_call(dtype, chunk) -> None:
    """Every finished block's K/V from prompts of 5, 13 and 29 tokens (calls of 8, 16 and 32
    keys; in chunks of two blocks, the calls of the later prompts reach past the first block's
    chunk): without block-by-block attention the kernel rounds them differently."""
    m = model("sdar", dtype)
    prompts = [list(range(5, 5 + k)) for k in (5, 13, 29)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_mod, "SPAN_CHUNK", chunk)
        kv = [first_step_kv(m, p)[1] for p in prompts]
    for a, b, n in ((0, 1, 4), (0, 2, 4), (1, 2, 12)):
        assert same_bits(kv[a][:n], kv[b][:n]), (a, b)


@pytest.mark.parametrize("chunk", [8, runner_mod.SPAN_CHUNK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_answers_blocks_have_the_bits_a_prefill_gives_them(dtype, chunk) -> None:
    """The K/V of blocks finished while decoding (stored when the request leaves, as the next
    turn of a chat reads them) is the K/V a prefill of the same tokens computes."""
    m = model("sdar", dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner_mod, "SPAN_CHUNK", chunk)
        run = decode_all(m, [([5, 6, 7, 8, 9], "static-1", 24)], None, 1, [0], None)
        # the store row when it held the most
        *_, held, kv = max(run["steps"].values(), key=lambda state: int((state[3] >= 0).sum()))
        n = int((held >= 0).sum())
        assert n >= 20 and (held[:n] >= 0).all()  # blocks of the answer among them
        token, again = first_step_kv(m, held[:n].tolist() + [3])
    assert (token[:n] == held[:n]).all()
    assert same_bits(kv, again[:n])


# --- (c) eviction while readers run ---------------------------------------------------------------
def test_eviction_under_pressure_changes_nothing_and_keeps_the_budget() -> None:
    """A store of 6 blocks, prompts sharing prefixes of several lengths and many distinct ones,
    8 at a time: blocks are evicted while requests that read them run; every step's bits equal
    reuse off, and the store never holds more than its budget."""
    m = model("sdar", torch.float32)
    rng = np.random.default_rng(0)
    stems = [rng.integers(3, VOCAB - 3, 12).tolist() for _ in range(3)]
    jobs = [(stems[i % 3][: 4 + 4 * (i % 3)] + rng.integers(3, VOCAB - 3, 1 + i % 5).tolist(),
             "threshold,threshold=0.5", 8) for i in range(24)]
    one_block = 2 * m.config.n_layers * m.config.n_kv_heads * m.config.head_dim * 4 * BS
    store = PrefixStore(BS, 6 * one_block)
    high = []
    offer = PrefixStore._offer

    def watch(self, b, leaving):
        offer(self, b, leaving)
        high.append(self.stats.stored_bytes)

    join_at = [i // 3 for i in range(len(jobs))]
    off = decode_all(m, jobs, None, 8, join_at, None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PrefixStore, "_offer", watch)
        on = decode_all(m, jobs, store, 8, join_at, None)
    assert_same(off, on)
    assert store.stats.evictions > 0 and store.stats.hit_tokens > 0
    assert max(high) <= store.budget and store.stats.stored_blocks <= 6


def test_the_pool_reads_back_what_it_wrote_in_any_order_across_segments() -> None:
    """Entries in segments of 3, written and read in scrambled order (runs cut at segment
    ends and at gaps)."""
    kv = torch.zeros(1, 8, 2, 2, 1, 3)  # a K/V store (N, W, L, 2, H, D), blocks of 2
    pool = prefix_store_mod._Pool(3)
    while pool.entries < 10:
        pool.grow(kv, 2, 10)
    assert [seg.shape[0] for seg in pool.segments] == [3, 3, 3, 1]
    src = torch.randn(10, 2, 2, 2, 1, 3)
    order = [9, 2, 3, 4, 5, 0, 1, 8, 7, 6]
    pool.write(order, src.view(20, 2, 2, 1, 3), np.arange(0, 20, 2))
    out = torch.empty_like(src)
    pool.read(list(range(10)), out)
    assert torch.equal(out[order], src)


def test_a_pool_of_many_segments_changes_nothing(monkeypatch) -> None:
    """Segments of two blocks (a prompt's blocks span several; evictions scatter the free
    entries across them): every step's bits equal reuse off, and the hits were read."""
    m = model("sdar", torch.float32)
    one_block = 2 * m.config.n_layers * m.config.n_kv_heads * m.config.head_dim * 4 * BS
    monkeypatch.setattr(prefix_store_mod, "SEGMENT_BYTES", 2 * one_block)
    rng = np.random.default_rng(1)
    stem = rng.integers(3, VOCAB - 3, 16).tolist()
    jobs = [(stem[: 4 * (1 + i % 4)] + rng.integers(3, VOCAB - 3, 1 + i % 3).tolist(),
             "threshold,threshold=0.5", 8) for i in range(16)]
    store = PrefixStore(BS, 9 * one_block)
    join_at = [i // 2 for i in range(len(jobs))]
    assert_same(decode_all(m, jobs, None, 4, join_at, None),
                decode_all(m, jobs, store, 4, join_at, None))
    assert store.stats.evictions > 0 and store.stats.hit_tokens > 0
    assert len(store._pool.segments) == 5  # 9 blocks: four of two, one of one


def one_block(m: torch.nn.Module) -> int:
    """Bytes of one block's K/V of the float32 model m."""
    return 2 * m.config.n_layers * m.config.n_kv_heads * m.config.head_dim * 4 * BS


def test_traffic_that_shares_nothing_keeps_the_pool_at_one_segment(monkeypatch) -> None:
    """Prompts that share nothing, twelve times the blocks a segment holds: the pool never
    grows past its first segment (it evicts, and lets go of what a step finishes past it,
    instead of touching new memory), and every bit is that of no store."""
    m = model("sdar", torch.float32)
    monkeypatch.setattr(prefix_store_mod, "SEGMENT_BYTES", 4 * one_block(m))
    rng = np.random.default_rng(2)
    jobs = [(rng.integers(3, VOCAB - 3, 9 + i % 4).tolist(), "threshold,threshold=0.5", 8)
            for i in range(12)]
    store = PrefixStore(BS, 1 << 30)
    join_at = [i // 4 for i in range(len(jobs))]
    assert_same(decode_all(m, jobs, None, 4, join_at, None),
                decode_all(m, jobs, store, 4, join_at, None))
    assert len(store._pool.segments) == 1 and store._pool.entries == 4
    assert store.stats.evictions > 0 and store.stats.stored_blocks == 4


def test_a_prefix_let_go_for_lack_of_room_grows_the_pool_when_asked_again(monkeypatch) -> None:
    """A prompt of ten whole blocks into a pool of four: the store keeps four and remembers the
    rest; the same prompt again misses them, so the pool grows and takes them; the third time
    reads every block but the one holding the prompt's last token. Bits as without a store."""
    m = model("sdar", torch.float32)
    monkeypatch.setattr(prefix_store_mod, "SEGMENT_BYTES", 4 * one_block(m))
    job = [(list(range(3, 44)), "static-1", 4)]  # 41 tokens
    store = PrefixStore(BS, 1 << 30)
    off = decode_all(m, job, None, 1, [0], None)
    assert_same(off, decode_all(m, job, store, 1, [0], None))
    assert store._pool.entries == 4 and store.stats.stored_blocks == 4
    assert_same(off, decode_all(m, job, store, 1, [0], None))
    assert store._pool.entries > 4
    # a block stored again is no longer remembered as let go (else a later miss past it would
    # count it and grow the pool for a block it holds)
    assert not set(store._entry) & set(store._ghosts)
    third = decode_all(m, job, store, 1, [0], None)
    assert_same(off, third)
    assert third["cached"][0] == 40


def test_a_decoding_row_costs_the_store_nothing_until_it_leaves(monkeypatch) -> None:
    """static-1 commits a token a step: the store looks at the row at its prompt's step and
    when it leaves, never at the steps between, and holds its answer's blocks then."""
    m = model("sdar", torch.float32)
    looked = []
    offer = PrefixStore._offer

    def watch(self, b, leaving):
        looked.append(len(b))
        offer(self, b, leaving)

    monkeypatch.setattr(PrefixStore, "_offer", watch)
    store = PrefixStore(BS, 1 << 30)
    run = decode_all(m, [(list(range(5, 14)), "static-1", 16)], store, 1, [0], None)
    assert len(run["steps"]) >= 16 and looked == [1, 1]
    assert store.stats.stored_blocks == (9 + 16) // BS  # the prompt's two, the answer's four


def test_a_request_stopped_early_leaves_its_answers_blocks(monkeypatch) -> None:
    """A request aborted mid-answer (as the server stops one whose text reached a stop string)
    leaves the store every whole block its row holds, the answer's among them: the next turn
    of a chat resends that answer."""
    m = model("sdar", torch.float32)
    store = PrefixStore(BS, 1 << 30)
    eng = Engine(m, mask_id=MASK, eos_id=EOS, prefix=store)
    req = eng.add_request(list(range(5, 14)), params("static-1", 24, 0))  # 9 tokens: 2 blocks
    for _ in range(14):
        eng.step()
    b = next(iter(eng.batches.values()))
    held = b.store.token[int(b.store_row[0]), : req.slots] >= 0
    whole = int(held[: held.size // BS * BS].reshape(-1, BS).all(-1).argmin())
    assert whole > 3  # the answer's blocks among them
    eng.abort(req.request_id, reason="stop")
    assert store.stats.stored_blocks == whole


def test_a_block_two_rows_finish_in_one_step_is_stored_once() -> None:
    """Identical prompts decoded side by side finish the same blocks in the same steps: each
    is stored once (nothing evicted, so every block taken in is still held)."""
    m = model("sdar", torch.float32)
    store = PrefixStore(BS, 1 << 30)
    jobs = [(list(range(3, 14)), "static-1", 8)] * 3
    on = decode_all(m, jobs, store, 3, [0, 0, 0], None)
    assert_same(decode_all(m, jobs, None, 3, [0, 0, 0], None), on)
    assert store.stats.evictions == 0
    assert store.stats.inserted_blocks == store.stats.stored_blocks == (11 + 8) // BS


def test_the_stores_read_only_lookup_counts_what_a_join_would_read() -> None:
    """PrefixStore.held and Engine.uncached, for the admission window: a prompt stored whole,
    partly (its first miss ends the count), not at all, with no store, and with a decoder that
    does not reuse the store; and the look moves nothing in the LRU order and counts nothing."""
    m = model("Fast_dLLM_Qwen", torch.float32)  # it can run a decoder that does not reuse
    store = PrefixStore(BS, 1 << 30)
    eng = Engine(m, mask_id=MASK, eos_id=EOS, prefix=store)
    stored = list(range(3, 20))  # 17 tokens: four whole blocks, the last token's block beyond
    eng.add_request(stored, params("static-1", 4, 0))
    eng.run()
    order, stats = list(store._entry), dataclasses.replace(store.stats)
    partly = stored[:8] + [40] * 9  # two stored blocks, then a miss
    cases = {"stored": (stored, 16), "partly": (partly, 8), "not stored": ([41] * 17, 0),
             "last token's block": (stored[:16], 12)}  # that block is always forwarded
    for name, (prompt, held) in cases.items():
        assert store.held(prompt) == held, name
        req = eng.add_request(prompt, params("static-1", 4, 0))
        assert eng.uncached(req) == len(prompt) - held, name
        eng.abort(req.request_id)
    assert list(store._entry) == order and store.stats == stats and store._wanted == 0
    sub = eng.add_request(stored, DecodeParams.parse("static-1", gen_length=4, block_length=BS,
                                                     cache="sub_block", sub_block_length=2))
    assert not prefix_store_mod.reuses(sub.params) and eng.uncached(sub) == 17
    bare = Engine(m, mask_id=MASK, eos_id=EOS)
    assert bare.uncached(bare.add_request(stored, params("static-1", 4, 0))) == 17


# --- (d) budgets ---------------------------------------------------------------------------------
def test_a_requests_blocks_are_hashed_once_for_the_windows_look_and_its_restore(
        monkeypatch) -> None:
    """PromptKeys: the admission window's look (Engine.uncached) and the restore of the step
    that admits the request read one chain of keys, computed once, the same keys a fresh
    computation gives; and a reader that stops early (a miss) leaves the rest uncomputed."""
    m = model("sdar", torch.float32)
    store = PrefixStore(BS, 1 << 30)
    eng = Engine(m, mask_id=MASK, eos_id=EOS, prefix=store)
    stored = list(range(3, 20))
    eng.add_request(stored, params("static-1", 4, 0))
    eng.run()
    hashed = []
    real = prefix_store_mod.hashlib.blake2b
    monkeypatch.setattr(prefix_store_mod.hashlib, "blake2b",
                        lambda *a, **k: hashed.append(1) or real(*a, **k))
    req = eng.add_request(stored + [30, 31], params("static-1", 4, 0))
    assert eng.uncached(req) == 19 - 16
    assert len(hashed) == 4  # the prompt's four whole blocks before its last token's
    eng.step()  # restores it
    assert len(hashed) == 4 and req.cached_tokens == 16
    assert list(req.prompt_keys) == list(PrefixStore.keys(b"", stored[:16], BS))
    keys = prefix_store_mod.PromptKeys([41] * 17, BS)
    hashed.clear()
    first = next(iter(keys))
    assert len(hashed) == 1 and list(keys)[0] == first and len(hashed) == 4


@pytest.mark.parametrize("gib", [0, -1, float("nan"), float("inf"), True, "1"])
def test_bad_budgets_are_refused(gib) -> None:
    with pytest.raises(InputError, match="prefix_cache_gib"):
        check_budget(gib)


def test_a_budget_past_free_memory_is_refused() -> None:
    with pytest.raises(InputError, match="exceeds the memory free"):
        check_budget(2.0, free_bytes=1 << 30)
    assert check_budget(0.5, free_bytes=1 << 30) == 1 << 29


def test_the_store_is_for_block_causal_models_only() -> None:
    llada = peaky_model("llada", 0, 4.0, VOCAB, MASK, EOS)
    cpu = torch.device("cpu")
    assert make_prefix_store(llada, cpu) is None  # the default: no store, no error
    with pytest.raises(InputError, match="block-causal models"):
        make_prefix_store(llada, cpu, gib=0.5)
    with pytest.raises(InputError, match="off"):
        make_prefix_store(model("sdar", torch.float32), cpu, enabled=False, gib=0.5)
    store = make_prefix_store(model("sdar", torch.float32), cpu)
    assert store.block_size == BS and store.budget > 0


def test_a_prompt_longer_than_the_budget_runs_without_storing() -> None:
    m = model("sdar", torch.float32)
    store = PrefixStore(BS, 3 * 2 * m.config.n_layers * m.config.n_kv_heads * m.config.head_dim
                        * 4 * BS)  # three blocks
    jobs = [(list(range(3, 40)), "static-1", 8)]  # 10 whole blocks: runs, stores nothing
    off = decode_all(m, jobs, None, 1, [0], None)
    on = decode_all(m, jobs, store, 1, [0], None)
    assert_same(off, on)
    assert store.stats.inserted_blocks == 0
    short = [(list(range(3, 8)), "static-1", 4)]  # 8 positions, fits: stored
    decode_all(m, short, store, 1, [0], None)
    assert store.stats.inserted_blocks > 0 and store.stats.stored_bytes <= store.budget
