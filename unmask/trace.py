"""Traces of a decode: the per-step events a visual client draws, and `unmask trace`.

One encoder (`Lane`) turns a request's `StepEvent`s into JSON-ready dicts; the live page of
`unmask serve` streams them (`unmask.server.live`) and `unmask trace` records them offline through
the engine and writes them as a self-contained HTML replay, an animated GIF or the final frame as
a PNG. The event format is in docs/live-view.md ("The event stream"):

- `layout`: one per lane, first: the decoder, the prompt, the canvas (gen_length, block_length);
- `step`: one per decode step: the positions committed with their token text, which of them came
  from FreeDave drafts, whether the K/V cache was refreshed, the block, the suffix positions that
  took part in the forward, running counters and the committed text so far;
- `done`: one per lane, last: why it finished, the final text and tokens, the metrics.

A trace with several lanes decodes them side by side in one engine (interleaved in each step).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unmask.decoding.params import DecodeParams
from unmask.errors import InputError

if TYPE_CHECKING:  # the module is imported for the CLI's arguments: no torch until it runs
    from unmask.api import LLM
    from unmask.engine import Request, StepEvent

STATIC = Path(__file__).parent / "server" / "static"
FORMATS = (".html", ".gif", ".png")


class Lane:
    """One request of a trace: its step events as dicts for a visual client."""

    def __init__(self, llm: LLM, index: int, prompt: str, request: Request) -> None:
        self.llm, self.index, self.prompt, self.request = llm, index, prompt, request
        self.eos = llm.config.eos_token_id
        self.ids: list[int | None] = [None] * request.gen_length
        self.steps = 0
        self._pieces: dict[int, str] = {}

    def layout(self) -> dict[str, Any]:
        p, c = self.request.params, self.request.constraint
        # structured output: the slots the constraint covers and those its scaffold fixed
        scaffold = [] if c is None else [i for i, t in enumerate(c.initial.tolist())
                                         if t != c.mask_id]
        return {"event": "layout", "lane": self.index, "decoder": p.spec,
                "request_id": self.request.request_id, "prompt": self.prompt,
                "prompt_tokens": self.request.prompt_len, "gen_length": p.gen_length,
                "block_length": p.block_length, "cache": p.cache,
                "constrained": 0 if c is None else c.budget, "scaffold": scaffold}

    def feed(self, ev: StepEvent, elapsed: float) -> list[dict[str, Any]]:
        """The dicts of one StepEvent: a `step` when the request stepped, then `done` if it
        finished. elapsed: seconds since the request's first step."""
        out = []
        if ev.step > self.steps:
            out.append(self._step(ev, elapsed))
        if ev.finished:
            out.append(self._done(ev))
        return out

    def piece(self, token: int) -> str:
        """The text of one token alone (EOS and other special tokens: empty)."""
        if token not in self._pieces:
            self._pieces[token] = self.llm.detokenize([token])
        return self._pieces[token]

    def text(self, ids: list[int | None]) -> tuple[str, int]:
        """(text, useful tokens) of the committed prefix of `ids`, up to the first EOS."""
        from unmask.engine.request import useful_length

        n = ids.index(None) if None in ids else len(ids)
        committed = [t for t in ids[:n] if t is not None]
        useful = useful_length(committed, self.eos)
        return self.llm.detokenize(committed[:useful]), useful

    def _step(self, ev: StepEvent, elapsed: float) -> dict[str, Any]:
        self.steps = ev.step
        for pos, tok in zip(ev.positions, ev.tokens, strict=True):
            self.ids[pos] = tok
        text, useful = self.text(self.ids)
        return {"event": "step", "lane": self.index, "step": ev.step, "positions": ev.positions,
                "ids": ev.tokens, "tokens": [self.piece(t) for t in ev.tokens],
                "eos": [p for p, t in zip(ev.positions, ev.tokens, strict=True) if t == self.eos],
                "drafted": ev.drafted, "forwarded": ev.forwarded, "refreshed": ev.refreshed,
                "block": list(ev.block), "prefix": ev.prefix, "suffix_kept": ev.suffix_kept,
                "nfe": ev.nfe, "token_forwards": ev.token_forwards, "decided": ev.decided,
                "useful": useful, "elapsed": round(elapsed, 6), "text": text,
                "cached_tokens": self.request.cached_tokens}

    def _done(self, ev: StepEvent) -> dict[str, Any]:
        r = self.request
        # A failed request's token_ids is its canvas as the failure left it, [MASK]s included:
        # only what the steps committed is text (None = never committed, as for an abort).
        failed = ev.finished == "error" or r.token_ids is None
        ids: list[int | None] = list(self.ids) if failed else list(r.token_ids)
        text, useful = self.text(ids)
        seconds = r.seconds
        return {"event": "done", "lane": self.index, "finish_reason": ev.finished,
                "error": ev.error, "text": text, "token_ids": ids, "steps": self.steps,
                "nfe": ev.nfe, "token_forwards": ev.token_forwards, "decided": ev.decided,
                "tpf": ev.decided / ev.nfe if ev.nfe else 0.0, "useful": useful,
                "seconds": round(seconds, 6), "tps": useful / seconds if seconds > 0 else 0.0}


