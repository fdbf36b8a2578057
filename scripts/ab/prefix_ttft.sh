#!/usr/bin/env bash
# The shared-prompt serve table of scripts/bench/prefix_reuse.sh (its first bench-serve command:
# the server's default decoder, unmask-sdar, 1 thread, 32 requests x 2 rounds at concurrency
# 1, 4, 16), for an earlier commit REV (before) and this tree (after), store off and on: four
# servers, two bench-serve runs in rotated order (TTFT is wall clock: both trees under the same
# load). Tables in OUT/ab1.md and OUT/ab2.md, the load in OUT/load.txt.
#
#     PATH=$PWD/.venv/bin:$PATH bash scripts/ab/prefix_ttft.sh REV OUT
#
# AFTER_FLAGS: more `unmask serve` flags for this tree's two servers (e.g. AFTER_FLAGS=
# '--admission-window-ms 20'), to compare a setting against REV's defaults.
set -euo pipefail
REV=$1
OUT=$(realpath -m "$2")
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=$(command -v python)
mkdir -p "$OUT"
for port in 8861 8862 8863 8864; do  # a server left on a port would answer for this run's
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
    echo "port $port is already serving (another run?): stop it first" >&2; exit 2
  fi
done
BASE=$(mktemp -d)
git -C "$ROOT" archive "$REV" | tar -x -C "$BASE"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$BASE"' EXIT
serve() {  # TREE PORT [FLAGS]; from / so that the tree on PYTHONPATH is the one run
  # shellcheck disable=SC2086  # FLAGS are words
  (cd /; exec env PYTHONPATH="$1" "$PY" -m unmask.cli serve --model unmask-sdar --threads 1 \
     --port "$2" --max-running 16 ${3:-} --log-level warning) &
  pids+=($!)
}
serve "$BASE" 8861 --no-prefix-cache
serve "$BASE" 8862
serve "$ROOT" 8863 "--no-prefix-cache ${AFTER_FLAGS:-}"
serve "$ROOT" 8864 "${AFTER_FLAGS:-}"
for port in 8861 8862 8863 8864; do
  for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
done
orders=("before-off=8861 before-on=8862 after-off=8863 after-on=8864"
        "after-on=8864 after-off=8863 before-on=8862 before-off=8861")
for run in 1 2; do
  urls=()
  for u in ${orders[$((run - 1))]}; do urls+=(--url "${u%=*}=http://127.0.0.1:${u#*=}"); done
  echo "run $run start: $(uptime)" >> "$OUT/load.txt"
  (cd "$ROOT" && "$PY" -m unmask.cli bench-serve "${urls[@]}" --endpoint chat --task math --n 32 \
     --system benchmarks/data/shared-system-prompt.txt --fresh-prompts --max-tokens 32 \
     --concurrency 1,4,16 --rounds 2 --warmup 1 --seed 0 --timeout 300 \
     --json "$OUT/ab$run.json" > "$OUT/ab$run.md")
  echo "run $run end: $(uptime)" >> "$OUT/load.txt"
done
