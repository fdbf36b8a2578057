#!/usr/bin/env bash
# The embedded model's held-out scores (the quality bars of its MODEL_CARD.md: static-1, temperature 0,
# block_length 32) and the approximate decoders' accuracy on more prompts than BENCHMARKS.md's
# tables hold. One `unmask eval` per file in $OUT: NAME.json (scores), NAME.jsonl (each prompt's
# output and verdict), NAME.txt (the printed line). Two lanes, one per core (~15 min on 2 cores).
#
#   bash scripts/bench/evals.sh
#   MODEL=runs/x/final OUT=/tmp/evals bash scripts/bench/evals.sh   # a candidate model
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL=${MODEL:-}
OUT=${OUT:-benchmarks/eval}
UNMASK=${UNMASK:-unmask}
mkdir -p "$OUT"
model_args=()
if [[ -n "$MODEL" ]]; then model_args=(--model "$MODEL"); fi

ev() {  # ev NAME EVAL-ARGS...
  local name=$1
  shift
  echo "== $name" >&2
  "$UNMASK" eval "${model_args[@]}" "$@" --block-length 32 --seed 0 --threads 1 \
    --json "$OUT/$name.json" --samples "$OUT/$name.jsonl" > "$OUT/$name.txt"
}

static="static-1,early_exit=true"  # static-1's text, without forwarding the EOS padding
lane1() {
  ev math-1024 --task math --decoder "$static" --n 96 --gen-length 1024 --batch-size 6
}
lane2() {
  ev math-256 --task math --decoder "$static" --n 96 --gen-length 256 --batch-size 8
  ev code-256 --task code --decoder "$static" --n 48 --gen-length 256 --batch-size 8
  ev code-256-n96 --task code --decoder "$static" --n 96 --gen-length 256 --batch-size 8
  for gen in 256 1024; do
    ev "math-$gen-threshold" --task math --decoder threshold,early_exit=true --n 96 --gen-length "$gen" --batch-size 1
    ev "math-$gen-fast" --task math --decoder fast --n 96 --gen-length "$gen" --batch-size 1
  done
}
lane1 &
pid=$!
lane2
wait "$pid"
