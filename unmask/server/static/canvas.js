// The canvas renderer shared by the live page (live.js) and `unmask trace`'s HTML replay
// (replay.js). Events are those of unmask/trace.py: layout, step, done (docs/live-view.md: Live view and
// traces). No dependencies, no build step.
"use strict";

// matplotlib's viridis at 0, 1/8, ..., 1 (unmask/trace.py draws GIF frames with the same map).
const VIRIDIS = ["#440154", "#472c7b", "#3a528b", "#2c728e", "#20908c", "#28ae7f", "#5ec961",
  "#addc30", "#fde724"];

function hexRgb(h) {
  return [1, 3, 5].map((i) => parseInt(h.slice(i, i + 2), 16));
}

// Colour of the step that committed a token: viridis over log(step) / log(scale), so that the
// first few steps of a fast decoder are as distinct as the hundreds of a slow one.
function stepColour(step, scale) {
  const t = scale > 1 ? Math.min(Math.max(Math.log(step) / Math.log(scale), 0), 1) : 0;
  const x = t * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(x), VIRIDIS.length - 2);
  const a = hexRgb(VIRIDIS[i]), b = hexRgb(VIRIDIS[i + 1]);
  const f = x - i;
  const c = a.map((v, j) => Math.round(v + (b[j] - v) * f));
  return { css: `rgb(${c[0]},${c[1]},${c[2]})`, dark: c[0] * 0.3 + c[1] * 0.59 + c[2] * 0.11 < 140 };
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// A token as a cell shows it: whitespace made visible, long pieces cut.
function shownPiece(text) {
  if (text.trim() === "") return text.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5") || "\u2205";
  const t = text.trim();
  return t.length > 4 ? t.slice(0, 3) + "\u2026" : t;
}

const COUNTERS = [["steps", "steps"], ["nfe", "NFE"], ["tpf", "TPF"], ["tf", "token-forwards"],
  ["tps", "useful tok/s"], ["time", "time"], ["refreshes", "cache refreshes"]];

// One decoder's canvas: a card with counters, the grid of generated positions and the text.
class Lane {
  constructor(parent, layout, scale) {
    this.layout = layout;
    this.scale = scale;
    this.root = el("section", "lane");
    this.root.dataset.lane = layout.lane;
    this.root.dataset.state = "running";
    const head = el("header", "lane-head");
    head.append(el("span", "lane-decoder", layout.decoder));
    this.status = el("span", "lane-status", "waiting");
    this.badge = el("span", "lane-refresh", "cache refresh");
    head.append(this.badge, this.status);
    this.counters = {};
    const dl = el("dl", "counters");
    for (const [key, label] of COUNTERS) {
      const d = el("div", "counter");
      d.append(el("dt", "", label));
      this.counters[key] = el("dd", "c-" + key, "0");
      d.append(this.counters[key]);
      dl.append(d);
    }
    const cols = Math.min(layout.block_length, 16);
    this.grid = el("div", "grid");
    this.grid.style.setProperty("--cols", cols);
    this.cells = [];
    this.scaffold = new Set(layout.scaffold || []);
    for (let i = 0; i < layout.gen_length; i++) {
      const c = el("div");
      this.cells.push(c);
      this.grid.append(c);
    }
    this.grid.addEventListener("animationend", () => this.grid.classList.remove("flash"));
    this.meta = el("p", "lane-meta", this.metaText(0));
    this.text = el("p", "lane-text");
    this.root.append(head, dl, this.meta, this.grid, this.text);
    parent.append(this.root);
    this.reset();
  }

  // The lane's sizes; cached: prompt tokens whose blocks came from the prefix store. A
  // structured-output request also says how many slots its format constrains and fixes.
  metaText(cached) {
    const l = this.layout;
    const reused = cached ? ` (${cached} reused: their blocks read from the prefix store)` : "";
    const format = l.constrained ? `; the first ${l.constrained} constrained by the response ` +
      `format, ${this.scaffold.size} fixed by its scaffold` : "";
    return `${l.prompt_tokens} prompt tokens${reused} + ${l.gen_length} positions in blocks of ` +
      `${l.block_length}${format}`;
  }

  // A cell as it is before the first step: masked, its block's shade, and whether the
  // response format constrains it or its scaffold fixes it (the first step commits those).
  blankCell(i) {
    const c = this.cells[i];
    c.className = "cell masked" + (Math.floor(i / this.layout.block_length) % 2 ? " odd-block" : "");
    if (i < (this.layout.constrained || 0)) c.classList.add("constrained");
    if (this.scaffold.has(i)) c.classList.add("scaffold");
    c.textContent = "";
    c.style.background = "";
    c.title = `position ${i}: masked` + this.slotNote(i);
  }

