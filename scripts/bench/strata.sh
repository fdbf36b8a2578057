#!/usr/bin/env bash
# Accuracy by difficulty (task math-strata: held-out math in buckets — operand digits
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
#   bash scripts/bench/strata.sh                      # ~10 min of one core each lane on an idle machine
#                                               # (took ~20 min at a load average of 7)
#   N_ACC=20 N_SPEED=5 OUT=/tmp/s bash scripts/bench/strata.sh   # a smoke run
#
# Which decoder `balanced` should be where the model is unsure: candidates
# against static-1 and static-1,early_exit=true on the hard buckets only (math-strata:digits-4,
# sum_list,off-template; off-template is add/sub/sum_list/sort asked in words the training
# templates never use), one `unmask bench` per stage, same lengths and thread:
#
#   bash scripts/bench/strata.sh balanced-prune   # every candidate, N_PRUNE problems (N_PRUNE/3 a bucket):
#                                           # ~6 min of one core at a load average of 4
#   bash scripts/bench/strata.sh balanced-final   # the finalists, N_FINAL problems; the first N_PRUNE are
#                                           # the prune stage's (a bucket's list grows, unchanged):
#                                           # 27 min at a load average of 4
#   bash scripts/bench/strata.sh balanced-check   # those within one problem on every hard bucket, on the
#                                           # other buckets (N_CHECK) and held-out code (N_CHECK/4)
set -euo pipefail
cd "$(dirname "$0")/../.."

MODE=${1:-difficulty}
N_ACC=${N_ACC:-100}
N_SPEED=${N_SPEED:-20}
GEN_LENGTH=${GEN_LENGTH:-256}
OUT=${OUT:-benchmarks/strata}
UNMASK=${UNMASK:-unmask}
mkdir -p "$OUT"

ee="early_exit=true"
fast_suffix="suffix=structured,suffix_rule=grid,suffix_local=16,suffix_middle=16,suffix_tail=4"
fast_cache="cache=entropy,block_recompute=masked,recent_k=0"
# `balanced` before 2026-12-04; the committed files ran with it and name it `balanced` (the preset
# is now threshold 0.95 with a conservative EntropyCache, a finalist of the balanced-* stages).
old_balanced="freedave++,threshold=0.99,draft_conf=0.9,$ee"
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
  "$old_balanced" "freedave++,threshold=0.99,draft_conf=0.9,cache=dual,$ee" "fast,threshold=0.99"
)
BALANCED=(  # balanced's drafts against plain threshold 0.99, with and without early exit
  "static-1" "static-1,$ee" "$old_balanced" "threshold,threshold=0.99,$ee" "threshold,threshold=0.99"
)

HARD="math-strata:digits-4,sum_list,off-template"
N_PRUNE=${N_PRUNE:-24}
N_FINAL=${N_FINAL:-120}
entropy_safe="cache=entropy,entropy_tau=0.5,recent_k=8,refresh_on_block=true"
wide_suffix="suffix=structured,suffix_local=64,suffix_middle=32,suffix_tail=8"
PRUNE=(
  "static-1" "static-1,$ee"                       # the baselines
  "$old_balanced"                                 # balanced before 2026-12-04 (the files: `balanced`)
  "threshold,threshold=0.99,$ee"                  # balanced's tokens without its drafts
  "threshold,threshold=0.95,$ee" "threshold,$ee" "threshold,threshold=0.8,$ee"
  "threshold,threshold=0.7,$ee"                   # lower thresholds (0.9 is the default)
  "entropy_bounded,$ee" "entropy_bounded,eb_threshold=1.0,$ee"  # a bound that adapts per step
  "factor,$ee" "factor,factor=0.5,$ee" "factor,factor=0.25,$ee"  # a bar that rises with the rank
  "threshold,threshold=0.99,cache=dual,$ee"       # a cache, at balanced's threshold
  "threshold,threshold=0.99,$entropy_safe,$ee"    # a conservative EntropyCache
  "threshold,threshold=0.95,$entropy_safe,$ee" "threshold,$entropy_safe,$ee"
  "threshold,threshold=0.99,$wide_suffix,$ee"     # the structured suffix with a wide window
  "freedave++,threshold=0.9,draft_conf=0.9,$ee"   # drafts at the lower threshold
)
FINAL=(  # the prune stage's candidates that lost at most one problem net on a bucket, fastest first
  "static-1" "static-1,$ee" "$old_balanced" "threshold,threshold=0.99,$ee"
  "threshold,threshold=0.95,$ee" "threshold,$ee" "threshold,threshold=0.8,$ee"
  "threshold,threshold=0.7,$ee" "factor,$ee" "factor,factor=0.5,$ee"
  "threshold,threshold=0.99,$entropy_safe,$ee" "threshold,threshold=0.95,$entropy_safe,$ee"
  "threshold,$entropy_safe,$ee" "factor,$entropy_safe,$ee"
)

CHECK=(  # the finalists within one problem of static-1 on every hard bucket, on the other buckets
  "static-1,$ee" "threshold,threshold=0.99,$ee" "threshold,threshold=0.95,$ee" "threshold,$ee"
  "factor,factor=0.5,$ee" "threshold,threshold=0.95,$entropy_safe,$ee"
)
N_CHECK=${N_CHECK:-60}

bench() {  # TASK NAME N DECODER...
  local task=$1 name=$2 n=$3
  shift 3
  local args=()
  for d in "$@"; do args+=(--decoder "$d"); done
  echo "== $name (load average before: $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  "$UNMASK" bench --task "$task" "${args[@]}" --n "$n" --gen-length "$GEN_LENGTH" \
    --block-length 32 --seed 0 --warmup 1 --threads 1 --json "$OUT/$name.json" \
    --samples "$OUT/$name.jsonl" --markdown "$OUT/$name.md" > "$OUT/$name.txt"
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/$name.txt"
}

case "$MODE" in
  difficulty)
    bench math-strata "strata-accuracy-$GEN_LENGTH" "$N_ACC" "${ACCURACY[@]}" &
    pid=$!
    bench math-strata "strata-speed-$GEN_LENGTH" "$N_SPEED" "${SPEED[@]}"
    bench math-strata "strata-balanced-$GEN_LENGTH" "$((N_SPEED / 2))" "${BALANCED[@]}"
    wait "$pid" ;;
  balanced-prune) bench "$HARD" "balanced-prune-$GEN_LENGTH" "$N_PRUNE" "${PRUNE[@]}" ;;
  balanced-final) bench "$HARD" "balanced-final-$GEN_LENGTH" "$N_FINAL" "${FINAL[@]}" ;;
  balanced-check)  # the easy buckets (baseline static-1's text) and held-out code
    bench "math-strata:digits-1-2,digits-3,sort" "balanced-check-easy-$GEN_LENGTH" "$N_CHECK" \
      "${CHECK[@]}"
    bench code "balanced-check-code-$GEN_LENGTH" "$((N_CHECK / 4))" "${CHECK[@]}" ;;
  *) echo "unknown mode $MODE: difficulty (the default), balanced-prune, balanced-final or balanced-check" >&2
     exit 2 ;;
esac
