"""The engine: step events, joining and leaving, budgets, progress, and batch invariance.

Batch invariance is the engine's correctness property for serving: a request's tokens (and its
NFE and token-forwards) never depend on who else is in the batch, when it joined, or who left.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import EOS, MASK, VOCAB, peaky_model, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, QueueFull, SchedulerConfig, decode
from unmask.engine import decoder as decoder_mod
from unmask.errors import InputError

METHODS = ["static,steps=8", "static-1", "threshold,threshold=0.5", "freedave,draft_steps=3",
           "freedave++,draft_steps=3,threshold=0.5"]
CACHES = ["none", "prefix", "dual", "entropy", "entropy,recent_k=0,block_recompute=masked"]
SUFFIXES = ["full", "window,suffix_local=4",
            "structured,suffix_local=2,suffix_middle=3,suffix_tail=2",
            "structured,suffix_local=2,suffix_middle=3,suffix_tail=2,suffix_rule=grid,inject=0.5"]


@functools.cache
def model(kind: str):
    return peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)


def params(spec: str, gen: int = 16, seed: int = 0) -> DecodeParams:
    return DecodeParams.parse(spec, gen_length=gen, block_length=8, seed=seed)


def outcome(req) -> tuple:
    return req.token_ids, req.nfe, req.token_forwards, req.decided, req.finish_reason


def alone(m, p: DecodeParams, prompt: list[int]) -> tuple:
    return outcome(decode(m, p, [prompt], mask_id=MASK, eos_id=EOS)[0])


def engine(m, **kw) -> Engine:
    return Engine(m, SchedulerConfig(**kw), mask_id=MASK, eos_id=EOS)


# --- batch invariance -----------------------------------------------------------------------------
tokens = st.integers(3, VOCAB - 3)
prompts = st.lists(tokens, min_size=1, max_size=9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["llada", "Dream"]), method=st.sampled_from(METHODS),
       cache=st.sampled_from(CACHES), suffix=st.sampled_from(SUFFIXES),
       early_exit=st.booleans(), temperature=st.sampled_from([0.0, 0.8]),
       target=prompts, others=st.lists(st.tuples(prompts, st.sampled_from([8, 16, 32])),
                                      min_size=1, max_size=3),
       join_at=st.integers(0, 6), abort_at=st.integers(1, 8))
def test_batch_invariance(kind, method, cache, suffix, early_exit, temperature, target, others,
                          join_at, abort_at) -> None:
    """A request decoded alone == decoded in a batch == admitted at step k of other running
    requests == with another request aborted mid-way (same decoder, other prompts and lengths;
    plus one request of another decoder, which runs interleaved)."""
    m = model(kind)
    spec = f"{method},cache={cache},suffix={suffix},early_exit={early_exit},temperature={temperature}"
    p = params(spec, seed=3)
    want = alone(m, p, target)

    # all at once
    reqs = decode(m, p, [target] + [q for q, _ in others], mask_id=MASK, eos_id=EOS)
    assert outcome(reqs[0]) == want

    # joining at step k, with other lengths running, one of them aborted, another decoder beside
    eng = engine(m)
    running = [eng.add_request(q, params(spec, gen, seed=i)) for i, (q, gen) in enumerate(others)]
    eng.add_request(target[::-1], params("threshold,threshold=0.7,cache=dual", 16))
    for _ in range(join_at):
        eng.step()
    req = eng.add_request(target, p)
    steps = 0
    while eng.has_unfinished:
        eng.step()
        steps += 1
        if steps == abort_at and not running[0].finished:
            assert eng.abort(running[0].request_id)
    assert outcome(req) == want


@pytest.mark.parametrize("spec", ["fast", "threshold,cache=entropy", "threshold,suffix=structured,"
                                  "suffix_rule=grid", "exact", "static-1,temperature=0.5,seed=7"])
def test_batch_invariance_embedded_model(spec: str) -> None:
    """The embedded model, real prompts of different lengths: each alone == all in one batch ==
    joined one at a time while the others run."""
    from unmask import LLM

    llm = LLM()
    texts = ["What is 47 + 38?", "Sort these numbers: 5, 2, 9, 14, 3.",
             "What is 12 * 3 + 7?", "def add(a, b):"]
    ids = [llm.encode_prompt(t) for t in texts]
    p = DecodeParams.parse(spec, gen_length=64, block_length=32)
    solo = [outcome(decode(llm.model, p, [q])[0]) for q in ids]
    assert [outcome(r) for r in decode(llm.model, p, ids)] == solo
    eng = Engine(llm.model)
    reqs = []
    for q in ids:
        reqs.append(eng.add_request(q, p))
        eng.step()
        eng.step()
    eng.run()
    assert [outcome(r) for r in reqs] == solo


# --- events ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["static-1", "freedave,draft_steps=4", "threshold,cache=entropy,"
                                  "early_exit=true", "fast"])
def test_events_describe_the_decode(spec: str) -> None:
    """Every generated position is reported committed exactly once, with its final token; the
    committed prefix only grows; counters match the request; the last event finishes it."""
    m = model("llada")
    eng = engine(m)
    req = eng.add_request([5, 6, 7], params(spec, 32), trace=True)
    seen: dict[int, int] = {}
    prefix, last, drafted = 0, None, 0
    while eng.has_unfinished:
        for ev in eng.step():
            assert ev.request_id == req.request_id
            for pos, tok in zip(ev.positions, ev.tokens, strict=True):
                assert pos not in seen
                seen[pos] = tok
            assert set(ev.drafted) <= set(ev.positions)
            drafted += len(ev.drafted)
            assert ev.prefix >= prefix
            prefix = ev.prefix
            if ev.forwarded:
                assert ev.suffix_kept is not None
            last = ev
    assert last is not None and last.finished in ("eos", "length")
    assert sorted(seen) == list(range(32))
    assert [seen[i] for i in range(32)] == req.token_ids
    assert (last.nfe, last.token_forwards, last.decided) == (req.nfe, req.token_forwards, req.decided)
    if spec.startswith("freedave"):
        assert drafted > 0  # FreeDave accepted drafts past the rule's own step
    if "early_exit" not in spec and spec != "fast":
        assert req.decided == 32  # every position was decided by a forward


def test_tpf_counts_only_forward_decisions() -> None:
    """Early exit fills EOS without a forward: those positions do not count in `decided`."""
    from unmask import LLM

    llm = LLM()
    g = llm.generate(["What is 4 + 5?"], "threshold,early_exit=true", gen_length=256)[0]
    decided_by_forwards = g.tpf * g.nfe
    assert decided_by_forwards < 256  # the EOS tail was filled, not decided
    assert g.tpf == pytest.approx(decided_by_forwards / g.nfe)


# --- scheduling -----------------------------------------------------------------------------------
def test_short_request_is_not_held_hostage() -> None:
    """A 64-token request admitted while a 1024-token one runs finishes first, in far fewer
    engine steps."""
    m = tiny_model("llada", vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS,
                   max_sequence_length=1100)
    eng = engine(m)
    long = eng.add_request([5, 6, 7], DecodeParams.parse("static-1", gen_length=1024, block_length=32))
    for _ in range(5):
        eng.step()
    short = eng.add_request([8, 9], DecodeParams.parse("static-1", gen_length=64, block_length=32))
    finished_at: dict[str, int] = {}
    step = 5
    while eng.has_unfinished:
        step += 1
        for ev in eng.step():
            if ev.finished:
                finished_at[ev.request_id] = step
    # a first forward, then one commit per step (the last commit needs no forward)
    assert finished_at[short.request_id] == 5 + 64 + 1
    assert finished_at[long.request_id] == 1024 + 1
    assert short.nfe == 64 and long.nfe == 1024


def test_row_budget_queues() -> None:
    m = model("llada")
    eng = engine(m, max_running=2)
    reqs = [eng.add_request([5 + i], params("static-1", 8)) for i in range(3)]
    eng.step()
    assert [r.status for r in reqs] == ["running", "running", "waiting"]
    eng.run()
    assert all(r.finished for r in reqs)
    assert reqs[2].started >= max(reqs[0].finished_at, reqs[1].finished_at)


def test_slot_budget_waits_and_refuses() -> None:
    m = model("llada")
    eng = engine(m, max_slots=40)
    with pytest.raises(InputError, match="slot budget 40"):
        eng.add_request([5] * 10, params("static-1", 32))  # 42 slots: never fits
    a = eng.add_request([5] * 8, params("static-1", 24))  # 32 slots
    b = eng.add_request([6] * 2, params("static-1", 8))  # with a: 2 rows x (8 + 24) = 64 > 40
    eng.step()
    assert (a.status, b.status) == ("running", "waiting")
    assert eng.scheduler.slots_in_use() <= 40
    eng.run()
    assert b.finished and b.started >= a.finished_at


def test_queue_limit() -> None:
    eng = engine(model("llada"), max_running=1, max_queue=1)
    eng.add_request([5], params("static-1", 8))
    with pytest.raises(QueueFull):
        eng.add_request([6], params("static-1", 8))


def test_abort_waiting_and_running() -> None:
    m = model("llada")
    eng = engine(m, max_running=1)
    a = eng.add_request([5, 6], params("static-1", 16))
    b = eng.add_request([7], params("static-1", 16))
    eng.step()
    assert eng.abort(a.request_id) and eng.abort(b.request_id)
    assert not eng.abort("no-such-request")
    events = eng.step()
    assert {(e.request_id, e.finished) for e in events} == {(a.request_id, "abort"),
                                                            (b.request_id, "abort")}
    assert not eng.has_unfinished and eng.n_running == 0
    # an idle decoder's batch holds no rows, canvas or K/V
    assert all(len(b) == 0 and b.S == 0 and (b.store is None or b.store.kv.numel() == 0)
               for b in eng.batches.values())


def test_idle_decoders_are_bounded() -> None:
    """A server sees many specs: decoders without rows are kept for reuse, but only a few."""
    eng = engine(model("llada"))
    specs = [f"threshold,threshold={0.5 + i / 100},cache=dual" for i in range(eng.max_idle + 4)]
    for spec in specs:
        eng.add_request([5, 6], params(spec, 8))
        eng.run()
    assert len(eng.decoders) == len(eng.batches) == eng.max_idle
    again = eng.add_request([5, 6], params(specs[-1], 8))  # reuses the idle decoder
    eng.run()
    assert again.finish_reason in ("eos", "length") and len(eng.decoders) == eng.max_idle


def test_bad_requests() -> None:
    eng = engine(model("llada"))
    with pytest.raises(InputError, match="empty prompt"):
        eng.add_request([], params("static-1"))
    with pytest.raises(InputError, match="max_sequence_length"):
        eng.add_request([5] * 120, params("static-1", 16))
    with pytest.raises(InputError, match="vocabulary"):
        eng.add_request([VOCAB + 5], params("static-1"))
    with pytest.raises(InputError, match="DecodeParams"):
        eng.add_request([5], "static-1")  # type: ignore[arg-type]
    eng.add_request([5], params("static-1"), request_id="x")
    with pytest.raises(InputError, match="already in use"):
        eng.add_request([5], params("static-1"), request_id="x")


# --- progress and failures --------------------------------------------------------------------------
def test_a_step_that_commits_nothing_is_an_error(monkeypatch) -> None:
    """A decode that stops making progress finishes with an error naming the cause; the other
    decoder's request in the same engine is unaffected."""
    m = model("llada")
    want = alone(m, params("threshold,threshold=0.5"), [9, 9])
    real = decoder_mod.Decoder._draft

    def stuck(self, b, *args):  # the static-1 decoder's drafts commit nothing
        d = real(self, b, *args)
        if self.params.method == "static-1":
            d.x = np.where(d.added, MASK, d.x)
            d.added[:] = False
        return d

    monkeypatch.setattr(decoder_mod.Decoder, "_draft", stuck)
    eng = engine(m)
    bad = eng.add_request([5, 6], params("static-1"))
    good = eng.add_request([9, 9], params("threshold,threshold=0.5"))
    for _ in range(50):
        if not eng.has_unfinished:
            break
        eng.step()
    assert not eng.has_unfinished
    assert bad.finish_reason == "error" and "no progress" in bad.error
    assert outcome(good) == want


