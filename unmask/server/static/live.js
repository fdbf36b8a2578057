// The live page of `unmask serve`: runs a prompt through one or two decoders and draws each
// step as the server streams it (POST /v1/unmask/trace, server-sent events). canvas.js draws.
"use strict";

const $ = (id) => document.getElementById(id);

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

// fetch for the server's /v1/ routes: with `serve --api-key` they answer 401 without the key,
// which the page then asks for once and keeps for the tab's session.
async function api(path, init = {}) {
  for (let asked = false; ; asked = true) {
    const key = sessionStorage.getItem("unmask-api-key");
    const headers = { ...(init.headers || {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) };
    const r = await fetch(path, { ...init, headers });
    if (r.status !== 401 || asked) return r;
    const typed = window.prompt("This server needs its API key (unmask serve --api-key):");
    if (!typed) return r;
    sessionStorage.setItem("unmask-api-key", typed.trim());
  }
}

// The decoder pickers: presets and methods from the server, or a spec typed by hand.
async function loadDecoders() {
  const r = await api("/v1/unmask/decoders");
  const info = await r.json();
  $("model").textContent = info.model;
  for (const [pick, field, initial] of [["pick-a", "spec-a", "static-1"], ["pick-b", "spec-b", "fast"]]) {
    const sel = $(pick);
    const groups = [["presets", Object.keys(info.presets)], ["methods", info.methods]];
    for (const [label, names] of groups) {
      const g = el("optgroup");
      g.label = label;
      for (const n of names) {
        const o = el("option", "", n);
        o.value = n;
        o.title = label === "presets" ? info.presets[n] : n;
        g.append(o);
      }
      sel.append(g);
    }
    const custom = el("option", "", "custom spec\u2026");
    custom.value = "";
    sel.append(custom);
    sel.value = initial;
    $(field).value = initial;
    sel.addEventListener("change", () => {
      if (sel.value) $(field).value = sel.value;
      $(field).focus();
    });
    $(field).addEventListener("input", () => {
      const v = $(field).value.trim();
      sel.value = [...sel.options].some((o) => o.value === v) ? v : "";
    });
  }
}

let running = null; // the AbortController of the run in progress

async function run(event) {
  event.preventDefault();
  if (running) running.abort();
  showError("");
  const decoders = [$("spec-a").value.trim()];
  if ($("side").checked) decoders.push($("spec-b").value.trim());
  const body = { prompt: $("prompt").value, decoders, seed: +$("seed").value || 0 };
  if ($("max-tokens").value) body.max_tokens = +$("max-tokens").value;
  const format = $("format").value.trim();
  if (format.startsWith("{")) { // a JSON schema; anything else is a regular expression
    try {
      body.response_format = { type: "json_schema",
        json_schema: { name: "page", schema: JSON.parse(format) } };
    } catch (e) {
      showError(`the JSON schema is not valid JSON: ${e.message}`);
      return;
    }
  } else if (format) body.regex = format;
  const controller = new AbortController();
  running = controller;
  $("run").disabled = true;
  $("stop").disabled = false;
  const out = $("lanes");
  try {
    const r = await api("/v1/unmask/trace", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      let msg = `HTTP ${r.status}`;
      try { msg = (await r.json()).error.message; } catch (e) { /* not JSON */ }
      showError(msg);
      return;
    }
    out.replaceChildren();
    out.dataset.state = "running";
    await consume(r, out);
  } catch (e) {
    if (e.name !== "AbortError") showError(String(e));
  } finally {
    if (running === controller) running = null;
    $("run").disabled = false;
    $("stop").disabled = true;
  }
}

// Read the event stream: draw each step as it comes, then hand the recording to a Player.
async function consume(response, out) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const events = [];
  const live = [];
  let scale = 1, buffer = "", grids = null;
  const handle = (ev) => {
    events.push(ev);
    if (ev.event === "layout") {
      if (!grids) {
        scale = ev.gen_length;
        legend(out, scale, ev.constrained > 0);
        grids = el("div", "lanes");
        out.append(grids);
      }
      live[ev.lane] = new Lane(grids, ev, scale);
      grids.classList.toggle("side-by-side", live.length > 1);
    } else if (ev.event === "step") live[ev.lane].step(ev, true);
    else if (ev.event === "done") live[ev.lane].done(ev);
    else if (ev.error) showError(ev.error.message);
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const chunk = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of chunk.split("\n")) {
        if (line.startsWith("data: ")) handle(JSON.parse(line.slice(6)));
      }
    }
  }
  const lanes = lanesOf(events);
  if (lanes.length && lanes.every((l) => l.done)) {
    out.replaceChildren();
    new Player(out, lanes);
  }
  out.dataset.state = "done";
}

document.addEventListener("DOMContentLoaded", () => {
  $("form").addEventListener("submit", run);
  $("stop").addEventListener("click", () => running && running.abort());
  $("side").addEventListener("change", () => { $("lane-b").hidden = !$("side").checked; });
  loadDecoders().catch((e) => showError("cannot reach the server: " + e));
});
