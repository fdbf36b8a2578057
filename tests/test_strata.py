"""math-strata (held-out problems by difficulty) and the per-bucket reports of bench/eval."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
from test_bench import TINY, tiny_model  # noqa: F401  (the fixture, shared by name)

from unmask.bench.strata import (
    bucket_stats,
    delta_cell,
    mcnemar_exact,
    paired_difference,
    strata_tables,
    stratify,
    wilson,
)
from unmask.bench.tasks import load_task
from unmask.cli import main
from unmask.errors import InputError
from unmask.tasks import TASKS, strata
from unmask.tasks import math as math_task

# ----------------------------------------------------------------------------- the task


def test_buckets_are_balanced_interleaved_and_heldout() -> None:
    rows = strata.make_heldout(60, seed=0)
    assert [b for b, _ in rows[:5]] == list(strata.BUCKETS)
    for b in strata.BUCKETS:
        assert sum(1 for x, _ in rows if x == b) == 12
    for b, p in rows:
        assert math_task.is_heldout(p.prompt)  # the training stream drops exactly these
        assert strata.bucket_of(p) == b
        assert math_task.check(p.response, p.answer)
    assert len({p.prompt for _, p in rows}) == len(rows)


def test_bucket_digits_match_the_operands() -> None:
    for b, p in strata.make_heldout(100, seed=3):
        if b.startswith("digits"):
            nums = [int(x) for x in re.findall(r"\d+", p.prompt)]
            top = max(len(str(x)) for x in nums)
            assert (top <= 2) if b == "digits-1-2" else top == int(b[-1])
            assert p.family in ("add", "sub", "word")
        else:
            assert p.family == b


def test_prefixes_are_stable_and_seeds_differ() -> None:
    small, big = strata.make_heldout(10, seed=0), strata.make_heldout(40, seed=0)
    # per bucket, the first problems do not depend on how many are asked for
    for b in strata.BUCKETS:
        s = [p.prompt for x, p in small if x == b]
        assert s == [p.prompt for x, p in big if x == b][: len(s)]
    other = strata.make_heldout(10, seed=1)
    assert [p.prompt for _, p in other] != [p.prompt for _, p in small]


def test_no_strata_problem_in_the_training_stream() -> None:
    held = {p.prompt for _, p in strata.make_heldout(100)}
    for i, p in enumerate(math_task.iter_split("train", seed=0)):
        assert p.prompt not in held
        if i >= 20_000:
            break


def test_bucket_of_covers_every_family() -> None:
    rng = random.Random(0)
    for _ in range(500):
        p = math_task.generate_problem(rng)
        assert strata.bucket_of(p) in strata.BUCKETS


def test_task_registry_and_bench_task() -> None:
    exs = TASKS["math-strata"].load("heldout", 10)
    assert [e.stratum for e in exs[:5]] == list(strata.BUCKETS)
    with pytest.raises(InputError):
        TASKS["math-strata"].load("train", 10)
    bt = load_task("math-strata", 10)
    assert bt.stratified and bt.strata == list(strata.BUCKETS)
    assert bt.check(bt.examples[0], exs[0].response)
    plain = load_task("math", 20)
    assert not plain.stratified and all(e.stratum for e in plain.examples)
    assert load_task("math", 20, stratify=True).stratified
    with pytest.raises(InputError, match="--stratify"):
        load_task("code", 2, stratify=True)


# The first two problems of each default bucket at seed 0: the committed tables
# (benchmarks/strata/) were measured on these lists, so a change to a bucket's stream shows here.
FIRST_PROMPTS = {
    "digits-1-2": ["Ivan has 59 stickers and buys 79 more. How many stickers does Ivan have now?",
                   "Leo has 5 cookies and buys 73 more. How many cookies does Leo have now?"],
    "digits-3": ["What is 446 + 185?", "What is 306 - 30?"],
    "digits-4": ["Add 5611 and 7.", "What is the sum of 8185 and 4?"],
    "sum_list": ["Add up 7, 7, 9, 8, 2, 5.", "What is the total of 5, 3, 5, 7, 1, 7, 3?"],
    "sort": ["Sort 8, 8, 4 from smallest to largest.",
             "Put 6, 8, 0 in order from smallest to largest."],
}


def test_the_default_buckets_are_unchanged() -> None:
    rows = strata.make_heldout(10, seed=0)
    assert [b for b, _ in rows] == [*strata.BUCKETS] * 2  # the default interleave, 5 buckets
    got = {b: [p.prompt for x, p in rows if x == b] for b in strata.BUCKETS}
    assert got == FIRST_PROMPTS


def _training_patterns() -> list[re.Pattern[str]]:
    """Every training template of the families off-template re-words, as a regex."""
    fields = {"{a}": r"\d+", "{b}": r"\d+", "{xs}": r"\d(?:, \d)+"}
    out = []
    for t in (*math_task._ADD_TEMPLATES, *math_task._SUB_TEMPLATES, *math_task._SUM_TEMPLATES,
              *math_task._SORT_TEMPLATES):
        pattern = re.escape(t)
        for k, v in fields.items():
            pattern = pattern.replace(re.escape(k), v)
        out.append(re.compile(pattern))
    return out


def test_off_template_bucket() -> None:
    probs = strata.make_strata(60, seed=0, buckets=(strata.OFF_TEMPLATE,))[strata.OFF_TEMPLATE]
    training = _training_patterns()
    assert training[0].fullmatch("What is 47 + 38?")  # the patterns do match training prompts
    used = set()
    for p in probs:
        assert math_task.is_heldout(p.prompt) and math_task.check(p.response, p.answer)
        assert not any(t.fullmatch(p.prompt) for t in training), p.prompt
        nums = [int(x) for x in re.findall(r"\d+", p.prompt)]
        # the prompt asks what the worked solution answers
        want = {"add": str(sum(nums)), "sub": str(max(nums) - min(nums)),
                "sum_list": str(sum(nums)), "sort": ", ".join(map(str, sorted(nums)))}[p.family]
        assert p.answer == want, p.prompt
        used.add(p.family)
    assert used == set(strata.OFF_TEMPLATES)
    assert len({p.prompt for p in probs}) == len(probs)


def test_bucket_choice_keeps_each_buckets_problems() -> None:
    """A bucket's problems do not depend on which other buckets are asked for."""
    rows = strata.make_heldout(6, seed=0, buckets=("digits-4", strata.OFF_TEMPLATE))
    assert [b for b, _ in rows] == ["digits-4", strata.OFF_TEMPLATE] * 3
    assert [p.prompt for b, p in rows if b == "digits-4"][:2] == FIRST_PROMPTS["digits-4"]
    off = strata.make_strata(3, seed=0, buckets=(strata.OFF_TEMPLATE,))[strata.OFF_TEMPLATE]
    assert [p.prompt for b, p in rows if b == strata.OFF_TEMPLATE] == [p.prompt for p in off]