def test_huge_temperature_terminates() -> None:
    """temperature=1000 used to give 0/0 = NaN for the suppressed mask token, which argmax
    picked: the decoder 'committed' [MASK] forever."""
    m = model("llada")
    for temp in (1000.0, 1e5):
        req = decode(m, params(f"static-1,temperature={temp}", 16), [[5, 6]], mask_id=MASK,
                     eos_id=EOS)[0]
        assert req.finish_reason in ("eos", "length") and MASK not in req.token_ids
        assert req.nfe == 16  # one position per step, the last needs no forward


def test_a_failing_batch_fails_alone(monkeypatch) -> None:
    """An exception inside one decoder's step fails that batch's requests with an error event;
    the engine keeps serving the other decoder."""
    m = model("llada")
    want = alone(m, params("threshold,threshold=0.5"), [9, 9])
    real = decoder_mod.Decoder.step

    def boom(self, b, trace=False):
        if self.params.method == "static-1":
            raise RuntimeError("kaput")
        return real(self, b, trace)

    monkeypatch.setattr(decoder_mod.Decoder, "step", boom)
    eng = engine(m)
    bad = eng.add_request([5, 6], params("static-1"))
    good = eng.add_request([9, 9], params("threshold,threshold=0.5"))
    events = eng.step()
    assert any(e.request_id == bad.request_id and e.finished == "error" for e in events)
    eng.run()
    assert bad.finish_reason == "error" and "kaput" in bad.error
    assert outcome(good) == want


