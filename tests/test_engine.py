"""The engine: step events, joining and leaving, budgets, progress, and batch invariance.

Batch invariance is the engine's correctness property for serving: a request's tokens (and its
NFE and token-forwards) never depend on who else is in the batch, when it joined, or who left.
"""

from __future__ import annotations

import functools
from unittest import mock

import numpy as np
import pytest
import torch
from helpers import BLOCK_FAMILIES, EOS, MASK, VOCAB, join_and_abort, peaky_model, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, QueueFull, SchedulerConfig, decode
from unmask.engine import decoder as decoder_mod
from unmask.engine import runner as runner_mod
from unmask.engine.commit import HostCommit
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
    spec = f"{method},cache={cache},suffix={suffix},early_exit={early_exit},temperature={temperature}"
    check_batch_invariance(model(kind), spec, target, others, join_at, abort_at)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["llada", "Dream"]), method=st.sampled_from(METHODS),
       cache=st.sampled_from(CACHES), temperature=st.sampled_from([0.0, 0.8]),
       target=prompts, others=st.lists(st.tuples(prompts, st.sampled_from([8, 16, 32])),
                                      min_size=1, max_size=3),
       join_at=st.integers(0, 6), abort_at=st.integers(1, 8))
def test_batch_invariance_in_shape_buckets(kind, method, cache, temperature, target, others,
                                           join_at, abort_at) -> None:
    """The same with every call cut into power-of-two shape buckets, as CUDA graphs run them
    (unmask/engine/buckets.py): a bidirectional row's bucket is its own counts', whoever shares
    the call."""
    spec = f"{method},cache={cache},temperature={temperature}"
    with mock.patch.object(runner_mod.Runner, "bucket_rule", "pow2"):
        check_batch_invariance(model(kind), spec, target, others, join_at, abort_at)


def check_batch_invariance(m, spec: str, target: list[int], others: list[tuple[list[int], int]],
                           join_at: int, abort_at: int) -> None:
    p = params(spec, seed=3)
    want = alone(m, p, target)

    # all at once
    reqs = decode(m, p, [target] + [q for q, _ in others], mask_id=MASK, eos_id=EOS)
    assert outcome(reqs[0]) == want

    # joining at step k, with other lengths running, one of them aborted, another decoder beside
    eng = engine(m)
    running = [eng.add_request(q, params(spec, gen, seed=i)) for i, (q, gen) in enumerate(others)]
    eng.add_request(target[::-1], params("threshold,threshold=0.7,cache=dual", 16))
    assert outcome(join_and_abort(eng, running, target, p, join_at, abort_at)) == want


@st.composite
def row_knobs(draw, method: str, cache: str) -> str:
    """Values of the per-row knobs that a decoder `method` with `cache` reads (a spec's tail)."""
    t = draw(st.sampled_from([0.0, 0.5, 0.8, 2.0]))
    parts = [f"temperature={t}", f"early_exit={draw(st.booleans())}"]
    if t > 0:
        parts += [f"top_p={draw(st.sampled_from([1.0, 0.9, 0.5]))}",
                  f"top_k={draw(st.sampled_from([0, 3]))}"]
    thresholded = method.startswith(("threshold", "freedave++"))
    if thresholded:
        parts.append(f"threshold={draw(st.sampled_from([0.3, 0.5, 0.9]))}")
    alg_temp = 0.0 if thresholded else draw(st.sampled_from([0.0, 0.5]))
    parts.append(f"alg_temp={alg_temp}")
    if method.startswith("freedave") and alg_temp == 0:
        parts.append(f"draft_conf={draw(st.sampled_from([0.0, 0.5]))}")
    if cache.startswith("entropy"):
        parts += [f"entropy_tau={draw(st.sampled_from([0.5, 3.0, float('inf')]))}",
                  f"recent_k={draw(st.sampled_from([0, 2]))}",
                  f"refresh_on_block={draw(st.booleans())}"]
    return ",".join(parts)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(["llada", "Dream"]),
       method=st.sampled_from(["static", "static-1", "threshold", "freedave,draft_steps=3",
                               "freedave++,draft_steps=3"]),
       cache=st.sampled_from(["none", "prefix", "dual", "entropy", "entropy,block_recompute=masked"]),
       suffix=st.sampled_from(SUFFIXES), target=prompts,
       others=st.lists(st.tuples(prompts, st.sampled_from([8, 16, 32])), min_size=1, max_size=3),
       join_at=st.integers(0, 4))
