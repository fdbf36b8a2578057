"""Data and scoring for the lm-eval tasks in unmask/eval_tasks (the YAMLs call these through the
folder's utils.py): the same prompts and checkers as ``unmask eval --task math|gsm8k:PATH``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unmask.bench.tasks import load_task
from unmask.errors import InputError
from unmask.evaluation import TASKS_DIR
from unmask.tasks import TASKS
from unmask.tasks import math as math_task

MATH_JSONL = TASKS_DIR / "unmask_math_heldout.jsonl"
MATH_N = 500  # what `unmask eval --task math` draws from when --n is not given


def write_math_jsonl(path: Path = MATH_JSONL, n: int = MATH_N) -> Path:
    """The first n held-out math problems (seed 0), in `unmask eval --task math`'s order: its
    --n N evaluates exactly the first N lines."""
    rows = [{"prompt": e.prompt, "answer": e.answer, "family": e.family}
            for e in TASKS["math"].load("heldout", n, seed=0)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _json_dataset(path: Path) -> Any:
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(path)})


def math_dataset(**_metadata: Any) -> Any:
    """custom_dataset of unmask_math: the shipped JSONL (its path is the package's, wherever
    that is installed, so the YAML cannot hold it)."""
    return _json_dataset(MATH_JSONL)


def gsm8k_dataset(gsm8k_path: str | None = None, **_metadata: Any) -> Any:
    """custom_dataset of unmask_gsm8k: the JSONL given with --metadata gsm8k_path=FILE."""
    if not gsm8k_path:
        raise InputError("unmask_gsm8k reads a local JSONL (question, answer with '#### N'): "
                         "pass --metadata gsm8k_path=/path/to/test.jsonl")
    path = Path(gsm8k_path).expanduser()
    if not path.is_file():
        raise InputError(f"gsm8k_path {path} " + ("is a folder; give a .jsonl file" if path.is_dir()
                                                  else "does not exist"))
    # The rows `unmask eval --task gsm8k:PATH` rejects (no question, no '#### N' the checker can
    # read) fail here too, instead of scoring every output as wrong.
    load_task(f"gsm8k:{path}", None)
    return _json_dataset(path)


def math_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"acc": float(math_task.check(results[0], doc["answer"]))}


def gsm8k_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    # The same reader for the gold answer and the output: '1/2' is a half in both.
    want = math_task.parse_number(doc["answer"].split("####")[-1])
    got = math_task.final_number(results[0])
    return {"exact_match": float(want is not None and got == want)}
