#!/usr/bin/env bash
# Issue 21: accuracy by difficulty (task math-strata: held-out math in buckets — operand digits
# 1-2, 3, 4, and the list families sum_list and sort) and where the approximate decoders' loss
# comes from. Two `unmask bench` runs, one per core, each writing .md/.json/.jsonl/.txt under $OUT:
#
#  - strata-accuracy-256: the ablation from `fast` back towards static-1, one knob at a time, on
#    N_ACC problems (N_ACC/5 per bucket). Baseline static-1,early_exit=true: static-1's text (the
#    canvas is committed up to the same EOS; only the EOS padding is not forwarded), at a third of
#    the cost, so more problems fit. Per-bucket loss = against this baseline, paired.
#  - strata-speed-256: the README's presets against vanilla static-1 (no early exit) and
#    static-1,early_exit=true on N_SPEED problems (the first N_SPEED of the same list), every
#    decoder side by side per problem: the speedups.
#
#   bash scripts/strata.sh                      # ~10 min of one core each lane on an idle machine
#                                               # (took ~20 min at a load average of 7)
#   N_ACC=20 N_SPEED=5 OUT=/tmp/s bash scripts/strata.sh   # a smoke run
set -euo pipefail
cd "$(dirname "$0")/.."

N_ACC=${N_ACC:-100}
N_SPEED=${N_SPEED:-20}
GEN_LENGTH=${GEN_LENGTH:-256}
OUT=${OUT:-benchmarks/strata}
UNMASK=${UNMASK:-unmask}
mkdir -p "$OUT"

ee="early_exit=true"
fast_suffix="suffix=structured,suffix_rule=grid,suffix_local=16,suffix_middle=16,suffix_tail=4"
fast_cache="cache=entropy,block_recompute=masked,recent_k=0"
ACCURACY=(
  "static-1,$ee"                        # the baseline: static-1's text
  "fast" "fast,suffix=full" "fast,cache=none"   # fast minus its suffix / minus its cache
  "threshold,$fast_cache,$fast_suffix,$ee"      # fast minus its drafts (FreeDave++ -> threshold)
  "threshold,$ee"                               # fast minus everything but the commit rule
  "threshold,threshold=0.95,$ee" "threshold,threshold=0.99,$ee"    # the commit rule's value
  "threshold,cache=entropy,$ee" "threshold,$fast_cache,$ee" "threshold,cache=dual,$ee"  # caches
  "threshold,$fast_suffix,$ee"                  # the suffix alone
  "fast,threshold=0.99"                         # every approximation of fast at threshold 0.99
  "freedave++,threshold=0.99,draft_conf=0.9,cache=dual,$ee"  # balanced + the dual cache
)  # balanced itself is token-identical to "threshold,threshold=0.99,$ee" (FreeDave++ is exact)
SPEED=(
  "static-1" "static-1,$ee" "exact" "threshold" "threshold,cache=entropy" "fast"
  "balanced" "freedave++,threshold=0.99,draft_conf=0.9,cache=dual,$ee" "fast,threshold=0.99"
)
BALANCED=(  # balanced's drafts against plain threshold 0.99, with and without early exit
  "static-1" "static-1,$ee" "balanced" "threshold,threshold=0.99,$ee" "threshold,threshold=0.99"
)

bench() {  # NAME N DECODER...
  local name=$1 n=$2
  shift 2
  local args=()
  for d in "$@"; do args+=(--decoder "$d"); done
  echo "== $name" >&2
  "$UNMASK" bench --task math-strata "${args[@]}" --n "$n" --gen-length "$GEN_LENGTH" \
    --block-length 32 --seed 0 --warmup 1 --threads 1 --json "$OUT/$name.json" \
    --samples "$OUT/$name.jsonl" --markdown "$OUT/$name.md" > "$OUT/$name.txt"
}

bench "strata-accuracy-$GEN_LENGTH" "$N_ACC" "${ACCURACY[@]}" &
pid=$!
bench "strata-speed-$GEN_LENGTH" "$N_SPEED" "${SPEED[@]}"
bench "strata-balanced-$GEN_LENGTH" "$((N_SPEED / 2))" "${BALANCED[@]}"
wait "$pid"
