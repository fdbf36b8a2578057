"""Bench reports: machine description, the JSON document and the markdown table."""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from unmask.bench.markdown import aligned_table
from unmask.bench.strata import strata_tables

# (key, header, format) in table order; names and definitions: docs/design.md § Metrics.
COLUMNS: list[tuple[str, str, str]] = [
    ("accuracy", "accuracy", "pct"),
    ("exact_match", "exact-match", "pct"),
    ("exact_ref", "exact vs own ref", "pct"),
    ("nfe", "NFE", "{:.1f}"),
    ("tpf", "TPF", "{:.2f}"),
    ("token_forwards", "token-forwards", "{:.0f}"),
    ("cost_per_token", "cost/token", "{:.1f}"),
    ("tps", "TPS", "{:.1f}"),
    ("latency_p50", "p50 s", "{:.3f}"),
    ("latency_p95", "p95 s", "{:.3f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("speedup_ee", "vs static-1+EE", "{:.2f}x"),
]

METRIC_LABELS = {"accuracy": "accuracy", "parse_rate": "parse rate", "pass@1": "pass@1"}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device | str) -> dict[str, Any]:
    device = torch.device(device)
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        # Other processes skew CPU timings; the load average says how busy the machine was.
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def machine_line(m: dict[str, Any]) -> str:
    dev = m.get("gpu") or m["device"]
    return (f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, threads {m['threads']}, "
            f"device {dev}, Python {m['python']}, {m['date']}")


def machine_markdown(m: dict[str, Any]) -> str:
    """The machine section of BENCHMARKS.md, as a bullet list."""
    lines = [f"- CPU: {m['cpu']} ({m['cores']} cores)",
             f"- device: {m.get('gpu') or m['device']}",
             f"- torch {m['torch']}, {m['threads']} thread(s); Python {m['python']}",
             f"- date: {m['date']}"]
    if m.get("loadavg"):
        lines.append("- load average at the end of the run (1/5/15 min): "
                     + " / ".join(f"{x:.2f}" for x in m["loadavg"]))
    return "\n".join(lines)


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if fmt == "pct":
        return f"{100 * value:.1f}%"
    return fmt.format(value)


def markdown_table(results: Sequence[dict[str, Any]], metric: str = "accuracy") -> str:
    """Aligned GitHub markdown table, one row per decoder (the first is the baseline)."""
    headers = ["decoder", "n"] + [METRIC_LABELS.get(metric, metric) if key == "accuracy" else head
                                  for key, head, _ in COLUMNS]
    rows = [[f"`{r['decoder']}`", str(r["n"])] + [_cell(r.get(key), fmt) for key, _, fmt in COLUMNS]
            for r in results]
    return aligned_table(headers, rows, left={0})


def eval_summary_table(docs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One row per `unmask eval` JSON document (name, doc): the score with its count, so that
    sample size is never lost, and how much each answer wrote."""
    headers = ["file", "task", "gen_length", "decoder", "n", "score", "tokens per answer"]
    rows = []
    for name, doc in docs:
        label = METRIC_LABELS.get(doc["metric"], doc["metric"])
        for r in doc["results"]:
            rows.append([f"`{name}`", doc["task"], str(doc["gen_length"]), f"`{r['decoder']}`",
                         str(r["n"]), f"{label} {_cell(r['accuracy'], 'pct')} "
                         f"({round(r['accuracy'] * r['n'])}/{r['n']})",
                         _cell(r.get("useful_tokens"), "{:.1f}")])
    return aligned_table(headers, rows, left={0, 1, 3, 5})


def markdown_section(doc: dict[str, Any], command: str, metric: str = "accuracy") -> str:
    """A self-describing BENCHMARKS.md section: what ran, where, how to rerun, the table."""
    n = doc["results"][0]["n"] if doc["results"] else 0
    block = doc["block_length"]
    if block is None:  # decoders with different block lengths (each result records its own)
        block = "/".join(str(b) for b in sorted({r["block_length"] for r in doc["results"]}))
    head = f"### {doc['task']} — gen_length {doc['gen_length']}, block_length {block}, n {n}"
    meta = (f"Model `{doc['model']}`; machine: {machine_line(doc['machine'])}. "
            f"Baseline (speedup 1x, exact-match reference): `{doc['results'][0]['decoder']}`.")
    parts = [head, meta, f"Command: `{command}`", markdown_table(doc["results"], metric)]
    if doc["results"] and doc["results"][0].get("strata"):
        parts.append(strata_tables(doc["results"]))
    return "\n\n".join(parts) + "\n"