def test_batch_invariance_mixed_row_knobs(data, kind, method, cache, suffix, target, others,
                                          join_at) -> None:
    """Requests whose specs differ only in per-row knobs (temperature, top_p, top_k, alg_temp,
    threshold, draft_conf, EntropyCache's knobs, early_exit, seed, length) share one batch, and
    each gets what it gets alone, whether it joined first or later."""
    from unmask.engine.engine import decoder_key

    m = model(kind)
    base = f"{method},cache={cache},suffix={suffix}"
    rows = [(target, 16)] + others
    ps = [params(f"{base},{data.draw(row_knobs(method, cache))}", gen, seed=i)
          for i, (_, gen) in enumerate(rows)]
    assert len({decoder_key(p) for p in ps}) == 1  # one decoder, one model call a step
    want = [alone(m, p, q) for p, (q, _) in zip(ps, rows, strict=True)]
    eng = engine(m)
    reqs = [eng.add_request(rows[0][0], ps[0])]
    for _ in range(join_at):
        eng.step()
    reqs += [eng.add_request(q, p) for p, (q, _) in zip(ps[1:], rows[1:], strict=True)]
    eng.run()
    assert len(eng.decoders) == 1
    assert [outcome(r) for r in reqs] == want


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


def test_batch_invariance_embedded_model_bfloat16() -> None:
    """The embedded model in bfloat16, whose near-ties are common: 16 held-out math prompts at
    concurrency 16 give each request what concurrency 1 gives, bit for bit in its decisions.
    With row groups padded to their longest row (before the canonical shapes) two of these 16
    came out differently (held-out prompts 47 and 50; BENCHMARKS.md, "Engine batching")."""
    from unmask import LLM
    from unmask.bench.tasks import load_task

    llm = LLM(dtype="bfloat16")
    ids = [llm.encode_prompt(e.prompt) for e in load_task("math", 56).examples[40:56]]
    p = DecodeParams.parse("fast", gen_length=256)
    one = [outcome(r) for r in decode(llm.model, p, ids, max_running=1)]
    assert [outcome(r) for r in decode(llm.model, p, ids, max_running=16)] == one


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
    prefix, last, drafted, calls = 0, None, 0, 0
    while eng.has_unfinished:
        for ev in eng.step():
            assert ev.request_id == req.request_id
            calls += ev.forwarded
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
    assert calls == req.nfe  # `forwarded` marks each step that counted a forward
    if spec.startswith("freedave"):
        assert drafted > 0  # FreeDave accepted drafts past the rule's own step
    if "early_exit" not in spec and spec != "fast":
        assert req.decided == 32  # every position was decided by a forward


def test_forwarded_events_add_up_to_nfe_on_the_embedded_model() -> None:
    """A FreeDave row whose accepted draft needed no forward (its last step) counted one in NFE
    while its event said `forwarded` False: summing the events undercounted NFE."""
    from unmask import LLM

    llm = LLM()
    eng = Engine(llm.model)
    reqs = [eng.add_request(llm.encode_prompt(q), DecodeParams.parse(spec, gen_length=64))
            for q in ("What is 47 + 38?", "What is 12 + 9?") for spec in ("exact", "fast")]
    calls = dict.fromkeys((r.request_id for r in reqs), 0)
    while eng.has_unfinished:
        for ev in eng.step():
            calls[ev.request_id] += ev.forwarded
    assert calls == {r.request_id: r.nfe for r in reqs}


def test_tpf_counts_only_forward_decisions() -> None:
    """Early exit fills EOS without a forward: those positions do not count in `decided`."""
    from unmask import LLM

    llm = LLM()
    g = llm.generate(["What is 4 + 5?"], "threshold,early_exit=true", gen_length=256)[0]
    decided_by_forwards = g.tpf * g.nfe
    assert decided_by_forwards < 256  # the EOS tail was filled, not decided
    assert g.tpf == pytest.approx(decided_by_forwards / g.nfe)


# --- a step's order -------------------------------------------------------------------------------
ORDER_CASES = [(kind, spec) for kind in ("llada", "Dream") for spec in (
    "static-1", "static,steps=8", "threshold,threshold=0.5,early_exit=true", "static-1,cache=dual",
    "threshold,threshold=0.5,cache=entropy,entropy_tau=0.5,recent_k=2,refresh_on_block=true",
    "threshold,threshold=0.5,cache=prefix,suffix=structured,suffix_local=2,suffix_middle=3,"
    "suffix_tail=2,suffix_rule=grid,inject=0.5")] + [
    ("sdar", "static-1,early_exit=true"), ("sdar", "threshold,threshold=0.5"),
    ("Fast_dLLM_Qwen", "threshold,threshold=0.5"), ("llada2_moe", "static-1")]