def test_noise_is_per_request() -> None:
    """Two prompts with the same seed draw different noise; the same prompt and seed the same."""
    m = model("llada")
    p = params("static-1,temperature=1.0", 16, seed=5)
    a, b, a2 = decode(m, p, [[5, 6, 7], [5, 6, 8], [5, 6, 7]], mask_id=MASK, eos_id=EOS)
    assert a.token_ids == a2.token_ids
    assert a.noise_key != b.noise_key


@pytest.mark.parametrize("spec", ["threshold,cache=entropy,entropy_tau=0.5", "fast",
                                  "freedave,cache=dual", "threshold,suffix=structured,inject=0.5"])
def test_attention_row_groups_change_nothing(spec: str, monkeypatch) -> None:
    """Rows attending in groups (to save padding), in any order, give what one padded batch of
    rows gives: tokens, NFE, token-forwards and the stored K/V they attend to."""
    from unmask.engine import runner as runner_mod

    m = model("Dream" if "inject" in spec else "llada")
    prompts = [[5, 6, 7], [8] * 9, [9, 10], [11, 12, 13, 14], [3], [4, 4, 4, 4, 4, 4]]
    p = params(spec, 32)
    monkeypatch.setattr(runner_mod.Runner, "pack_min_padding", 2.0)  # never packed, one group
    monkeypatch.setattr(runner_mod.Runner, "group_cost", float("inf"))
    one = [outcome(r) for r in decode(m, p, prompts, mask_id=MASK, eos_id=EOS)]
    calls = []

    def halves(n_tokens, n_past, cost):  # later rows first: groups out of the call's row order
        r = n_tokens.shape[0]
        calls.append(r)
        idx = np.arange(r)[::-1].copy()
        return [idx[: r // 2], idx[r // 2 :]] if r >= 2 else [np.arange(r)]

    monkeypatch.setattr(runner_mod, "attention_groups", halves)
    two = [outcome(r) for r in decode(m, p, prompts, mask_id=MASK, eos_id=EOS)]
    assert max(calls) >= 2 and two == one


def test_row_groups_attend_like_one_padded_batch(monkeypatch) -> None:
    """One model call, its rows padded as one batch vs packed in groups: the same logits and
    fresh K/V for every real token (float32 rounding apart)."""
    from unmask.engine import runner as runner_mod
    from unmask.kv import KVStore
    from unmask.suffix import make_suffix_policy

    m = tiny_model("llada", seed=0)
    c = m.config
    p = params("threshold,cache=entropy", 16)
    run = runner_mod.Runner(m, p, MASK, EOS, make_suffix_policy(p))
    g = np.random.default_rng(0)
    n_tok, n_past = np.array([9, 2, 3, 9, 1]), np.array([0, 7, 5, 2, 6])
    r, t = n_tok.size, n_tok.max()
    ok = np.arange(t)[None] < n_tok[:, None]
    ids = torch.from_numpy(g.integers(3, VOCAB - 3, (r, t)))
    pos = torch.from_numpy(np.arange(t)[None] + n_past[:, None])
    store = KVStore.empty(c.n_layers, r, c.n_kv_heads, 16, c.head_dim, torch.float32,
                          torch.device("cpu"))
    store.kv.normal_()
    past_mask = np.arange(n_past.max())[None] < n_past[:, None]
    past = runner_mod.Past(store, np.arange(r), np.tile(np.arange(n_past.max()), (r, 1)), past_mask)
    rows, cols = np.nonzero(ok)

    def call(groups):
        monkeypatch.setattr(runner_mod, "attention_groups", lambda *a: groups)
        with torch.no_grad():
            logits, fresh, at = run._call(ids, pos, ok, None, past, rows, cols)
        kv = torch.stack([x for kv in fresh for x in kv])  # (2L, B|1, H, T|N, D)
        return logits, (kv.transpose(2, 3)[:, rows, cols] if at is None
                        else kv.transpose(2, 3)[:, 0, at[rows, cols]])  # (2L, n, H, D)

    monkeypatch.setattr(runner_mod.Runner, "pack_min_padding", 2.0)
    padded = call([np.arange(r)])
    for groups in ([np.array([0, 3]), np.array([4, 1, 2])], [np.array([2]), np.array([4, 3, 0, 1])]):
        packed = call(groups)
        for a, b in zip(padded, packed, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_attention_groups_cut_where_padding_dominates() -> None:
    from unmask.engine.runner import attention_groups

    def groups(t, k, cost=4096.0):
        return [g.tolist() for g in attention_groups(np.array(t), np.array(k), cost)]

    # a refresh row beside cached rows: each kind attends on its own
    assert groups([100, 30, 30, 30, 30], [0, 200, 200, 200, 200]) == [[1, 2, 3, 4], [0]]
    assert groups([100, 30, 30, 30, 30], [0, 200, 200, 200, 200], float("inf")) == [[0, 1, 2, 3, 4]]
    assert groups([40, 41, 42], [100, 100, 100]) == [[0, 1, 2]]  # little padding: one group
    assert groups([7], [0]) == [[0]]


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 400)), min_size=1, max_size=64),
       cost=st.sampled_from([0.0, 4096.0, 1e5]))
