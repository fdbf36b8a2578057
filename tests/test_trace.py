"""`unmask trace`: the recorded events, the HTML replay, the GIF and the PNG (embedded model)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from unmask.api import LLM
from unmask.cli import main
from unmask.trace import lanes_of, n_frames, record, write_gif, write_html, write_png

PROMPT = "What is 47 + 38?"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.fixture(scope="module")
def trace(llm: LLM) -> dict:
    return record(llm, PROMPT, ["exact", "static-1"], gen_length=32, block_length=16)


def test_events_follow_the_decode(trace: dict, llm: LLM) -> None:
    lanes = lanes_of(trace)
    assert [lane["layout"]["decoder"] for lane in lanes] == ["exact", "static-1"]
    for lane in lanes:
        steps, done = lane["steps"], lane["done"]
        assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
        assert done["steps"] == len(steps) and done["finish_reason"] in ("eos", "length")
        # every position committed exactly once, with the token the decode ended with
        committed = {p: t for s in steps for p, t in zip(s["positions"], s["ids"], strict=True)}
        assert sorted(committed) == list(range(32))
        assert [committed[p] for p in range(32)] == done["token_ids"]
        assert steps[-1]["text"] == done["text"]
        assert done["nfe"] == steps[-1]["nfe"]
    # static-1: a step is a forward and one token from its logits (forward, then commit: the
    # first step commits too, the last forward is the last step's)
    static = lanes[1]
    assert static["done"]["nfe"] == 32 and static["done"]["steps"] == 32
    assert [len(s["positions"]) for s in static["steps"]] == [1] * 32
    # the same request through the API: the same text and NFE
    g = llm.generate(PROMPT, "static-1", gen_length=32, block_length=16)[0]
    assert static["done"]["text"] == g.text and static["done"]["nfe"] == g.nfe


def test_exact_and_static_1_end_with_the_same_tokens(trace: dict) -> None:
    exact, static = lanes_of(trace)
    assert exact["done"]["token_ids"] == static["done"]["token_ids"]
    assert exact["done"]["nfe"] < static["done"]["nfe"]  # drafts accepted: fewer forwards
    assert any(s["drafted"] for s in exact["steps"])


def test_html_replay_has_a_frame_per_step(trace: dict, tmp_path: Path) -> None:
    out = tmp_path / "t.html"
    write_html(trace, out)
    page = out.read_text()
    assert "<script src" not in page and "<link" not in page  # self-contained
    data = re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', page, re.S)
    shown = json.loads(data.group(1))
    assert shown == json.loads(json.dumps(trace))
    assert n_frames(shown) == 32
    for lane in lanes_of(shown):
        assert len(lane["steps"]) == lane["done"]["steps"]
    assert "class Player" in page and "Player(root, lanesOf(trace.events))" in page


def test_gif_and_png(trace: dict, tmp_path: Path) -> None:
    gif, png = tmp_path / "t.gif", tmp_path / "t.png"
    write_gif(trace, gif)
    write_png(trace, png)
    with Image.open(gif) as im:
        assert im.n_frames == n_frames(trace) == 32
        size = im.size
    with Image.open(png) as im:
        assert im.size == size


def test_gif_frames_are_not_all_held_in_rgb(trace: dict, tmp_path: Path, monkeypatch) -> None:
    """A 1,024-step trace took 3.5 GB: every frame was drawn in RGB and held, then quantized.
    Each RGB frame is now quantized as drawn and dropped (Pillow keeps the palette frames)."""
    import weakref

    import unmask.trace as trace_mod

    real, drawn, most = trace_mod.render_frames, [], 0

    def spy(*a, **kw):
        nonlocal most
        for frame in real(*a, **kw):
            drawn.append(weakref.ref(frame))
            most = max(most, sum(r() is not None for r in drawn))
            yield frame

    monkeypatch.setattr(trace_mod, "render_frames", spy)
    write_gif(trace, tmp_path / "t.gif")
    assert len(drawn) == n_frames(trace) == 32 and most <= 2


def test_one_lane_gif_frames_equal_its_steps(llm: LLM, tmp_path: Path) -> None:
    t = record(llm, PROMPT, ["fast"], gen_length=32, block_length=16)
    (lane,) = lanes_of(t)
    write_gif(t, tmp_path / "f.gif")
    with Image.open(tmp_path / "f.gif") as im:
        assert im.n_frames == len(lane["steps"]) == lane["done"]["steps"]


def test_cli_trace(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "t.html"
    code = main(["trace", PROMPT, "--decoder", "static-1", "--decoder", "fast", "--gen-length", "32",
                 "--block-length", "16", "--out", str(out), "--json", str(tmp_path / "t.json")])
    assert code == 0
    assert "static-1: 32 steps, NFE 32" in capsys.readouterr().out
    assert out.is_file() and len(lanes_of(json.loads((tmp_path / "t.json").read_text()))) == 2


def test_cli_trace_says_a_png_is_one_frame(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A .png is the final frame; the line said "(N frames)" as for a .gif."""
    png, gif = tmp_path / "t.png", tmp_path / "t.gif"
    for out in (png, gif):
        assert main(["trace", PROMPT, "--gen-length", "8", "--block-length", "8",
                     "--out", str(out), "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"wrote {png} (its final frame)" in lines and f"wrote {gif} (8 frames)" in lines


@pytest.mark.parametrize(("args", "needle"), [
    (["--out", "x.txt"], "unknown format '.txt'"),
    (["--out", "/nonexistent/x.gif"], "does not exist"),
    (["--out", "{tmp}/x.gif", "--decoder", "nope"], "unknown decoder 'nope'"),
    (["--out", "{tmp}/x.gif", "--gen-length", "30"], "gen_length"),
    # a typed flag and a spec key that disagree: the spec used to win silently
    (["--out", "{tmp}/x.gif", "--gen-length", "32", "--decoder", "fast,gen_length=64"],
     "gen_length is set twice: gen_length=64 in the decoder spec and 32 outside it"),
    (["--out", "{tmp}/x.gif", "--block-length", "8", "--decoder", "static-1,block_length=16"],
     "block_length is set twice"),
    # the JSON events used to overwrite the replay
    (["--out", "{tmp}/x.html", "--json", "{tmp}/x.html"], "two output flags name the same file"),
])
def test_cli_trace_bad_input(args: list[str], needle: str, tmp_path: Path,
                             capsys: pytest.CaptureFixture) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["trace", PROMPT, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unmask: error:") and needle in err, err


def test_cli_trace_caps_lanes_as_the_live_route(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    """Five --decoder ran five lanes where POST /v1/unmask/trace caps them at four."""
    specs = [f"static-1,seed={i}" for i in range(5)]
    argv = ["trace", PROMPT, "--out", str(tmp_path / "x.html")]
    assert main([*argv, *(a for s in specs for a in ("--decoder", s))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "at most 4" in err, err
    assert not (tmp_path / "x.html").exists()


def test_trace_lane_cap_is_the_live_routes() -> None:
    pytest.importorskip("fastapi")
    from unmask.server import live
    from unmask.trace import MAX_LANES

    field = live.TraceRequest.model_fields["decoders"]
    assert any(getattr(m, "max_length", None) == MAX_LANES for m in field.metadata)


def test_cli_trace_empty_prompt(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["trace", " ", "--out", str(tmp_path / "x.gif")]) == 2
    assert "empty prompt" in capsys.readouterr().err



@pytest.mark.parametrize("failure", ["stall", "raise"])
def test_cli_trace_reports_a_failed_decode(failure: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """A request that ends in error after a few steps, as a step that commits nothing (the
    engine's stall check; non-finite scores did it) or a forward that raises (the engine fails
    the batch). trace used to exit 0 with an empty summary, and after a stall its `done` counted
    the [MASK]s left on the canvas as useful text."""
    import torch

    import unmask.api as api
    from unmask.engine.decoder import Decoder

    calls = 0
    if failure == "stall":
        real_step = Decoder.step

        def stalls_at_step_4(self: Decoder, *args: object, **kwargs: object) -> object:
            nonlocal calls
            calls += 1
            res = real_step(self, *args, **kwargs)
            if calls == 4:
                res.stalled[:] = True
            return res

        monkeypatch.setattr(Decoder, "step", stalls_at_step_4)
    else:
        real_load = api.load_model

        def fails_after_three_forwards(*args: object, **kwargs: object) -> torch.nn.Module:
            model = real_load(*args, **kwargs)

            def hook(module: torch.nn.Module, inputs: object, logits: torch.Tensor) -> None:
                nonlocal calls
                calls += 1
                if calls > 3:
                    raise FloatingPointError("the logits are NaN")

            model.register_forward_hook(hook)
            return model

        monkeypatch.setattr(api, "load_model", fails_after_three_forwards)
    png, js = tmp_path / "t.png", tmp_path / "t.json"
    # As `generate` fails such a request (LLM.generation): an error from unmask, exit code 1.
    with pytest.raises(RuntimeError, match=r"request lane-0 \(static-1\) failed in the engine: "):
        main(["trace", PROMPT, "--decoder", "static-1", "--gen-length", "32", "--block-length",
              "16", "--out", str(png), "--json", str(js), "--threads", "1"])
    out = capsys.readouterr().out
    assert "static-1: " in out and ": failed: " in out and "wrote " in out  # written, to debug it
    (lane,) = lanes_of(json.loads(js.read_text()))
    done, steps = lane["done"], lane["steps"]
    assert done["finish_reason"] == "error" and done["error"]
    committed = {p: t for s in steps for p, t in zip(s["positions"], s["ids"], strict=True)}
    assert 0 < len(committed) < 32
    mask = LLM().config.mask_token_id
    assert mask not in done["token_ids"]  # never-committed positions are null, as for an abort
    assert [t for t in done["token_ids"] if t is not None] == [committed[p] for p in sorted(committed)]
    assert done["useful"] <= len(committed) and done["text"] == steps[-1]["text"]
    assert png.is_file()


# A prompt that puts the HTML parser in a script's "double-escaped" state: with only "</" escaped
# in the embedded events, the element ended late and the renderer's script became data.
MARKUP_PROMPT = "Hi <!-- <script> there & </script> > bye"
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def markup_trace(llm: LLM) -> dict:
    return record(llm, MARKUP_PROMPT, ["fast"], gen_length=32)


def test_html_replay_data_holds_no_markup(markup_trace: dict, tmp_path: Path) -> None:
    out = tmp_path / "m.html"
    write_html(markup_trace, out)
    page = out.read_text()
    _, sep, rest = page.partition('<script type="application/json" id="trace-data">')
    data, sep2, _ = rest.partition("</script>")
    assert sep and sep2
    assert not set("<>&") & set(data), "markup characters in the embedded events"
    assert json.loads(data) == json.loads(json.dumps(markup_trace))  # the same strings back


def test_html_replay_with_markup_in_the_prompt_plays_in_a_browser(markup_trace: dict,
                                                                  tmp_path: Path) -> None:
    """The tester's `unmask trace 'Hi <!-- <script> there' --out xs.html` was a blank page."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing and scripts/setup-browser.sh could not install it "
                    "(no apt-get or no root)")
    from playwright.sync_api import sync_playwright

    out = tmp_path / "m.html"
    write_html(markup_trace, out)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route("**/*", lambda route: route.abort()
                       if not route.request.url.startswith("file:") else route.continue_())
            page.goto(out.as_uri())
            page.wait_for_function("document.querySelectorAll('.lane[data-state=done]').length == 1",
                                   timeout=15_000)
            assert page.text_content(".prompt-shown") == MARKUP_PROMPT
            assert page.text_content(".lane-text") == markup_trace["events"][-1]["text"]
            assert errors == []
        finally:
            browser.close()