@pytest.mark.parametrize(("kind", "spec"), ORDER_CASES)
def test_either_step_order_decodes_alike(kind: str, spec: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward-then-commit (a plain decoder on the CPU) gives what commit-then-forward gives
    (FreeDave's order and the device rule's, forced here on the CPU): tokens, NFE,
    token-forwards, decisions and finish, with rows joining and leaving a batch of two."""
    m = model(kind)
    block = BLOCK_FAMILIES.get(kind, {}).get("block_size", 8)
    p = DecodeParams.parse(spec, gen_length=16, block_length=block)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15], [16, 17, 18]]

    def run() -> tuple[list[tuple], int]:
        eng = engine(m, max_running=2)
        reqs = [eng.add_request(x, p) for x in prompts]
        eng.run()
        return [outcome(r) for r in reqs], sum(r.steps for r in reqs)

    forward_first, steps = run()
    monkeypatch.setattr(HostCommit, "reads_at_once", False)
    commit_first, steps_commit_first = run()
    assert forward_first == commit_first
    assert steps < steps_commit_first  # the orders did differ


# --- scheduling -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "spec", "calls"), [
    ("llada", "static-1", 1), ("sdar", "static-1", 1), ("sdar", "threshold", 1),
    ("llada", "fast", 2), ("sdar", "exact", 2)])
def test_a_joining_request_commits_in_the_step_that_admits_it(family: str, spec: str,
                                                              calls: int) -> None:
    """A request admitted beside rows already decoding commits its first token in the step that
    admits it, with the tokens it decodes alone: a plain decoder forwards it in the batch's own
    call, then commits from that call's scores (the forward-first order); FreeDave, whose
    drafts are committed before the forward that verifies them, forwards it alone first, in one
    more call (Decoder._prime)."""
    m = tiny_model(family, vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS)
    params = DecodeParams.parse(spec, gen_length=8, block_length=4)
    alone = decode(m, params, [[8, 9, 10]])[0]
    eng = engine(m)
    eng.add_request([5, 6, 7, 11, 12], params)
    eng.step(), eng.step()
    before = eng.model_calls
    joined = eng.add_request([8, 9, 10], params)
    first = next(ev for ev in eng.step() if ev.request_id == joined.request_id)
    assert first.forwarded and len(first.positions) >= 1
    assert eng.model_calls == before + calls
    eng.run()
    assert joined.token_ids == alone.token_ids and joined.nfe == alone.nfe


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_a_plain_decoders_first_step_commits(family: str) -> None:
    """Into an empty batch too: a plain decoder's first step forwards the canvas and commits
    from that forward, so the first event has tokens and a request takes as many steps as
    model calls (the last commit needs no forward after it)."""
    m = tiny_model(family, vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS)
    eng = engine(m)
    req = eng.add_request([8, 9, 10], DecodeParams.parse("static-1", gen_length=8,
                                                         block_length=4))
    events = []
    while eng.has_unfinished:
        events += eng.step()
    assert len(events[0].positions) == 1 and events[0].forwarded and events[0].nfe == 1
    assert sum(len(e.positions) for e in events) == 8
    assert req.steps == req.nfe == eng.model_calls == len(events) >= 8
    assert events[-1].finished == req.finish_reason


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
    # its first forward and first commit in the step that admits it, then one commit per step
    assert finished_at[short.request_id] == 5 + 64
    assert finished_at[long.request_id] == 1024
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
    """max_queue counts the requests that wait: 1 decoding + 1 waiting here, a third is refused."""
    eng = engine(model("llada"), max_running=1, max_queue=1)
    eng.add_request([5], params("static-1", 8))
    eng.add_request([6], params("static-1", 8))
    with pytest.raises(QueueFull):
        eng.add_request([7], params("static-1", 8))


def test_queue_limit_zero_still_serves_what_fits() -> None:
    """max_queue 0: what the next step admits is taken (it refused everything, since a request
    enters through the queue); what would have to wait is refused, by rows or by slots."""
    eng = engine(model("llada"), max_running=2, max_queue=0, max_slots=40)
    a = eng.add_request([5] * 4, params("static-1", 8))  # 12 slots
    with pytest.raises(QueueFull):  # with a: 2 rows x (4 + 32) = 72 > 40 slots
        eng.add_request([6], params("static-1", 32))
    b = eng.add_request([6], params("static-1", 8))  # 2 rows x 12 = 24 slots
    with pytest.raises(QueueFull):  # a third row
        eng.add_request([7], params("static-1", 8))
    eng.run()
    assert a.finish_reason in ("eos", "length") and b.finish_reason in ("eos", "length")
    c = eng.add_request([7], params("static-1", 8))  # the rows are free again
    eng.run()
    assert c.finish_reason in ("eos", "length")


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


def test_a_burst_takes_the_rows_of_the_last_one() -> None:
    """Rows leaving give the K/V pool no memory back while the batch has rows, and an empty
    batch keeps its pool: the next burst of requests takes its rows (no new pool, whose memory
    the kernel would fault in again), with the tokens each gets alone. Of two idle decoders,
    only the most recently used keeps its pool."""
    m = tiny_model("sdar", vocab_size=VOCAB, mask_token_id=MASK, eos_token_id=EOS)
    p = DecodeParams.parse("static-1", gen_length=8, block_length=4)
    prompts = [[5, 6, 7, 8, 9, 10][: 2 + i % 5] for i in range(6)]
    eng = engine(m)
    for prompt in prompts:
        eng.add_request(prompt, p)
    eng.run()
    (b,) = eng.batches.values()
    pool = b.store
    assert pool.shape[0] == len(prompts) and len(b) == 0
    again = [eng.add_request(prompt, p) for prompt in prompts[::-1]]
    eng.run()
    assert b.store is pool
    assert [r.token_ids for r in again] == [alone(m, p, q)[0] for q in prompts[::-1]]
    other = DecodeParams.parse("threshold", gen_length=8, block_length=4)
    eng.add_request(prompts[0], other)
    eng.run()
    assert b.store.shape == (0, 0)  # the other decoder was used since
    assert all(len(x) == 0 and x.S == 0 for x in eng.batches.values())


def test_abort_from_another_thread_during_a_step_waits_for_it() -> None:
    """An abort from another thread in the middle of a step shrank the batch under it: every
    other request of the batch failed ("operands could not be broadcast")."""
    import threading

    m = model("llada")
    eng = engine(m, max_running=8)
    reqs = [eng.add_request([5 + i, 6], params("static-1", 16)) for i in range(4)]
    inner, threads = m.forward, []

    def forward(*a, **k):
        if not threads:  # the first model call: abort the first request from another thread
            t = threading.Thread(target=eng.abort, args=(reqs[0].request_id,))
            threads.append(t)
            t.start()
            t.join(0.2)  # without the engine's lock, the abort lands inside this step
        return inner(*a, **k)

    m.forward = forward
    try:
        eng.step()
        threads[0].join()  # with the lock, the abort runs here: between steps
        eng.run()
    finally:
        del m.forward
    assert reqs[0].finish_reason == "abort"
    assert all(r.finish_reason in ("eos", "length") and r.error is None for r in reqs[1:])


def test_idle_decoders_are_bounded() -> None:
    """A server sees many specs: decoders without rows are kept for reuse, but only a few."""
    eng = engine(model("llada"))
    # suffix_local changes which positions a forward holds: a decoder each (a threshold no
    # longer would: it is a per-row knob)
    specs = [f"threshold,cache=dual,suffix=window,suffix_local={i + 1}"
             for i in range(eng.max_idle + 4)]
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
    with pytest.raises(InputError, match="list of token ids"):
        eng.add_request((t for t in [5, 6]), params("static-1"))  # type: ignore[arg-type]
    for bad in (torch.tensor([[5, 6]]), np.array([5.0, 6.0]), torch.tensor([True])):
        with pytest.raises(InputError, match="1-D of integers"):
            eng.add_request(bad, params("static-1"))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="vocabulary"):
        eng.add_request([True, 5], params("static-1"))  # True would be token 1
    with pytest.raises(InputError, match=f"mask token \\(id {MASK}\\) at position 1"):
        eng.add_request([5, MASK, 6], params("static-1"))  # was kept masked, never filled
    with pytest.raises(InputError, match="request_id must be a string"):
        eng.add_request([5], params("static-1"), request_id=5)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="reason"):
        eng.abort("x", reason="bogus")
    assert eng.requests["x"].status == "waiting"  # a refused abort changes nothing
    for bad in ({"max_running": True}, {"max_queue": True}, {"max_slots": False}):
        with pytest.raises(InputError, match="integer"):
            SchedulerConfig(**bad)


def test_token_ids_as_numpy_or_torch_integers() -> None:
    """A list of numpy integers was refused as if out of the vocabulary ("got np.int64(5)"), and
    a 1-D integer array or tensor as no list: each now decodes as the same list of ints."""
    m = model("llada")
    want = alone(m, params("threshold", 16), [5, 6, 7])
    for ids in ([np.int64(5), np.int32(6), 7], np.array([5, 6, 7]), torch.tensor([5, 6, 7]),
                np.array([5, 6, 7], dtype=np.uint16)):
        eng = engine(m)
        req = eng.add_request(ids, params("threshold", 16))
        assert req.prompt_ids == [5, 6, 7] and all(type(t) is int for t in req.prompt_ids)
        eng.run()
        assert outcome(req) == want


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


# --- batch invariance at the bit level: each row's call shape is its own ------------------------
# the weight formats a model call runs on the CPU (the fewest rows its products get follows them:
# unmask/engine/product_rows.py)
WEIGHTS = ["float32", "bfloat16", "bfloat16 packed", "int8 float32", "int8 bfloat16",
           "int4 bfloat16", "w8a8 bfloat16"]


@functools.cache
def wide_model(kind: str, weights: str):
    """A random model with the embedded model's head size (32) and GQA, so the kernels are the
    ones real calls use, its block weights in `weights` (packed where oneDNN can)."""
    from unmask.packing import pack_linears
    from unmask.quantize import quantize_model

    dtype = torch.bfloat16 if weights.endswith(("bfloat16", "packed")) else torch.float32
    m = tiny_model(kind, seed=1, d_model=128, n_heads=4, n_kv_heads=2, mlp_hidden_size=256,
                   std=0.1).to(dtype)
    if weights == "bfloat16 packed":
        pack_linears(m)
    elif weights.startswith(("int", "w8a8")):
        quantize_model(m, weights.split()[0])
    return m


def fresh_kv(fw, i: int) -> torch.Tensor:
    """(2L, H_kv, n, D) the fresh K/V of call row i's real tokens, in order."""
    toks = np.flatnonzero(fw.ok[i])
    if fw.kv_at is None:
        return torch.stack([t[i][:, toks] for kv in fw.kv for t in kv])
    return torch.stack([t[0][:, fw.kv_at[i, toks]] for kv in fw.kv for t in kv])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["llada", "Dream", "sdar"]),
       weights=st.sampled_from(WEIGHTS),
       rows=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 150), st.integers(0, 2**31)),
                     min_size=2, max_size=6),
       inject=st.booleans(), pack_all=st.sampled_from([0.0, 0.1, 2.0]),
       pack_one=st.sampled_from([0.0, 0.1, 2.0]))