def test_bench_task_picks_buckets(capsys: pytest.CaptureFixture[str]) -> None:
    bt = load_task("math-strata:sum_list,off-template", 4)
    assert bt.name == "math-strata:sum_list,off-template" and bt.stratified
    assert bt.strata == ["sum_list", strata.OFF_TEMPLATE]
    assert bt.examples[0].prompt == FIRST_PROMPTS["sum_list"][0]
    assert bt.check(bt.examples[1], bt.examples[1].meta.response)
    assert load_task("math-strata:", 5).strata == list(strata.BUCKETS)
    with pytest.raises(InputError, match="unknown math-strata bucket 'digits-5'; valid: "):
        load_task("math-strata:digits-4,digits-5", 4)
    with pytest.raises(InputError, match="'sort' is named twice"):
        strata.parse_buckets("sort, sort")
    assert main(["bench", "--task", "math-strata:hard", "--decoder", "static-1"]) == 2
    err = capsys.readouterr().err
    assert "unknown math-strata bucket 'hard'" in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- statistics


def test_wilson_known_values() -> None:
    lo, hi = wilson(18, 48)
    # by hand: centre (0.375 + z²/96) / (1 + z²/48) = 0.3843, half-width 0.1321
    assert (round(lo, 4), round(hi, 4)) == (0.2522, 0.5164)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
    assert all(math.isnan(x) for x in wilson(0, 0))