# --- recording -----------------------------------------------------------------------------------
# Decoders side by side in one trace, here and on the live page (unmask.server.live): each lane
# is a row of the replay, and each costs a request's decode.
MAX_LANES = 4


def check_lanes(specs: Sequence[str | DecodeParams]) -> None:
    if not specs:
        raise InputError("give at least one decoder spec")
    if len(specs) > MAX_LANES:
        raise InputError(f"{len(specs)} decoders: a trace runs at most {MAX_LANES} side by side")


def record(llm: LLM, prompt: str, specs: Sequence[str | DecodeParams], gen_length: int | None = None,
           block_length: int | None = None, chat: bool = True,
           response_format: Any = None) -> dict[str, Any]:
    """Decode `prompt` with each decoder (a spec or DecodeParams) side by side (one engine,
    trace=True) and return the trace: {"prompt", "model", "events": [layout..., step/done...]};
    response_format: each lane's structured output (`LLM.generate`'s).
    gen_length / block_length apply to the spec strings, as values set outside the spec: a spec
    that sets one to another value is a SpecError."""
    import torch

    from unmask.decoding.grammar import as_format
    from unmask.engine import Engine, SchedulerConfig
    from unmask.engine.layout import model_defaults

    check_lanes(specs)
    lengths = dict(gen_length=gen_length, block_length=block_length)
    if any(isinstance(s, DecodeParams) for s in specs) and any(v is not None for v in lengths.values()):
        raise InputError("gen_length / block_length apply to decoder spec strings; set them in "
                         "the DecodeParams instead")
    defaults = model_defaults(llm.model)
    params = [s if isinstance(s, DecodeParams) else DecodeParams.parse(s, explicit=lengths, **defaults)
              for s in specs]
    ids = llm.encode_prompt(prompt, chat=chat)
    engine = Engine(llm.model, SchedulerConfig(max_running=len(params)))
    lanes = {}
    for i, p in enumerate(params):
        constraint = (None if response_format is None
                      else llm.constraint(as_format(response_format), p.gen_length))
        req = engine.add_request(ids, p, f"lane-{i}", trace=True, constraint=constraint)
        lanes[req.request_id] = Lane(llm, i, prompt, req)
    events = [lane.layout() for lane in lanes.values()]
    with torch.no_grad():
        while engine.has_unfinished:
            for ev in engine.step():
                lane = lanes[ev.request_id]
                started = lane.request.started
                elapsed = time.perf_counter() - started if started is not None else 0.0
                events += lane.feed(ev, elapsed)
    return {"prompt": prompt, "model": llm.name, "events": events}


