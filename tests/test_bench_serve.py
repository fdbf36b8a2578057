"""`unmask bench-serve` against a live server (uvicorn on a background thread, embedded model)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from helpers import LiveServer

from unmask.api import LLM
from unmask.bench.serve import arrival_offsets, max_tokens_order, percentile, plan_cells
from unmask.cli import build_parser, main
from unmask.server.app import ServerConfig, build_app


@pytest.fixture(scope="module")
def url():
    with LiveServer(build_app(LLM(), ServerConfig(decoder="threshold", max_running=4))) as s:
        yield s.url


def _run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "report.json"
    assert main(["bench-serve", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _check_cell(cell: dict) -> None:
    reqs = cell["requests"]
    assert cell["completed"] == cell["n"] == len(reqs) and cell["errors"] == 0
    for name in ("latency", "ttft"):
        assert 0 < cell[f"{name}_p50"] <= cell[f"{name}_p95"] <= cell[f"{name}_p99"]
    assert cell["ttft_p99"] <= max(r["latency"] for r in reqs)
    assert all(0 < r["ttft"] <= r["latency"] for r in reqs)
    assert cell["useful_tokens"] == sum(r["completion_tokens"] for r in reqs) > 0
    assert cell["tokens_per_s"] == pytest.approx(cell["useful_tokens"] / cell["wall_s"])
    assert cell["req_per_s"] == pytest.approx(cell["n"] / cell["wall_s"])
    # A run's wall time ends with its last response (one run per round here).
    last = sum(max(r["sent"] + r["latency"] for r in reqs if r["round"] == k)
               for k in {r["round"] for r in reqs})
    assert last <= cell["wall_s"] <= last + 0.05


def test_small_run_is_consistent(url, tmp_path, capsys):
    doc = _run(tmp_path, "--url", url, "--n", "8", "--concurrency", "4", "--max-tokens", "32",
               "--decoder", "threshold", "--warmup", "1")
    (cell,) = doc["cells"]
    _check_cell(cell)
    assert cell["concurrency"] == 4 and cell["x_baseline"] == pytest.approx(1.0)
    assert "| `threshold` | 4 | 8 | 0 |" in capsys.readouterr().out
    # Useful tokens are what the server reports: the same prompts, not streamed, decode to the
    # same tokens (greedy, and batch invariant), so their usage sums to the same count.
    from unmask.bench.serve import load_prompts

    total = 0
    for prompt in load_prompts("math", 8, seed=0):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 32,
            "decoder": "threshold"})
        total += r.json()["usage"]["completion_tokens"]
    assert cell["useful_tokens"] == total


def test_mixed_lengths_and_decoders_report_each_group(url, tmp_path):
    doc = _run(tmp_path, "--url", f"a={url}", "--url", f"b={url}", "--n", "6",
               "--concurrency", "1,3", "--max-tokens", "32,64", "--decoder", "threshold",
               "--decoder", "fast", "--mix", "--warmup", "0", "--rounds", "2",
               "--endpoint", "completions")
    assert [(c["server"], c["concurrency"]) for c in doc["cells"]] == [
        ("a", 1), ("a", 3), ("b", 1), ("b", 3)]
    for cell in doc["cells"]:
        assert cell["n"] == 12  # 6 requests x 2 rounds, pooled
        assert sorted(r["round"] for r in cell["requests"]) == [0] * 6 + [1] * 6
        assert cell["completed"] == 12 and cell["errors"] == 0
        assert {k: g["completed"] for k, g in cell["by_max_tokens"].items()} == {"32": 6, "64": 6}
        assert {k: g["completed"] for k, g in cell["by_decoder"].items()} == {"fast": 6,
                                                                                "threshold": 6}
        assert sum(g["useful_tokens"] for g in cell["by_max_tokens"].values()) == \
            cell["useful_tokens"]
        assert cell["decoder"] == "threshold + fast" and cell["x_baseline"] is not None


def test_poisson_arrivals_are_seeded(url, tmp_path):
    a = arrival_offsets(50, 4.0, seed=7)
    assert a == arrival_offsets(50, 4.0, seed=7) != arrival_offsets(50, 4.0, seed=8)
    assert a[0] == 0 and a == sorted(a)
    gaps = np.diff(arrival_offsets(4000, 4.0, seed=1))
    assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.06)  # exponential gaps of mean 1/rate
    assert arrival_offsets(3, None, seed=0) == [0.0, 0.0, 0.0]

    doc = _run(tmp_path, "--url", url, "--n", "6", "--rate", "20", "--max-tokens", "32",
               "--seed", "7", "--warmup", "0")
    (cell,) = doc["cells"]
    _check_cell(cell)
    assert cell["concurrency"] is None
    reqs = sorted(cell["requests"], key=lambda r: r["index"])
    assert [r["offset"] for r in reqs] == arrival_offsets(6, 20.0, seed=7)
    assert all(r["sent"] >= r["offset"] for r in reqs)


def test_spec_gen_length_wins_over_the_default_max_tokens(url, tmp_path):
    """A spec that sets gen_length and no typed --max-tokens: the requests go without max_tokens
    (the server refuses a request's own spec with a max_tokens that disagrees) and the report
    records the spec's length."""
    doc = _run(tmp_path, "--url", url, "--n", "2", "--concurrency", "2",
               "--decoder", "threshold,gen_length=32", "--warmup", "1")
    (cell,) = doc["cells"]
    _check_cell(cell)
    assert [r["max_tokens"] for r in cell["requests"]] == [32, 32]
    assert "--max-tokens" not in doc["command"]  # typed, it would have to agree with every spec


def _plan(*argv: str):
    return plan_cells(build_parser().parse_args(["bench-serve", *argv]))


def test_typed_max_tokens_against_a_spec_gen_length():
    """Typed, --max-tokens is explicit: after the server's rounding up to block_length it must
    agree with a spec's gen_length; the default yields to it."""
    (cell,) = _plan("--decoder", "threshold,gen_length=64", "--max-tokens", "40")  # 40 -> 64
    assert cell.gen_lengths == (None,)  # sent, and the server takes it
    (cell,) = _plan("--decoder", "threshold,gen_length=64")
    assert cell.gen_lengths == (64,)
    cells = _plan("--decoder", "threshold,gen_length=64", "--decoder", "threshold")
    assert [c.gen_lengths for c in cells] == [(64,), (None,)]


@pytest.mark.parametrize("argv, needle", [
    (["--decoder", "threshold,gen_length=64", "--max-tokens", "32"],
     "--max-tokens 32 conflicts with gen_length=64 in --decoder 'threshold,gen_length=64': the "
     "server would refuse every request; drop --max-tokens"),
    (["--decoder", "threshold", "--decoder", "static-1,gen_length=64", "--max-tokens", "64,100"],
     "--max-tokens 100 (asks for gen_length 128 at block_length 32) conflicts with gen_length=64"),
    (["--decoder", "static,steps=4"], "--max-tokens 256 (the default) does not fit --decoder "
                                      "'static,steps=4': steps (4) must be in 1..256"),
], ids=["conflict", "conflict-after-rounding", "default-does-not-fit"])
def test_max_tokens_a_spec_refuses_is_refused_before_sending(argv, needle, capsys):
    """Nothing listens at the URL: the error comes before any request."""
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--n", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unmask: error: ") and err.count("\n") == 1 and needle in err, err


