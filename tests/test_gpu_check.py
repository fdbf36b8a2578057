"""scripts/gpu_check.py --tiny on the CPU: the GPU check runs every section and decode variant on
tiny shapes, so the command a GPU session runs once does not rot between such sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from unmask.engine import Engine  # noqa: F401  (the script drives it; fail here first if it moved)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def test_gpu_check_tiny_runs_every_cell(tmp_path: Path) -> None:
    variants = "eager,int8,int4,compile,graphs"
    out = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--out",
                          str(tmp_path), "--variants", variants, "--budget", "600",
                          "--sections", "norm,rule,logits,load,forward,decode"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = data["sections"]
    assert set(sections) == {"norm", "rule", "logits", "forward", "decode", "load"}
    rows = [r for rs in sections.values() for r in rs]
    assert not [r for r in rows if "error" in r]
    # every cell ran but the graphs variant (every model's), which says why not
    skipped = {(r["model"], r["variant"]): r["skipped"] for r in rows if "skipped" in r}
    assert set(skipped) == {("llada", "graphs"), ("dream", "graphs"), ("sdar", "graphs")}
    for family in ("llada", "dream", "sdar"):  # bidirectional ones too: only CUDA is missing
        assert "need a CUDA device; this run is on cpu" in skipped[family, "graphs"]
    # the norm computes the references' formula (on the CPU through the fused op, which gives it)
    assert {(r["RMSNorm is the formula"], r["kernel"]) for r in sections["norm"]} == {
        (True, "fused_rms")}
    # the commit rule as tensors: the host's commits, no device read
    assert len(sections["rule"]) == 6
    assert all(r["same commits"] and r["device reads"] == 0 and r["device us"] > 0
               for r in sections["rule"])
    # bf16 against fp32 of the same weights: close, not equal
    for r in sections["logits"]:
        assert 0 < r["max |diff|"] < 0.1 and not r["bit-identical"]
    forward = {(r["model"], r["rows"], r["width"]) for r in sections["forward"]}
    assert forward == {(m, n, w) for m in ("llada", "dream", "sdar") for n in (1, 2) for w in (32, 64)}
    runs = [r for r in sections["decode"] if "skipped" not in r and "batch invariance" not in r]
    decoded = {(r["model"], r["variant"], r["decoder"], r.get("batch")) for r in runs}
    for v in variants.split(",")[:-1]:
        for spec in ("static-1", "threshold", "exact", "balanced", "fast"):
            assert ("llada", v, spec, 2) in decoded
    for spec in ("threshold", "fast"):
        assert ("llada", "eager", spec, 4) in decoded
    assert {("sdar", "eager", "threshold", b) for b in (1, 2, 4)} <= decoded
    for r in runs:
        if not r["decoder"].startswith("(warm-up"):
            assert r["nfe"] >= 1 and r["canvas tok/s"] > 0 and r["host ms/step"] >= 0
            assert r["floor ms"] > 0 and r["x floor"] > 0
            # the scores are read once a step (tests/test_host_syncs.py pins each decoder's count)
            assert 0 < r["host syncs/step"] <= 1
            assert r["rule on"] == "host"  # the CPU keeps the numpy rule
    invariance = [r for r in sections["decode"] if "batch invariance" in r]
    assert {(r["model"], r["variant"], r["decoder"]) for r in invariance} >= {
        ("llada", "eager", "threshold"), ("llada", "eager", "fast"), ("sdar", "eager", "threshold")}
    assert {r["batch invariance"] for r in invariance if r["variant"] == "eager"} == {"identical"}
    assert data["meta"]["copy GB/s"] > 0
    assert sections["load"][0]["load s"] > 0
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## decode" in md and "| llada | eager | fast | 2 |" in md


@pytest.mark.parametrize(("family", "spec"), [("sdar", "threshold"), ("llada", "threshold"),
                                              ("llada", "fast"), ("dream", "threshold")])
def test_the_graphs_cells_measure_bucket_calls_and_compare_tokens(family: str, spec: str,
                                                                   monkeypatch) -> None:
    """The graphs variant's decode, on the CPU with the capture replaced by the stand-in of
    tests/test_buckets_replay.py (a GPU runs the real one): bucket calls timed, the same tokens
    as the eager cell, for the block-causal and the bidirectional families."""
    import torch
    from test_buckets_replay import replaying

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check

    from unmask.engine import graphs as graphs_mod
    from unmask.engine import runner as runner_mod

    monkeypatch.setattr(graphs_mod, "unsupported", lambda model: None)
    monkeypatch.setattr(runner_mod, "capturer", lambda: replaying)
    sz, cpu = gpu_check.Sizes.of(True), torch.device("cpu")
    model, _ = gpu_check.variant_model(family, "eager", cpu, sz, True)
    eager, eager_tokens = gpu_check.run_decode(model, spec, 2, sz, cpu)
    graphs, graphs_tokens = gpu_check.run_decode(model, spec, 2, sz, cpu, graphs=True)
    assert graphs_tokens == eager_tokens
    assert graphs["model ms/call"] > 0 and graphs["nfe"] == eager["nfe"]
    assert graphs["graphs"] == 0 and graphs["capture s"] == 0  # the stand-in captures nothing
    assert model.forward.__func__ is type(model).forward  # the timers are gone
