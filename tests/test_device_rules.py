"""The commit rules on the device (unmask/decoding/rules.py, unmask/decoding/methods.py): the
rules a step of the decoders people run takes (`static`, `static-1`, `threshold` with and
without its schedule's floor) give the same counts, ranks and commits on torch tensors as on
the host's numpy arrays, ties, -inf and NaN scores, per-row knobs and rows without a candidate
included; on tensors they read nothing from the device; and a decode whose every rule step runs
on tensors gives today's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import peaky_model

from unmask.decoding import methods
from unmask.decoding.methods import METHODS, BlockSchedule
from unmask.decoding.params import DecodeParams, row_knobs
from unmask.decoding.rules import candidate_ranks, rank, select_top
from unmask.engine import decode
from unmask.syncs import SyncCounter

VOCAB, MASK, EOS = 64, 63, 1
ON_DEVICE = [name for name, e in METHODS.items() if e.impl.on_device]


def _case(seed: int, r: int = 6, s: int = 12) -> tuple[np.ndarray, np.ndarray, BlockSchedule, np.ndarray]:
    """Scores with many ties (a few levels), -inf and NaN; candidates with an empty row; each
    row its own threshold and schedule."""
    g = np.random.default_rng(seed)
    conf = g.choice(np.array([0.2, 0.5, 0.9, 0.95, 1.0, -np.inf, np.nan], dtype=np.float32),
                    size=(r, s), p=[0.25, 0.2, 0.2, 0.15, 0.1, 0.05, 0.05])
    cand = g.random((r, s)) < 0.6
    cand[0] = False
    params = [DecodeParams.parse(f"threshold,threshold={t},steps=8", gen_length=32, block_length=8)
              for t in g.choice([0.5, 0.9, 0.95, 1.0], size=r)]
    schedule = BlockSchedule(g.integers(0, 9, r), g.integers(0, 4, r), g.integers(1, 5, r))
    return conf, cand, schedule, row_knobs(params)


def _tensors(conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule,
             knobs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, BlockSchedule, dict]:
    fields = (schedule.masked_at_start, schedule.step, schedule.steps_per_block)
    return (torch.from_numpy(conf), torch.from_numpy(cand),
            BlockSchedule(*(torch.from_numpy(f) for f in fields)),
            {k: torch.from_numpy(knobs[k].copy()) for k in knobs.dtype.names})


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("name", ON_DEVICE)
def test_a_rule_on_tensors_is_the_rule_on_arrays(name: str, seed: int) -> None:
    conf, cand, schedule, knobs = _case(seed)
    rule = METHODS[name].impl()
    conf_t, cand_t, schedule_t, knobs_t = _tensors(conf, cand, schedule, knobs)
    for sched, sched_t in ((schedule, schedule_t), (None, None)):
        if name == "static" and sched is None:
            continue  # static needs its schedule
        want = rule.count(conf, cand, sched, knobs)
        with SyncCounter(cpu_is_device=True).counting() as reads:
            n = rule.count(conf_t, cand_t, sched_t, knobs_t)
            ranks = candidate_ranks(conf_t, cand_t)
            sel = select_top(conf_t, cand_t, n)
        assert reads.total == 0
        assert n.dtype == torch.int64 and n.numpy().tolist() == want.tolist()
        assert ranks.numpy().tolist() == candidate_ranks(conf, cand).tolist()
        assert sel.numpy().tolist() == select_top(conf, cand, want).tolist()
    assert rank(conf_t).numpy().tolist() == rank(conf).tolist()


def test_the_rules_that_run_on_the_device_are_those_people_run() -> None:
    assert {"static", "static-1", "threshold", "freedave", "freedave++"} <= set(ON_DEVICE)


@pytest.mark.parametrize(("kind", "spec"), [
    ("sdar", "threshold,threshold=0.7"), ("sdar", "static-1"), ("sdar", "static,steps=8"),
    ("sdar", "threshold,threshold=0.8,steps=8"), ("llada", "threshold,threshold=0.7"),
    ("llada", "static,steps=8"), ("sdar", "freedave++,threshold=0.7")])
def test_a_decode_whose_rule_runs_on_tensors_gives_todays_tokens(kind: str, spec: str,
                                                                 monkeypatch) -> None:
    model = peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)
    params = DecodeParams.parse(spec, gen_length=16, block_length=4 if kind == "sdar" else 8)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10], [20]]

    def run() -> list[tuple[list[int], int]]:
        reqs = decode(model, params, prompts, mask_id=MASK, eos_id=EOS, max_running=4)
        return [(r.token_ids, r.nfe) for r in reqs]

    want = run()
    host_count = methods.Method.count
    calls = []

    def on_tensors(self, conf, cand, schedule, knobs, entropy):
        t = _tensors(conf, cand, schedule or BlockSchedule(*(np.zeros(len(conf), np.int64),) * 3),
                     knobs)
        calls.append(1)
        n = host_count(self, t[0], t[1], t[2] if schedule is not None else None, t[3],
                       torch.from_numpy(entropy))
        return n.numpy()

    monkeypatch.setattr(methods.Method, "count", on_tensors)
    assert run() == want
    assert calls