def test_a_rows_scores_and_kv_do_not_depend_on_the_call(kind, weights, rows, inject, pack_all,
                                                       pack_one) -> None:
    """One model call of several rows vs each row alone: every row's token, confidence, entropy
    and fresh K/V are the same bits, packed or not, for any mix of forwarded tokens and stored
    keys, in every weight format (the kernels round with the call's shapes; a row's shape is its
    own, `shape_groups`, and its products get the rows their kind needs)."""
    from unmask.decoding.params import row_knobs
    from unmask.engine import runner as runner_mod
    from unmask.kv import KVStore
    from unmask.suffix import make_suffix_policy

    m = wide_model(kind, weights)
    c = m.config
    dtype = next(m.parameters()).dtype
    spec = "threshold,cache=entropy" + (",suffix=structured,suffix_local=2,suffix_tail=2,inject=0.5"
                                        if inject else "")
    p = params(spec, 32)
    run = runner_mod.Runner(m, p, c.mask_token_id, c.eos_token_id, make_suffix_policy(p))
    r = len(rows)
    s = max(a + k for a, k, _ in rows) + 3
    x = np.zeros((r, s), dtype=np.int64)
    pad, start = np.zeros(r, dtype=np.int64), np.zeros(r, dtype=np.int64)
    visible, active = np.zeros((r, s), dtype=bool), np.zeros((r, s), dtype=bool)
    prev = np.zeros((r, s), dtype=np.int64)
    for i, (n_active, n_stored, seed) in enumerate(rows):
        g = np.random.default_rng(seed)
        pad[i] = s - n_active - n_stored
        visible[i, pad[i]:] = True
        active[i, pad[i] + g.choice(n_active + n_stored, n_active, replace=False)] = True
        x[i] = g.integers(3, c.vocab_size, s)
        x[i, g.random(s) < 0.3] = c.mask_token_id
        prev[i] = g.integers(3, c.vocab_size, s)
        start[i] = pad[i] + g.integers(0, n_active + n_stored)
    predict = active & (np.random.default_rng(r).random((r, s)) < 0.7)
    refresh = ~(visible & ~active).any(-1)
    store = KVStore.empty(c.n_layers, r, c.n_kv_heads, s, c.head_dim, dtype, torch.device("cpu"))
    store.kv.normal_(generator=torch.Generator().manual_seed(0))
    valid = visible & ~active

    def forward(sel: np.ndarray, pack: float):
        run.pack_min_padding = pack
        read = runner_mod.StoreRead(store, sel, pad[sel], valid[sel])
        with torch.no_grad():
            return run.forward(runner_mod.ForwardPlan(
                x[sel], pad[sel], visible[sel], active[sel], predict[sel], refresh[sel], read,
                prev[sel], None, start[sel], row_knobs([p] * sel.size)))

    together = forward(np.arange(r), pack_all)
    for i in range(r):
        one = forward(np.array([i]), pack_one)
        for name in ("token", "conf", "entropy", "fresh"):
            assert np.array_equal(getattr(together, name)[i], getattr(one, name)[0]), (name, i)
        assert torch.equal(fresh_kv(together, i), fresh_kv(one, 0)), ("kv", i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_of_one_shape_rounds_each_row_alike(dtype) -> None:
    """The machine's attention gives a row the same bits in any batch of rows of its exact
    shape, and with an all-True mask the bits of no mask (the plain forward's): the runner's
    exact shapes rely on both (if this fails on a machine, attention must run row by row)."""
    g = torch.Generator().manual_seed(0)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for t, k in ((1, 0), (13, 0), (100, 0), (283, 0), (5, 40), (29, 150)):
        q = torch.randn(16, 4, t, 32, generator=g).to(dtype)
        kv = [torch.randn(16, 2, t + k, 32, generator=g).to(dtype) for _ in range(2)]
        every = sdpa(q, *kv, enable_gqa=True)
        keys = torch.ones(16, 1, 1, t + k, dtype=torch.bool)
        assert torch.equal(sdpa(q, *kv, attn_mask=keys, enable_gqa=True), every), (t, k)
        for size, at in ((1, 0), (1, 9), (3, 2), (16, 0)):
            part = sdpa(q[at : at + size], *(x[at : at + size] for x in kv), enable_gqa=True)
            assert torch.equal(part, every[at : at + size]), (t, k, size, at)


def test_canonical_shapes() -> None:
    from unmask.engine.runner import canonical_keys, canonical_tokens, shape_groups

    n = np.arange(0, 5000)
    t, k = canonical_tokens(n), canonical_keys(n)
    assert (t >= n).all() and (t % 16 == 0).all() and (t[1:] - n[1:] < 16).all() and t[0] == 16
    assert (k >= n).all() and k[0] == 0 and (np.diff(k) >= 0).all()
    assert (k[n > 64] <= 1.5 * n[n > 64]).all()  # at most a third of the padded keys are padding
    assert k[[1, 16, 17, 64, 65, 96, 97, 128, 129, 192, 193]].tolist() == \
        [16, 16, 32, 64, 96, 96, 128, 128, 192, 192, 256]
    assert len(np.unique(k)) < 40  # rows of similar contexts share a shape
    groups = shape_groups(np.array([16, 32, 16, 16, 32]), np.array([64, 0, 64, 96, 0]))
    assert [g.tolist() for g in groups] == [[0, 2], [3], [1, 4]]
    assert [g.tolist() for g in shape_groups(np.array([16, 16]), np.array([0, 0]))] == [[0, 1]]


def test_packing_is_for_the_padding_it_saves() -> None:
    """A call goes packed when packing saves >= 10% of its padded places: a row of at most
    the minimum of rows (here 16) saves none (its products run on that many rows either way),
    so it runs padded, without the gathers."""
    from unmask.engine.product_rows import ProductRows
    from unmask.engine.runner import Runner

    runner = Runner.__new__(Runner)
    runner._rows = (torch.get_num_threads(), ProductRows(16, 16))  # what `Runner.rows` reads
    unpacked = runner.unpacked  # (n_groups, rows, places a row, real tokens)
    assert unpacked(1, 1, 16, 1) and unpacked(1, 1, 16, 16)
    assert not unpacked(1, 1, 32, 20) and unpacked(1, 1, 32, 29)
    assert not unpacked(1, 2, 16, 20) and unpacked(1, 2, 16, 30)
    assert not unpacked(2, 1, 16, 16)  # several shape groups: always packed


@pytest.mark.parametrize("spec", ["threshold,cache=entropy,entropy_tau=0.5", "fast",
                                  "freedave,cache=dual", "threshold,suffix=structured,inject=0.5"])
def test_shape_groups_in_any_order_change_nothing(spec: str, monkeypatch) -> None:
    """A call's rows attending in more groups (each of one shape), out of the call's row order,
    give what the shape groups give: tokens, NFE, token-forwards and the stored K/V."""
    from unmask.engine import runner as runner_mod

    m = model("Dream" if "inject" in spec else "llada")
    # rows of one length share a shape at least in their first call
    prompts = [[5, 6, 7], [8] * 9, [9, 10, 11], [11, 12, 13, 14], [3, 3, 3], [4, 4, 4, 4, 4, 4]]
    p = params(spec, 32)
    one = [outcome(r) for r in decode(m, p, prompts, mask_id=MASK, eos_id=EOS)]
    inner, split = runner_mod.shape_groups, []

    def halves(t_hat, k_hat):  # each group's later rows first, as a group of its own
        groups, out = inner(t_hat, k_hat), []
        for g in groups[::-1]:
            g = g[::-1].copy()
            out += [g[: g.size // 2], g[g.size // 2 :]] if g.size >= 2 else [g]
        split.append(len(out) > len(groups))
        return out

    monkeypatch.setattr(runner_mod, "shape_groups", halves)
    two = [outcome(r) for r in decode(m, p, prompts, mask_id=MASK, eos_id=EOS)]
    assert any(split) and two == one


@pytest.mark.parametrize("spec", ["threshold,cache=entropy,entropy_tau=0.5", "fast",
                                  "freedave,cache=dual", "threshold,suffix=structured,inject=0.5"])
@pytest.mark.parametrize("shapes", ["exact", "canonical"])
def test_packed_model_calls_change_nothing(spec: str, shapes: str, monkeypatch) -> None:
    """Every call packed (its real tokens only) gives what padded rows give where one shape
    group allows them (prompts of one length: rows of one shape until their paths part)."""
    from unmask.engine import runner as runner_mod

    m = model("Dream" if "inject" in spec else "llada")
    prompts = [[5, 6, 7, 8], [8] * 4, [9, 10, 3, 3], [11, 12, 13, 14], [3] * 4, [4, 5, 4, 4]]
    p = params(spec, 32)
    monkeypatch.setattr(runner_mod.Runner, "attention_shapes", shapes)
    packed = []
    inner = m.forward

    def spy(*args, frame=None, **kwargs):
        packed.append(frame.packed)
        return inner(*args, frame=frame, **kwargs)

    monkeypatch.setattr(m, "forward", spy)
    monkeypatch.setattr(runner_mod.Runner, "pack_min_padding", 0.0)  # always
    on = [outcome(r) for r in decode(m, p, prompts, mask_id=MASK, eos_id=EOS)]
    assert all(packed)
    packed.clear()
    monkeypatch.setattr(runner_mod.Runner, "pack_min_padding", 2.0)  # only for several groups
    off = [outcome(r) for r in decode(m, p, prompts, mask_id=MASK, eos_id=EOS)]
    assert not all(packed)
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
    a step reads back only its model call's scores (token, confidence and entropy in one copy,
    unmask.syncs.to_host), never one per row or per draft (tests/test_host_syncs.py counts
    each preset)."""
    from unmask.engine import runner as runner_mod
    from unmask.syncs import SyncCounter

    per_call = {}
    for bs in (1, 8):
        eng = engine(model("llada"), max_running=bs)
        for i in range(bs):
            eng.add_request([5 + i, 6, 7], params(spec, 32))
        eng.step()
        calls = []
        with monkeypatch.context() as mp:
            mp.setattr(runner_mod, "score", counted_call(runner_mod.score, calls))
            with SyncCounter(cpu_is_device=True).counting() as c:
                for _ in range(4):
                    eng.step()
        assert calls
        per_call[bs] = dict(c.counts), len(calls)
        assert c.counts == {"to_host": len(calls)}, per_call  # the scores, nothing else


@pytest.mark.parametrize("spec", ["threshold,threshold=0.5", "fast"])
def test_a_request_is_the_source_of_its_metrics(spec: str) -> None:
    """Useful tokens (up to the first EOS), TPF and TPS come from the request, once (the API's
    Generation copies them)."""
    m = model("llada")
    for r in decode(m, params(spec, 32), [[5, 6, 7], [9] * 6], mask_id=MASK, eos_id=EOS):
        ids = r.token_ids
        assert r.useful == (ids.index(EOS) if EOS in ids else len(ids))
        assert r.nfe > 0 and r.tpf == r.decided / r.nfe
        assert r.seconds > 0 and r.tps == r.useful / r.seconds


# --- attention over exactly each row's keys: an engine call is the plain forward of its canvas ----
def plain_forward_spy(m, monkeypatch) -> list[tuple[int, int]]:
    """Spy on the runner's model calls: each scored position's logits must be the bits of the
    plain forward (no frame, batch 1: the reference's forward) of its row's forwarded tokens.
    Returns (rows, calls) seen, so a test knows it checked something."""
    from unmask.engine import runner as runner_mod

    inner, seen = runner_mod.Runner._call, []

    def spy(self, ids, pos, ok, n_tokens, t_hat, embeds, past, blocks, rows, cols, *rest):
        out = inner(self, ids, pos, ok, n_tokens, t_hat, embeds, past, blocks, rows, cols, *rest)
        assert past is None and embeds is None  # the plain forward has neither
        for i in np.unique(rows):
            n = int(ok[i].sum())
            with torch.no_grad():
                ref = m(ids[i : i + 1, :n], pos[i : i + 1, :n])[0]  # (n, V)
            mine = rows == i
            assert torch.equal(out[0][torch.from_numpy(mine)], ref[torch.from_numpy(cols[mine])]), \
                (i, n, (out[0][torch.from_numpy(mine)].float()
                        - ref[torch.from_numpy(cols[mine])].float()).abs().max().item())
        seen.append((rows.size, ok.shape[0]))
        return out

    monkeypatch.setattr(runner_mod.Runner, "_call", spy)
    return seen


@pytest.mark.parametrize("kind", ["llada", "Dream"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16"], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", ["static-1", "threshold,threshold=0.5"])
def test_a_request_alone_gets_the_plain_forwards_bits(kind, weights, spec, monkeypatch) -> None:
    """Decoded alone without a cache, every model call's scores are bit for bit the plain
    forward's of the same canvas (the reference's: its attention has no padding key), in
    float32 and bfloat16. Canonical shapes (padded keys) fail this."""
    m = wide_model(kind, weights)
    seen = plain_forward_spy(m, monkeypatch)
    decode(m, params(spec, 16), [list(range(3, 24))], mask_id=m.config.mask_token_id,
           eos_id=m.config.eos_token_id)
    assert len(seen) >= 2


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["llada", "Dream"]),
       weights=st.sampled_from(WEIGHTS),
       lengths=st.lists(st.integers(1, 40), min_size=2, max_size=8),
       spec=st.sampled_from(["static-1", "threshold,threshold=0.5"]))
def test_rows_in_a_batch_get_the_plain_forwards_bits(kind, weights, lengths, spec) -> None:
    """Prompts of different lengths decoded together without a cache: every call's scores for
    every row are the plain forward's of that row's canvas alone, bit for bit, in every weight
    format."""
    with pytest.MonkeyPatch.context() as mp:
        m = wide_model(kind, weights)
        seen = plain_forward_spy(m, mp)
        prompts = [[3 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate(lengths)]
        decode(m, params(spec, 8), prompts, mask_id=m.config.mask_token_id,
               eos_id=m.config.eos_token_id)
    assert any(r > 1 for _, r in seen)


@pytest.mark.parametrize("cache, shapes", [("none", "exact"), ("prefix", "canonical"),
                                           ("dual", "canonical"), ("entropy", "canonical")])
def test_attention_shapes_follow_the_cache(cache: str, shapes: str, monkeypatch) -> None:
    """Exact shapes where a decode has a forward to match; a cache reading stale K/V has none,
    and runs at the canonical shapes (fewer attention batches a call). A runner's own setting
    wins."""
    from unmask.engine import runner as runner_mod
    from unmask.suffix import make_suffix_policy

    m = model("llada")
    p = params(f"threshold,cache={cache}", 16)
    assert runner_mod.Runner(m, p, MASK, EOS, make_suffix_policy(p)).shapes == shapes
    monkeypatch.setattr(runner_mod.Runner, "attention_shapes", "exact")
    assert runner_mod.Runner(m, p, MASK, EOS, make_suffix_policy(p)).shapes == "exact"