def test_newcombe_paired_interval() -> None:
    theta, lo, hi = paired_difference(12, 9, 2, 21)
    assert theta == pytest.approx(7 / 44) and lo < theta < hi
    # swapping the two decoders mirrors the interval
    t2, lo2, hi2 = paired_difference(12, 2, 9, 21)
    assert (t2, lo2, hi2) == pytest.approx((-theta, -hi, -lo))
    # positively correlated answers (paired data) give a narrower interval than independence
    l1, u1 = wilson(21, 44)
    l2, u2 = wilson(14, 44)
    indep_lo = theta - math.sqrt((21 / 44 - l1) ** 2 + (u2 - 14 / 44) ** 2)
    assert lo > indep_lo
    theta, lo, hi = paired_difference(30, 0, 0, 10)  # identical answers
    assert theta == 0 and lo < 0 < hi


def test_mcnemar_exact() -> None:
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact(3, 3) == 1.0


def test_bucket_stats_and_tables() -> None:
    base = [True] * 8 + [False] * 2
    dec = [True] * 5 + [False] * 3 + [True, False]
    s = bucket_stats(dec, base, [2.0] * 10, [1.0] * 10)
    assert (s["won"], s["lost"], s["correct"]) == (1, 3, 6)
    assert s["delta"] == pytest.approx(-0.2) and s["speedup"] == 2.0
    assert not s["one_problem"]
    assert delta_cell(s).startswith("-20.0 (+1/-3)")
    assert bucket_stats([True, False], [True, True])["one_problem"]
    per = stratify(["x", "y", "x", "y"], [[True, True, False, True], [True, False, False, True]],
                   [[1, 1, 1, 1], [3, 3, 3, 3]])
    assert list(per[0]) == ["x", "y", "all"]
    assert per[1]["y"]["lost"] == 1 and per[1]["all"]["n"] == 4 and per[1]["x"]["speedup"] == 3
    results = [{"decoder": "static-1", "strata": per[0]}, {"decoder": "fast", "strata": per[1]}]
    text = strata_tables(results)
    assert "baseline" in text and "`fast`" in text and "x (n 2)" in text and "3.00x" in text


# ----------------------------------------------------------------------------- CLI, tiny model


def test_bench_and_eval_report_buckets(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       request: pytest.FixtureRequest) -> None:
    """End to end on test_bench's tiny random model: the tables, the JSON, the samples."""
    model = request.getfixturevalue("tiny_model")
    js, md, samples = tmp_path / "b.json", tmp_path / "b.md", tmp_path / "s.jsonl"
    rc = main(["bench", "--model", str(model), "--task", "math-strata", "--n", "10",
               "--decoder", "static-1", "--decoder", "threshold,threshold=0.5", *TINY,
               "--json", str(js), "--markdown", str(md), "--samples", str(samples)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Accuracy per bucket" in out and "digits-3 (n 2)" in out
    doc = json.loads(js.read_text())
    st = doc["results"][1]["strata"]
    assert list(st) == [*strata.BUCKETS, "all"] and st["all"]["n"] == 10
    assert {"accuracy_lo", "accuracy_hi", "won", "lost", "delta_lo", "delta_hi",
            "mcnemar_p"} <= st["sort"].keys()
    assert "Difference against `static-1`" in md.read_text()
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert rows[0]["stratum"] == "digits-1-2"

    rc = main(["eval", "--model", str(model), "--task", "math", "--stratify", "--n", "6",
               "--decoder", "static-1", *TINY])
    assert rc == 0
    out = capsys.readouterr().out
    assert "digits-1-2" in out and "[" in out
