"""Joiners first (SchedulerConfig.joiners_first; docs/engine.md, "Joiners first"): requests that
join a batch already decoding take their first step alone, before the batch's next, where every
batch they join commits in a row's first step. What each request decodes does not change, only
when: the same events and tokens, request by request, with it on and off."""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import BLOCK_FAMILIES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_prefix_reuse import EOS, MASK, SPECS, model, params, tokens

from unmask.engine import Engine, SchedulerConfig
from unmask.engine.prefix_store import PrefixStore
from unmask.errors import InputError


def run(m, jobs, join_at: list[int], max_running: int, first: bool,
        store: PrefixStore | None = None) -> tuple[dict, list[set[int]], list[set[int]]]:
    """Jobs (prompt, spec, gen) joining at engine steps join_at. Returns each job's events that
    commit or finish (positions, tokens, finished) and outcome, and per engine step the jobs with events and
    the jobs running before it."""
    eng = Engine(m, SchedulerConfig(max_running=max_running, joiners_first=first), mask_id=MASK,
                 eos_id=EOS, prefix=store)
    reqs, events = {}, collections.defaultdict(list)
    stepped, running = [], []
    step = 0
    while len(reqs) < len(jobs) or eng.has_unfinished:
        before = {i for i, r in reqs.items() if r.status == "running"}
        for i, (prompt, spec, gen) in enumerate(jobs):
            if i not in reqs and join_at[i] <= step:
                reqs[i] = eng.add_request(prompt, params(spec, gen, i))
        label = {r.request_id: i for i, r in reqs.items()}
        evs = eng.step()
        step += 1
        for ev in evs:  # a step that committed nothing: when it comes is scheduling's
            # (FreeDave's first step commits nothing in an empty batch, and joining a decoding
            # one takes it in the batch's step: Decoder._prime)
            if ev.positions or ev.finished:
                events[label[ev.request_id]].append((ev.positions, ev.tokens, ev.finished))
        stepped.append({label[ev.request_id] for ev in evs})
        running.append(before)
        assert step < 600
    out = {i: (events[i], r.token_ids, r.nfe, r.decided, r.finish_reason)
           for i, r in reqs.items()}
    return out, stepped, running


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), family=st.sampled_from(list(BLOCK_FAMILIES)), n=st.integers(2, 10),
       max_running=st.integers(1, 10), stored=st.booleans())
def test_each_request_decodes_the_same_with_joiners_first(data, family, n, max_running,
                                                          stored) -> None:
    """Requests of any decoders (FreeDave's too, which never steps alone) joining at random
    steps, with and without the prefix store: every request's events, tokens, NFE and finish
    are the same with joiners first on and off."""
    m = model(family, torch.float32)
    shared = data.draw(st.lists(tokens, min_size=0, max_size=10))
    jobs = [(shared + data.draw(st.lists(tokens, min_size=1, max_size=6)),
             data.draw(st.sampled_from(SPECS)), data.draw(st.sampled_from([4, 8, 12])))
            for _ in range(n)]
    join_at = data.draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
    store = (lambda: PrefixStore(4, 1 << 30)) if stored else (lambda: None)
    off, _, _ = run(m, jobs, join_at, max_running, False, store())
    on, _, _ = run(m, jobs, join_at, max_running, True, store())
    assert on == off


def test_a_request_joining_a_decoding_batch_gets_its_first_tokens_in_a_step_of_its_own() -> None:
    """A joins alone; B joins at step 3: step 4 is B's alone (A has no event), then both step
    together. Off, B's first step is the batch's."""
    m = model("sdar", torch.float32)
    jobs = [([5, 6, 7, 8, 9], "static-1", 8), ([10, 11, 12], "static-1", 8)]
    on, stepped, running = run(m, jobs, [0, 3], 4, True)
    assert stepped[:5] == [{0}, {0}, {0}, {1}, {0, 1}] and running[3] == {0}
    off, stepped_off, _ = run(m, jobs, [0, 3], 4, False)
    assert stepped_off[3] == {0, 1} and on == off