def test_attention_groups_partition_the_rows_and_never_cost_more(rows, cost) -> None:
    from unmask.engine.runner import _pairs, attention_groups

    t, k = np.array([a for a, _ in rows]), np.array([b for _, b in rows])
    groups = attention_groups(t, k, cost)
    assert 1 <= len(groups) <= 4
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(rows)))
    if len(groups) == 1:
        assert groups[0].tolist() == list(range(len(rows)))  # one group: the rows in order
    split = sum(_pairs(t[g], k[g]) for g in groups) + cost * (len(groups) - 1)
    assert split <= _pairs(t, k)


@pytest.mark.parametrize("spec", ["threshold,cache=entropy,entropy_tau=0.5", "fast",
                                  "freedave,cache=dual", "threshold,suffix=structured,inject=0.5"])
def test_packed_model_calls_change_nothing(spec: str, monkeypatch) -> None:
    """Padded rows forwarded packed (their real tokens only) give what padded rows give."""
    from unmask.engine import runner as runner_mod

    m = model("Dream" if "inject" in spec else "llada")
    prompts = [[5, 6, 7], [8] * 9, [9, 10], [11, 12, 13, 14], [3], [4, 4, 4, 4, 4, 4]]
    p = params(spec, 32)
    packed = []
    inner = m.forward

    def spy(*args, frame=None, **kwargs):
        packed.append(frame.packed)
        return inner(*args, frame=frame, **kwargs)

    monkeypatch.setattr(m, "forward", spy)
    on = [outcome(r) for r in decode(m, p, prompts, mask_id=MASK, eos_id=EOS)]
    monkeypatch.setattr(runner_mod.Runner, "pack_min_padding", 2.0)  # never
    monkeypatch.setattr(runner_mod.Runner, "group_cost", float("inf"))  # one attention group
    n_packed = sum(packed)
    off = [outcome(r) for r in decode(m, p, prompts, mask_id=MASK, eos_id=EOS)]
    assert n_packed and sum(packed) == n_packed  # packed calls with it on, none with it off
    assert on == off


