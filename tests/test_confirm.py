"""The confirmation split (math-confirm, code-confirm) and the rule that picks the default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unmask.bench.strata import (
    GUARANTEES,
    Candidate,
    Rule,
    bucket_stats,
    choose_default,
    guarantee_of,
    underpowered,
)
from unmask.bench.tasks import load_task
from unmask.errors import InputError
from unmask.tasks import TASKS, strata
from unmask.tasks import code as code_task
from unmask.tasks import math as math_task

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
HARD = ("digits-4", "sum_list", "off-template")


def _committed_prompts() -> set[str]:
    """Every prompt of every committed benchmark's samples, the confirmation run's own aside."""
    out = set()
    for f in BENCHMARKS.rglob("*.jsonl"):
        if not f.name.startswith("confirm-"):
            out.update(json.loads(line)["prompt"] for line in f.read_text().splitlines() if line)
    return out


def test_confirm_math_is_disjoint_from_training_tuning_and_every_used_problem() -> None:
    confirm = strata.make_strata(200, buckets=strata.ALL_BUCKETS, split="confirm")
    prompts = [p.prompt for ps in confirm.values() for p in ps]
    assert len(set(prompts)) == len(prompts) == 200 * len(strata.ALL_BUCKETS)
    # never trained on: the training stream drops every held-out prompt
    assert all(math_task.is_heldout(p) for p in prompts)
    used = _committed_prompts() | strata.reserved_prompts()
    # the problems themselves, not the seeds: the tuning split at two seeds, well past what any
    # run drew, math's held-out split, lm-eval's set and every committed sample
    for seed in strata.RESERVED_SEEDS:
        used.update(p.prompt for _, p in strata.make_heldout(
            strata.RESERVE_PER_BUCKET * len(strata.ALL_BUCKETS), seed, strata.ALL_BUCKETS))
        used.update(p.prompt for p in math_task.make_split("heldout", strata.RESERVE_MATH, seed))
    assert not used & set(prompts)
    # and each problem sits in the bucket it is filed under
    for b in strata.BUCKETS:
        assert {strata.bucket_of(p) for p in confirm[b]} == {b}


def test_confirm_code_is_disjoint_from_every_tuning_draw() -> None:
    confirm = code_task.make_confirm()
    prompts = {c.prompt for c in confirm}
    held = {c.prompt for c in code_task.all_examples("heldout")}
    assert prompts <= held and len(prompts) >= 200
    for seed in (0, 1):
        assert not prompts & {c.prompt for c in code_task.make_split(
            "heldout", code_task.CONFIRM_RESERVE, seed)}
    assert not prompts & _committed_prompts()


def test_confirm_tasks_in_bench() -> None:
    bt = load_task("math-confirm:digits-4,off-template", 6)
    assert bt.stratified and bt.strata == ["digits-4", "off-template"]
    tuning = load_task("math-strata:digits-4,off-template", 6)
    assert not {e.prompt for e in bt.examples} & {e.prompt for e in tuning.examples}
    assert bt.check(bt.examples[0], bt.examples[0].meta.response)
    assert load_task("math-confirm", 10).strata == list(strata.BUCKETS)
    code = load_task("code-confirm", 3)
    assert code.metric == "parse_rate" and len(code.examples) == 3
    assert [e.prompt for e in code.examples] == [c.prompt for c in code_task.make_confirm(3)]
    for name in ("math-confirm", "code-confirm"):
        with pytest.raises(InputError, match="held-out split only"):
            TASKS[name].load("train", 2)
    with pytest.raises(InputError, match="unknown math-strata bucket"):
        load_task("math-confirm:digits-9", 2)


# --------------------------------------------------------------------------- the rule


def _cand(name: str, losses: dict[str, int], speed: float, guarantee: int = 0,
          n: int = 200) -> Candidate:
    """A candidate that loses ``losses[b]`` problems net on bucket b of n (no wins)."""
    st = {}
    for b, lost in losses.items():
        base = [True] * (n // 2) + [False] * (n - n // 2)
        mine = [False] * lost + base[lost:]
        st[b] = bucket_stats(mine, base)
    return Candidate(name, st, speed, guarantee)


BUCKETS = ("digits-4", "code")


def test_rule_picks_the_fastest_that_passes() -> None:
    cands = [_cand("lossy", {"digits-4": 8, "code": 0}, 30.0),
             _cand("ok", {"digits-4": 0, "code": 0}, 20.0),
             _cand("slow", {"digits-4": 0, "code": 0}, 10.0, guarantee=2)]
    chosen, verdicts = choose_default(cands, BUCKETS)
    assert chosen is not None and chosen.name == "ok"
    assert verdicts["lossy"].startswith("out:") and "digits-4" in verdicts["lossy"]
    assert "more than 1.3x slower" in verdicts["slow"]


def test_rule_prefers_the_stronger_guarantee_within_its_speed_margin() -> None:
    cands = [_cand("cache", {"digits-4": 0, "code": 0}, 25.0, guarantee=0),
             _cand("no-cache", {"digits-4": 0, "code": 0}, 20.0, guarantee=1)]
    chosen, _ = choose_default(cands, BUCKETS)
    assert chosen.name == "no-cache"  # 25 / 20 = 1.25x: within 1.3x
    chosen, _ = choose_default(cands, BUCKETS, Rule(within=1.2))
    assert chosen.name == "cache"


def test_rule_reads_every_bucket_and_the_interval_not_the_point() -> None:
    # two problems lost of 200 is -1 point, but the interval's lower bound is below -2
    one = _cand("one", {"digits-4": 2, "code": 0}, 20.0)
    assert one.strata["digits-4"]["delta"] > -0.02 > one.strata["digits-4"]["delta_lo"]
    assert choose_default([one], BUCKETS) == (None, {"one": "out: lower bound below -2 on digits-4"})
    same = _cand("same", {"digits-4": 0, "code": 0}, 20.0)
    assert choose_default([same], BUCKETS)[0] is same
    # code loses: out, though the math bucket is clean
    assert choose_default([_cand("c", {"digits-4": 0, "code": 9}, 20.0)], BUCKETS)[0] is None
    # a looser floor takes it
    assert choose_default([one], BUCKETS, Rule(floor=-0.05))[0] is one


def test_underpowered_buckets() -> None:
    # a decoder identical to the baseline passes -2 points at 200 problems, not at 60
    big, small = _cand("b", {"digits-4": 0, "code": 0}, 1.0), _cand("s", {"digits-4": 0}, 1.0, n=60)
    assert underpowered(big.strata, BUCKETS) == []
    assert underpowered(small.strata, ["digits-4"]) == ["digits-4"]
    assert underpowered(small.strata, ["digits-4"], Rule(floor=-0.1)) == []


def test_rule_and_candidate_validate() -> None:
    with pytest.raises(ValueError, match="floor"):
        Rule(floor=0.02)
    with pytest.raises(ValueError, match="within"):
        Rule(within=0.9)
    with pytest.raises(ValueError, match="guarantee"):
        Candidate("x", {}, 1.0, len(GUARANTEES))


@pytest.mark.parametrize(("spec", "level"), [
    ("static-1,early_exit=true", "lossless"),
    ("exact", "lossless"),
    ("threshold,threshold=0.99,early_exit=true", "no approximate cache"),
    ("freedave++,threshold=0.99,draft_conf=0.9", "no approximate cache"),
    ("balanced", "approximate cache"),
    ("fast", "approximate cache"),
    ("threshold,suffix=structured", "approximate cache"),
])
def test_guarantee_of(spec: str, level: str) -> None:
    assert GUARANTEES[guarantee_of(spec)] == level


def test_the_default_is_what_the_committed_confirmation_run_chose(tmp_path) -> None:
    """The confirmation script, rerun on the committed rows, applies the rule with the baseline
    (lossless, static-1's tokens) among the candidates, and its choice is the package's
    default: changing DEFAULT_DECODER needs a confirmation run that picks the new one."""
    import shutil
    import subprocess
    import sys

    from unmask.decoding.params import DEFAULT_DECODER

    root = Path(__file__).resolve().parent.parent
    for f in (root / "benchmarks/strata").glob("confirm-256-lane*.jsonl"):
        shutil.copy(f, tmp_path)
    script = root / "scripts/bench/confirm_default.py"
    subprocess.run([sys.executable, str(script), "--report-only", "--out", str(tmp_path)],
                   check=True, capture_output=True, cwd=root)
    doc = json.loads((tmp_path / "confirm-256.json").read_text())
    assert doc["chosen"] == DEFAULT_DECODER == "static-1,early_exit=true"
    assert all(v.startswith("out:") for d, v in doc["verdicts"].items() if d != DEFAULT_DECODER)