def test_helpers():
    xs = list(np.random.default_rng(0).random(37))
    for q in (0, 50, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert percentile([], 50) is None
    order = max_tokens_order(9, [32, 512], seed=0)
    assert sorted(order) == [32] * 5 + [512] * 4 and order == max_tokens_order(9, [32, 512], 0)


@pytest.mark.parametrize("argv", [
    ["--concurrency", "0"],
    ["--concurrency", "4,x"],
    ["--rate", "-1"],
    ["--n", "0"],
    ["--url", "ftp://127.0.0.1:8000"],
    ["--url", "a=http://x:1", "--url", "a=http://y:1"],
    ["--decoder", "nope"],
    ["--decoder", "fast", "--mix"],
    ["--json", "/nonexistent-folder/report.json"],
    ["--plot", "report.nosuchformat"],
    ["--warmup", "-1"],
    ["--url", "http://127.0.0.1:9"],  # nothing listens there
])
def test_bad_arguments_are_one_line_and_exit_2(argv, capsys):
    try:
        code = main(["bench-serve", "--n", "2", *argv])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("unmask: error: ") and err.count("\n") == 1, err


# --- bugs of the tester's adversarial pass ------------------------------------------------------


@pytest.mark.parametrize("argv, needle", [
    (["--decoder", "threshold", "--decoder", "threshold"], "--decoder 'threshold' is given twice"),
    (["--concurrency", "1,2,1"], "--concurrency 1 is given twice"),
], ids=["decoder", "concurrency"])
def test_a_repeated_cell_is_refused(argv, needle, capsys):
    """Cells are keyed by what they send: `--concurrency 1,1 --n 2` pooled both runs into one
    cell that reported 4 requests done. Refused before anything is sent (nothing listens)."""
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--n", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unmask: error: ") and err.count("\n") == 1 and needle in err, err


def test_a_repeated_decoder_in_a_mix_is_a_weight():
    (cell,) = _plan("--decoder", "threshold", "--decoder", "threshold", "--decoder", "fast", "--mix")
    assert cell.decoders == ("threshold", "threshold", "fast")


def test_plot_with_rate_only_cells_is_refused(capsys, tmp_path):
    """--rate without --concurrency: every cell is uncapped and the plot (x = concurrency) was
    empty, with matplotlib's "No artists" warnings."""
    plot = tmp_path / "p.png"
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--n", "2", "--rate", "5",
                 "--plot", str(plot)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rate without --concurrency" in err, err
    assert not plot.exists()