def test_store_rows_are_reused_not_copied(monkeypatch) -> None:
    """Leaving rows free their K/V store rows for joining ones: the pool never holds more rows
    than run at once, nor more than twice the area the rows use; tokens are as if alone."""
    from unmask.engine import batch as batch_mod

    m = model("llada")
    p = params("fast", 16)
    prompts = [[5, 6, 7], [8] * 9, [9, 10], [11, 12, 13, 14], [3], [4, 4, 4, 4, 4, 4], [7] * 12]
    seen = []
    inner = batch_mod.DecodeBatch.extend

    def extend(self, reqs):
        inner(self, reqs)
        rows, width = self.store.shape
        used = max(r.prompt_len + r.gen_length for r in self.requests)
        seen.append((rows, width, len(self.requests), used))
        assert len(set(self.store_row.tolist())) == len(self.requests)  # one store row each

    monkeypatch.setattr(batch_mod.DecodeBatch, "extend", extend)
    eng = engine(m, max_running=2)
    reqs = [eng.add_request(q, p) for q in prompts]
    eng.run()
    assert len(seen) > 2  # rows joined while others ran
    assert all(rows <= 2 and rows * width <= 2 * n * used for rows, width, n, used in seen)
    assert [outcome(r) for r in reqs] == [alone(m, p, q) for q in prompts]