  slotNote(i) {
    if (this.scaffold.has(i)) return ", fixed by the response format's scaffold";
    return i < (this.layout.constrained || 0) ? ", constrained by the response format" : "";
  }

  reset() {
    this.steps = 0;
    this.refreshes = 0;
    this.marked = [];
    for (let i = 0; i < this.cells.length; i++) this.blankCell(i);
    for (const key in this.counters) this.counters[key].textContent = "0";
    this.text.textContent = "";
    this.root.dataset.state = "running";
    this.status.textContent = "decoding";
    this.badge.classList.remove("on");
  }

  // Apply one step event; flash: animate a cache refresh (live), not when scrubbing a replay.
  step(ev, flash) {
    if (ev.cached_tokens) this.meta.textContent = this.metaText(ev.cached_tokens);
    for (const i of this.marked) this.cells[i].classList.remove("fresh", "in-block", "dropped");
    this.marked = [];
    const drafted = new Set(ev.drafted), eos = new Set(ev.eos);
    ev.positions.forEach((pos, j) => {
      const c = this.cells[pos];
      const col = stepColour(ev.step, this.scale);
      c.classList.remove("masked");
      c.classList.add("committed", "fresh", col.dark ? "on-dark" : "on-light");
      c.style.background = col.css;
      c.textContent = eos.has(pos) ? "eos" : shownPiece(ev.tokens[j]);
      if (eos.has(pos)) c.classList.add("eos");
      if (drafted.has(pos)) c.classList.add("drafted");
      c.title = `position ${pos}: ${JSON.stringify(ev.tokens[j])}, step ${ev.step}` +
        (drafted.has(pos) ? ", accepted from a FreeDave draft" : "") + this.slotNote(pos);
      this.marked.push(pos);
    });
    const [b0, b1] = ev.block;
    for (let i = b0; i < Math.min(b1, this.cells.length); i++) {
      this.cells[i].classList.add("in-block");
      this.marked.push(i);
    }
    if (ev.suffix_kept) {
      const kept = new Set(ev.suffix_kept);
      for (let i = b1; i < this.cells.length; i++) {
        if (!kept.has(i) && this.cells[i].classList.contains("masked")) {
          this.cells[i].classList.add("dropped");
          this.marked.push(i);
        }
      }
    }
    // Without a cache every forward recomputes everything: nothing to show.
    const refreshed = ev.refreshed && this.layout.cache !== "none";
    if (refreshed) {
      this.refreshes++;
      if (flash) {
        this.grid.classList.remove("flash");
        void this.grid.offsetWidth; // restart the animation
        this.grid.classList.add("flash");
      }
    }
    this.badge.classList.toggle("on", refreshed);
    this.steps = ev.step;
    this.setCounters(ev.step, ev.nfe, ev.decided, ev.token_forwards, ev.useful, ev.elapsed);
    this.text.textContent = ev.text;
  }

  setCounters(steps, nfe, decided, tf, useful, seconds) {
    const c = this.counters;
    c.steps.textContent = steps;
    c.nfe.textContent = nfe;
    c.tpf.textContent = nfe ? (decided / nfe).toFixed(2) : "0";
    c.tf.textContent = tf;
    c.tps.textContent = seconds > 0 ? (useful / seconds).toFixed(1) : "0";
    c.time.textContent = seconds.toFixed(3) + " s";
    c.refreshes.textContent = this.refreshes;
  }

  done(ev) {
    for (const i of this.marked) this.cells[i].classList.remove("fresh", "in-block", "dropped");
    this.marked = [];
    this.badge.classList.remove("on");
    this.setCounters(ev.steps, ev.nfe, ev.decided, ev.token_forwards, ev.useful, ev.seconds);
    this.counters.tps.textContent = ev.tps.toFixed(1);
    this.text.textContent = ev.text;
    this.root.dataset.state = ev.finish_reason === "error" ? "error" : "done";
    const why = { eos: "done (EOS)", length: "done (canvas full)", stop: "stopped",
      abort: "aborted", error: "error: " + (ev.error || "") }[ev.finish_reason] || ev.finish_reason;
    this.status.textContent = why;
  }
}

