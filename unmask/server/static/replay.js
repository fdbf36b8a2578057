// `unmask trace --out FILE.html`: replays the events recorded in the page (canvas.js draws).
"use strict";

(function () {
  const trace = JSON.parse(document.getElementById("trace-data").textContent);
  const root = document.getElementById("replay");
  const head = el("header", "page-head");
  head.append(el("h1", "", "unmask trace"), el("span", "model", trace.model));
  root.append(head, el("p", "prompt-shown", trace.prompt));
  const player = new Player(root, lanesOf(trace.events));
  player.show(1);
  player.start();
})();