def counted_call(fn, calls: list):
    def call(*a, **k):
        calls.append(1)
        return fn(*a, **k)
    return call


@pytest.mark.parametrize("spec", ["static-1", "freedave,draft_steps=4", "fast",
                                  "threshold,cache=entropy,entropy_tau=0.5"])
def test_device_reads_per_step_do_not_grow_with_the_batch(spec: str, monkeypatch) -> None:
    """On a GPU every device -> host read is a round trip. The decode state is on the host, so
    a step reads back only its model calls' scores (token, confidence, entropy: three reads a
    call, README "GPU"), never one per row or per draft."""
    import collections

    counts: collections.Counter[str] = collections.Counter()
    per_call = {}
    for bs in (1, 8):
        eng = engine(model("llada"), max_running=bs)
        for i in range(bs):
            eng.add_request([5 + i, 6, 7], params(spec, 32))
        eng.step()
        calls = []
        from unmask.engine import runner as runner_mod

        with monkeypatch.context() as mp:
            def counted(name, real):
                def read(*a, **k):
                    counts.update([name])
                    return real(*a, **k)
                return read

            # (numpy() of a CPU tensor is no transfer; on a GPU only cpu() moves data)
            for name in ("cpu", "__bool__", "tolist", "item", "__int__", "__float__", "__index__"):
                mp.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
            mp.setattr(torch, "equal", counted("equal", torch.equal))
            mp.setattr(runner_mod, "score", counted_call(runner_mod.score, calls))
            counts.clear()
            for _ in range(4):
                eng.step()
        assert calls
        per_call[bs] = dict(counts), len(calls)
        assert counts == {"cpu": 3 * len(calls)}, per_call  # the three scores, nothing else