def lanes_of(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Per lane: {"layout", "steps": [...], "done"} from a trace's flat event list."""
    lanes: dict[int, dict[str, Any]] = {}
    for ev in trace["events"]:
        if ev["event"] == "layout":
            lanes[ev["lane"]] = {"layout": ev, "steps": [], "done": None}
        elif ev["event"] == "step":
            lanes[ev["lane"]]["steps"].append(ev)
        elif ev["event"] == "done":
            lanes[ev["lane"]]["done"] = ev
    return [lanes[k] for k in sorted(lanes)]


def n_frames(trace: dict[str, Any]) -> int:
    """Frames of a replay: frame k shows every lane after its first k steps (k = 1 .. the most
    steps of any lane)."""
    return max((len(lane["steps"]) for lane in lanes_of(trace)), default=0)


# --- writers ------------------------------------------------------------------------------------
def script_json(value: Any) -> str:
    """JSON that can sit inside a <script> element as it is. Escaping "</" alone is not enough:
    after "<!--" and "<script" in the data (a prompt can hold both) the HTML parser is in the
    script's "double-escaped" state, where the "</script>" ending the data no longer ends the
    element, and the renderer's own script is swallowed as data (a blank page). With every "<",
    ">" and "&" written as a JSON escape the data holds no markup at all; JSON.parse reads the
    same strings."""
    return (json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026"))


def write_html(trace: dict[str, Any], path: Path) -> None:
    """A self-contained replay: the live page's renderer and styles inlined, with the events."""
    css = (STATIC / "live.css").read_text()
    js = (STATIC / "canvas.js").read_text() + "\n" + (STATIC / "replay.js").read_text()
    data = script_json(trace)
    title = html.escape(f"unmask trace: {trace['prompt'][:60]}")
    path.write_text(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{css}</style></head>
<body><main id="replay"></main>
<script type="application/json" id="trace-data">{data}</script>
<script>{js}</script></body></html>
""", encoding="utf-8")


# Colours of the frames: matplotlib's viridis over the commit step on a log scale, the same scale
# the page draws (canvas.js: stepColour).
CELL_W, CELL_H, PAD, HEADER, FOOTER = 30, 18, 10, 24, 26
MASK, DROPPED, BG = (228, 230, 235), (246, 247, 249), (255, 255, 255)
INK, MUTED, ACCENT, DRAFT = (30, 32, 48), (107, 112, 128), (230, 90, 40), (255, 80, 60)
SCAFFOLD = (40, 120, 220)  # a cell a constraint fixed before the first step
CONSTRAINED = (155, 89, 182)  # the bar under a slot a response format constrains (as live.css)


def _step_colour(step: int, scale: int) -> tuple[int, int, int]:
    from matplotlib import colormaps

    t = math.log(step) / math.log(scale) if scale > 1 else 0.0
    r, g, b, _ = colormaps["viridis"](min(max(t, 0.0), 1.0))
    return int(r * 255), int(g * 255), int(b * 255)


def _fonts() -> tuple[Any, Any]:
    """(cell font, header font): the DejaVu fonts matplotlib ships (they have the whitespace
    marks), so that frames look the same on every machine."""
    import matplotlib
    from PIL import ImageFont

    ttf = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    return (ImageFont.truetype(str(ttf / "DejaVuSansMono.ttf"), 10),
            ImageFont.truetype(str(ttf / "DejaVuSans.ttf"), 12))


def render_frames(trace: dict[str, Any], last_only: bool = False) -> Iterator[Any]:
    """The replay's frames as Pillow images (frame k: every lane after k steps), one at a time:
    a long decode has a frame a step, too many to hold at once."""
    from PIL import Image, ImageDraw

    lanes = lanes_of(trace)
    fonts = _fonts()
    cols = max(min(lane["layout"]["block_length"], 32) for lane in lanes)
    scale = max(lane["layout"]["gen_length"] for lane in lanes)
    lane_h = [HEADER + math.ceil(lane["layout"]["gen_length"] / cols) * CELL_H + PAD for lane in lanes]
    width, height = 2 * PAD + cols * CELL_W, PAD + sum(lane_h) + FOOTER
    total = n_frames(trace)
    colours = {s: _step_colour(s, scale) for s in range(1, scale + 2)}
    for k in range(total if last_only else 1, total + 1):
        img = Image.new("RGB", (width, height), BG)
        d = ImageDraw.Draw(img)
        y = PAD
        for lane, h in zip(lanes, lane_h, strict=True):
            _draw_lane(d, fonts, lane, k, cols, colours, y)
            y += h
        _draw_legend(d, fonts[1], y, scale, colours)
        yield img


def _draw_lane(d: Any, fonts: tuple[Any, Any], lane: dict[str, Any], k: int, cols: int,
               colours: dict[int, tuple[int, int, int]], y: int) -> None:
    lay, steps = lane["layout"], lane["steps"][:k]
    cell: dict[int, tuple[str, int, bool, bool]] = {}  # offset -> (text, step, drafted, eos)
    scaffold = set(lay.get("scaffold", ()))  # fixed by a constraint before the first step
    constrained = lay.get("constrained", 0)  # the first slots, which a response format holds
    for s in steps:
        drafted, eos = set(s["drafted"]), set(s["eos"])
        for pos, tok in zip(s["positions"], s["tokens"], strict=True):
            cell[pos] = (tok, s["step"], pos in drafted, pos in eos)
    last = steps[-1] if steps else None
    finished = len(steps) == len(lane["steps"])
    d.text((PAD, y), lay["decoder"], fill=INK, font=fonts[1])
    if last:
        tpf = last["decided"] / last["nfe"] if last["nfe"] else 0.0
        status = "done" if finished else "decoding"
        counters = (f"step {len(steps)}    NFE {last['nfe']}    TPF {tpf:.2f}    token-forwards "
                    f"{last['token_forwards']}    {last['elapsed']:.2f} s    {status}")
        d.text((PAD + 150, y), counters, fill=MUTED, font=fonts[1])
    if last and last["refreshed"] and lay["cache"] != "none" and not finished:
        d.text((PAD + cols * CELL_W - 90, y), "cache refresh", fill=ACCENT, font=fonts[1])
    y0 = y + HEADER - 4
    live = last is not None and not finished
    kept = set(last["suffix_kept"]) if live and last["suffix_kept"] is not None else None
    block = last["block"] if live else None
    for pos in range(lay["gen_length"]):
        x, yy = PAD + (pos % cols) * CELL_W, y0 + (pos // cols) * CELL_H
        box = (x + 1, yy + 1, x + CELL_W - 1, yy + CELL_H - 1)
        if pos not in cell:
            dropped = kept is not None and block is not None and pos >= block[1] and pos not in kept
            d.rectangle(box, fill=DROPPED if dropped else MASK)
            _mark_constrained(d, box, pos < constrained)
            continue
        text, step, drafted, eos = cell[pos]
        colour = colours[min(step, max(colours))]
        d.rectangle(box, fill=colour)
        ink = (255, 255, 255) if 0.3 * colour[0] + 0.59 * colour[1] + 0.11 * colour[2] < 140 else INK
        d.text((x + CELL_W / 2, yy + CELL_H / 2), "eos" if eos else _shown(text), fill=ink,
               font=fonts[0], anchor="mm")
        if pos in scaffold:
            d.rectangle(box, outline=SCAFFOLD, width=2)
        if drafted:
            d.polygon([(x + CELL_W - 8, yy + 1), (x + CELL_W - 1, yy + 1), (x + CELL_W - 1, yy + 8)],
                      fill=DRAFT)
        _mark_constrained(d, box, pos < constrained)
    if block is not None:
        b0, b1 = block
        for r in range(b0 // cols, math.ceil(b1 / cols)):
            c0, c1 = max(b0 - r * cols, 0), min(b1 - r * cols, cols)
            yy = y0 + r * CELL_H
            d.rectangle((PAD + c0 * CELL_W, yy, PAD + c1 * CELL_W - 1, yy + CELL_H - 1), outline=ACCENT)


def _mark_constrained(d: Any, box: tuple[int, int, int, int], constrained: bool) -> None:
    """The bar along the bottom of a cell a response format constrains."""
    if constrained:
        d.rectangle((box[0], box[3] - 2, box[2], box[3]), fill=CONSTRAINED)


def _draw_legend(d: Any, font: Any, y: int, scale: int, colours: dict[int, tuple[int, int, int]]) -> None:
    d.text((PAD, y + 2), "commit step", fill=MUTED, font=font)
    x0, w = PAD + 80, 120
    for i in range(w):
        step = max(1, round(math.exp(math.log(scale) * i / (w - 1)))) if scale > 1 else 1
        d.line((x0 + i, y + 4, x0 + i, y + 12), fill=colours[min(step, max(colours))])
    d.text((x0 + w + 6, y + 2), f"1 \u2192 {scale} (log)", fill=MUTED, font=font)
    x = x0 + w + 100
    d.polygon([(x, y + 3), (x + 8, y + 3), (x + 8, y + 11)], fill=DRAFT)
    d.text((x + 14, y + 2), "accepted from a FreeDave draft", fill=MUTED, font=font)
    x += 220
    d.rectangle((x, y + 3, x + 14, y + 13), fill=MASK, outline=ACCENT)
    d.text((x + 20, y + 2), "current block", fill=MUTED, font=font)
    x += 110
    d.rectangle((x, y + 3, x + 14, y + 13), fill=DROPPED)
    d.text((x + 20, y + 2), "left out of the forward", fill=MUTED, font=font)


def _shown(text: str) -> str:
    """A token as a cell shows it (canvas.js: shownPiece)."""
    if not text.strip():
        return text.replace(" ", "\u2423").replace("\n", "\u21b5") or "\u2205"
    t = text.strip()
    return t[:3] + "\u2026" if len(t) > 4 else t


def write_gif(trace: dict[str, Any], path: Path, frame_ms: int = 80) -> None:
    """Every frame in one fixed palette (the drawing colours, viridis and greys), so that no
    colour shifts from frame to frame or gets lost; the last frame is held."""
    from matplotlib import colormaps
    from PIL import Image

    viridis = [tuple(int(c * 255) for c in colormaps["viridis"](i / 127)[:3]) for i in range(128)]
    greys = [(v, v, v) for v in range(0, 256, 8)]
    colours = [BG, INK, MUTED, MASK, DROPPED, ACCENT, DRAFT, *viridis, *greys]
    palette = Image.new("P", (1, 1))
    palette.putpalette([v for c in colours for v in c] + [0] * 3 * (256 - len(colours)))
    # Quantized as drawn: Pillow keeps every frame it writes, and a palette frame is a third of
    # an RGB one (a 1,024-step trace held both: 3.5 GB).
    frames = (f.quantize(palette=palette, dither=Image.Dither.NONE) for f in render_frames(trace))
    durations = [frame_ms] * n_frames(trace)
    durations[-1] = 2500
    next(frames).save(path, save_all=True, append_images=frames, duration=durations, loop=0,
                      optimize=True)


def write_png(trace: dict[str, Any], path: Path) -> None:
    next(render_frames(trace, last_only=True)).save(path)


WRITERS = {".html": write_html, ".gif": write_gif, ".png": write_png}


# --- the command ---------------------------------------------------------------------------------
def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    from unmask.cli_args import add_format_arguments, add_length_arguments, add_model_arguments

    p.add_argument("prompt", metavar="PROMPT", help="the prompt (chat template applied)")
    p.add_argument("--decoder", action="append", default=None, metavar="SPEC",
                   help="decoder spec; repeat it to run decoders side by side (default: static-1)")
    p.add_argument("--out", required=True, type=Path,
                   help="output file: .html (a self-contained replay), .gif (animated), "
                        ".png (the final frame)")
    add_length_arguments(p)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", type=Path, default=None, help="also write the raw events as JSON")
    add_model_arguments(p)
    add_format_arguments(p)


def run_trace(args: argparse.Namespace) -> int:
    from unmask import cli_args
    from unmask.bench.cli import check_outputs
    from unmask.cli_args import chat_for, check_decoder, check_prompts, decoder_for, load_llm

    out = Path(args.out)
    if out.suffix.lower() not in WRITERS:
        raise InputError(f"--out {out}: unknown format {out.suffix or '(none)'!r}; valid: "
                         f"{', '.join(FORMATS)}")
    check_outputs(args, ("out", "json"))
    # Checked before the model loads, so that a bad spec or a spec/flag conflict fails fast.
    specs = args.decoder or ["static-1"]
    for spec in specs:
        check_decoder(spec, args)
    check_lanes(specs)
    check_prompts([args.prompt])
    fmt = cli_args.response_format_of(args)
    llm = load_llm(args)
    params = [decoder_for(spec, args, llm) for spec in specs]
    trace = record(llm, args.prompt, params, chat=chat_for(llm, args.raw), response_format=fmt)
    # Written even when a lane failed: the steps up to a failure are what one debugs it with.
    WRITERS[out.suffix.lower()](trace, out)
    if args.json is not None:
        Path(args.json).write_text(json.dumps(trace) + "\n")
    failed = []
    for lane in lanes_of(trace):
        lay, done = lane["layout"], lane["done"]
        result = (f"failed: {done['error']}" if done["finish_reason"] == "error"
                  else repr(done["text"]))
        print(f"{lay['decoder']}: {done['steps']} steps, NFE {done['nfe']}, "
              f"TPF {done['tpf']:.2f}, {done['seconds']:.2f} s: {result}")
        if done["finish_reason"] == "error":
            failed.append(f"request {lay['request_id']} ({lay['decoder']}) failed in the engine: "
                          f"{done['error']}")
    # a .png is one still picture: the replay's last frame
    what = "its final frame" if out.suffix.lower() == ".png" else f"{n_frames(trace)} frames"
    print(f"wrote {out} ({what})")
    if failed:
        # As `generate` does (LLM.generation): a request the engine failed is not the caller's
        # input error but unmask's, so exit 1 with its traceback rather than a result.
        sys.stdout.flush()
        raise RuntimeError("; ".join(failed))
    return 0