@pytest.mark.parametrize("json_name, plot_name", [("out.png", "out"), ("out.png", "out.")])
def test_plot_without_extension_is_checked_as_the_file_written(json_name, plot_name, tmp_path,
                                                               capsys):
    """matplotlib writes `--plot out` as out.png: with `--json out.png` the JSON was overwritten."""
    assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--n", "2",
                 "--json", str(tmp_path / json_name), "--plot", str(tmp_path / plot_name)]) == 2
    err = capsys.readouterr().err
    assert "two output flags name the same file" in err and "(written as " in err, err


def _cell(conc, p50, p99, tokens_per_s):
    return {"server": "s", "decoder": "d", "concurrency": conc, "tokens_per_s": tokens_per_s,
            "latency_p50": p50, "latency_p99": p99}


def _plotted(monkeypatch, tmp_path, cells):
    """The figure plot_cells draws (kept from being closed), and the warnings it raised."""
    import warnings

    import matplotlib.figure

    from unmask.bench.serve import plot_cells

    figs = []
    real = matplotlib.figure.Figure.savefig

    def keep(self, fname, *a, **kw):
        figs.append(self)
        return real(self, fname, *a, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plot_cells(cells, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").is_file()
    return figs[0], [str(w.message) for w in caught]


def test_plot_leaves_out_latencies_that_were_never_measured(monkeypatch, tmp_path):
    """A cell whose requests all failed has no latency; it was drawn at 0.00 s."""
    fig, warned = _plotted(monkeypatch, tmp_path, [_cell(1, 0.5, 0.9, 10.0),
                                                    _cell(2, None, None, 0.0),
                                                    _cell(4, 0.7, 1.2, 30.0)])
    lat = fig.axes[1]
    ys = [list(line.get_ydata()) for line in lat.lines]
    assert len(ys) == 2 and all(0 not in y for y in ys), ys
    assert [np.isnan(y[1]) for y in ys] == [True, True] and ys[0][::2] == [0.5, 0.7]
    assert warned == []
    # No cell measured a latency: no line, no legend of nothing (matplotlib warned), a note.
    fig, warned = _plotted(monkeypatch, tmp_path, [_cell(1, None, None, 0.0)])
    assert len(fig.axes[1].lines) == 0 and warned == []
    assert "no request completed" in [t.get_text() for t in fig.axes[1].texts]


def test_a_cell_with_no_completed_request_exits_2_after_writing_the_report(url, tmp_path,
                                                                          capsys):
    """Every request failed (a canvas past the model's max_sequence_length: HTTP 400 each) and
    bench-serve exited 0, its table showing 0 done."""
    out, plot = tmp_path / "report.json", tmp_path / "p.png"
    assert main(["bench-serve", "--url", url, "--n", "2", "--concurrency", "1,2",
                 "--decoder", "threshold", "--max-tokens", "4096", "--warmup", "0",
                 "--json", str(out), "--plot", str(plot)]) == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()[-1]
    assert err.startswith("unmask: error: no request of cell server | threshold | c=1 completed "
                          "(0 of 2; first error: HTTP 400"), err
    assert f"(and 1 more cell); --json {out} has every request's error" in err
    assert "| `threshold` | 1 | 0 | 2 |" in captured.out  # the table is printed
    doc = json.loads(out.read_text())
    assert [c["completed"] for c in doc["cells"]] == [0, 0] and plot.is_file()


def test_a_url_ending_in_v1_is_one_line_with_a_hint(url, capsys):
    """--url .../v1 (the OpenAI client's base_url) printed httpx's two-line 404 message."""
    assert main(["bench-serve", "--url", url + "/v1", "--n", "1", "--max-tokens", "32"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "404" in err and "give the server's root URL, without /v1" in err


def test_a_server_with_an_api_key_is_loaded_with_one(tmp_path, monkeypatch, capsys):
    """Without the key the 401 is reported as a 401, not as no server; --api-key or
    $OPENAI_API_KEY sends it."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    app = build_app(LLM(), ServerConfig(decoder="threshold", max_running=4, api_key="s3cret"))
    with LiveServer(app) as s:
        argv = ["--url", s.url, "--n", "1", "--max-tokens", "32", "--warmup", "0"]
        assert main(["bench-serve", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "401 Unauthorized: it needs an API key" in err, err
        assert main(["bench-serve", *argv, "--api-key", "wrong"]) == 2
        assert "401 Unauthorized: it refused the key given" in capsys.readouterr().err
        assert main(["bench-serve", *argv, "--api-key", "cl\u00e9"]) == 2  # was a traceback
        assert "--api-key: an API key is sent as an HTTP header" in capsys.readouterr().err
        assert _run(tmp_path, *argv, "--api-key", "s3cret")["cells"][0]["completed"] == 1
        monkeypatch.setenv("OPENAI_API_KEY", "s3cret")
        assert _run(tmp_path, *argv)["cells"][0]["completed"] == 1