// The colour legend: what colour, mark, dimming and flash mean (constrained: some lane has a
// response format, whose slots and scaffold are marked then).
function legend(parent, scale, constrained) {
  const box = el("div", "legend");
  const bar = el("span", "legend-bar");
  const stops = VIRIDIS.map((c, i) => `${c} ${(100 * i) / (VIRIDIS.length - 1)}%`).join(",");
  bar.style.background = `linear-gradient(to right, ${stops})`;
  const ticks = el("span", "legend-ticks");
  for (let s = 1; s <= scale; s *= 4) {
    const t = el("span", "", String(s));
    t.style.left = `${(100 * (scale > 1 ? Math.log(s) / Math.log(scale) : 0))}%`;
    ticks.append(t);
  }
  const scaleBox = el("span", "legend-scale");
  scaleBox.append(el("span", "legend-label", "commit step"), bar, ticks);
  bar.append(ticks);
  const drafted = el("span", "legend-item");
  drafted.append(el("span", "cell committed drafted swatch"), "accepted from a FreeDave draft");
  const block = el("span", "legend-item");
  block.append(el("span", "cell masked in-block swatch"), "current block");
  const dropped = el("span", "legend-item");
  dropped.append(el("span", "cell masked dropped swatch"), "left out of the forward");
  const flash = el("span", "legend-item");
  flash.append(el("span", "lane-refresh on swatch-badge", "cache refresh"), "K/V recomputed");
  box.append(scaleBox, drafted, block, dropped, flash);
  if (constrained) {
    const fixed = el("span", "legend-item");
    fixed.append(el("span", "cell masked scaffold swatch"), "fixed by the format's scaffold");
    const slot = el("span", "legend-item");
    slot.append(el("span", "cell masked constrained swatch"), "constrained by the format");
    box.append(fixed, slot);
  }
  parent.append(box);
  return box;
}

// Lanes built from recorded events, and a timeline to replay them: frame k shows every lane
// after its first k steps (k = 1 .. the most steps of any lane).
class Player {
  constructor(parent, lanes) {
    this.lanes = lanes; // [{layout, steps: [...], done}]
    this.frames = Math.max(0, ...lanes.map((l) => l.steps.length));
    this.root = el("div", "player");
    const bar = el("div", "timeline");
    this.play = el("button", "play", "\u25b6 replay");
    this.play.type = "button";
    this.slider = el("input", "frame");
    Object.assign(this.slider, { type: "range", min: 1, max: Math.max(this.frames, 1), step: 1 });
    this.slider.value = this.frames;
    this.label = el("span", "frame-label");
    this.speed = el("select", "speed");
    for (const [v, t] of [[250, "slow"], [80, "normal"], [20, "fast"]]) {
      const o = el("option", "", t);
      o.value = v;
      this.speed.append(o);
    }
    this.speed.value = 80;
    bar.append(this.play, this.slider, this.label, this.speed);
    this.root.append(bar);
    this.grids = el("div", "lanes" + (lanes.length > 1 ? " side-by-side" : ""));
    const scale = Math.max(...lanes.map((l) => l.layout.gen_length));
    legend(this.root, scale, lanes.some((l) => l.layout.constrained));
    this.root.append(this.grids);
    parent.append(this.root);
    this.views = lanes.map((l) => new Lane(this.grids, l.layout, scale));
    this.slider.addEventListener("input", () => { this.stop(); this.show(+this.slider.value); });
    this.play.addEventListener("click", () => (this.timer ? this.stop() : this.start()));
    this.show(this.frames);
  }

  show(k) {
    this.views.forEach((v, i) => {
      const lane = this.lanes[i];
      if (k < v.steps) v.reset();
      const upto = Math.min(k, lane.steps.length);
      for (let s = v.steps; s < upto; s++) v.step(lane.steps[s], false);
      if (upto === lane.steps.length && lane.done) v.done(lane.done);
    });
    this.slider.value = k;
    this.label.textContent = `step ${k} / ${this.frames}`;
  }

  start() {
    let k = +this.slider.value >= this.frames ? 0 : +this.slider.value;
    this.play.textContent = "\u275a\u275a pause";
    const tick = () => {
      k += 1;
      this.show(k);
      if (k >= this.frames) return this.stop();
      this.timer = setTimeout(tick, +this.speed.value);
    };
    this.timer = setTimeout(tick, 0);
  }

  stop() {
    clearTimeout(this.timer);
    this.timer = null;
    this.play.textContent = "\u25b6 replay";
  }
}

// A flat event list (layout, step, done) grouped by lane.
function lanesOf(events) {
  const lanes = [];
  for (const ev of events) {
    if (ev.event === "layout") lanes[ev.lane] = { layout: ev, steps: [], done: null };
    else if (ev.event === "step") lanes[ev.lane].steps.push(ev);
    else if (ev.event === "done") lanes[ev.lane].done = ev;
  }
  return lanes.filter(Boolean);
}