def test_joiners_never_step_alone_twice_in_a_row() -> None:
    """A request joining at every step: the batch's running rows still take every other step
    (a stream of joins would otherwise starve them)."""
    m = model("sdar", torch.float32)
    jobs = [([5, 6, 7], "static-1", 12)] + [([9 + i, 4], "static-1", 4) for i in range(6)]
    _, stepped, _ = run(m, jobs, [0, 1, 2, 3, 4, 5, 6], 8, True)
    gaps = [i for i, s in enumerate(stepped[:8]) if 0 not in s]  # steps the first row sat out
    assert gaps and all(b - a > 1 for a, b in zip(gaps, gaps[1:], strict=False))


def test_a_decoder_that_commits_before_it_forwards_never_steps_joiners_alone() -> None:
    """FreeDave commits from the last forward's scores, so a row's first step commits nothing:
    its joiners take their first forward in the batch's step (Decoder._prime) as before."""
    m = model("sdar", torch.float32)
    jobs = [([5, 6, 7, 8, 9], "freedave,draft_steps=3", 8), ([10, 11, 12], "freedave,draft_steps=3", 8)]
    _, stepped, _ = run(m, jobs, [0, 2], 4, True)
    assert all(0 in s for s in stepped[:4])


def test_a_failing_step_of_joiners_fails_them_alone(monkeypatch) -> None:
    """A step of the joiners alone that raises fails its requests with an error event; the
    batch's other rows go on and finish."""
    m = model("sdar", torch.float32)
    eng = Engine(m, SchedulerConfig(max_running=4, joiners_first=True), mask_id=MASK, eos_id=EOS)
    a = eng.add_request([5, 6, 7, 8, 9], params("static-1", 8, 0))
    eng.step()
    b = eng.add_request([10, 11, 12], params("static-1", 8, 1))
    dec = next(iter(eng.decoders.values()))
    real = dec.step

    def fail(batch, trace=False):
        if len(batch) == 1 and batch.requests[0] is b:
            raise RuntimeError("boom")
        return real(batch, trace=trace)

    monkeypatch.setattr(dec, "step", fail)
    evs = eng.step()
    assert [(e.request_id, e.finished) for e in evs] == [(b.request_id, "error")]
    eng.run()
    assert b.finish_reason == "error" and a.finish_reason in ("eos", "length")


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_joiners_first_takes_a_bool(bad) -> None:
    with pytest.raises(InputError, match="joiners_first"):
        SchedulerConfig(joiners_first=bad)


def test_joiners_with_a_long_prefill_step_with_the_batch(monkeypatch) -> None:
    """A joiner whose first step forwards more prompt tokens than JOINERS_FIRST_TOKENS (here 6)
    steps with the batch: alone, its long prefill would stall the batch for about as long as it
    takes beside it; the same prompt held by the prefix store (8 of its 9 tokens read from it,
    one to forward) steps alone."""
    from unmask.engine import engine as engine_mod

    monkeypatch.setattr(engine_mod, "JOINERS_FIRST_TOKENS", 6)
    m = model("sdar", torch.float32)
    long = list(range(3, 12))  # 9 tokens: two whole blocks, the last token's block forwarded
    jobs = [([20, 21, 22], "static-1", 12), (long, "static-1", 8)]
    _, stepped, _ = run(m, jobs, [0, 3], 4, True)
    assert stepped[3] == {0, 1}  # 9 tokens to forward: with the batch
    store = PrefixStore(4, 1 << 30)
    run(m, [(long, "static-1", 4)], [0], 4, True, store)  # its blocks into the store
    _, stepped, _ = run(m, jobs, [0, 3], 4, True, store)
    assert stepped[3] == {1}  # one prompt token to forward: alone
