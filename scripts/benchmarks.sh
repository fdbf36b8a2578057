#!/usr/bin/env bash
# Regenerates BENCHMARKS.md: one `unmask bench` table per task (every decoder side by side on the
# same prompts, static-1 first as the baseline), then the header, the machine and the sections
# concatenated into one file.
#
#   bash scripts/bench/sweeps.sh && bash scripts/benchmarks.sh   # the documented run (~1 h on 2 cores)
#   ASSEMBLE_ONLY=1 bash scripts/benchmarks.sh           # rebuild the file from benchmarks/
#   LANE1="a:math:32:1:LONG" LANE2="b:math:32:1:ABLATION" OUT=/tmp/B.md ARTIFACTS=/tmp/b \
#     bash scripts/benchmarks.sh                        # a smoke run
#
# Every variable below can be overridden from the environment. Markdown files in
# $ARTIFACTS/extra/ (e.g. parameter sweeps) are appended after the tables, in name order.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-}                  # checkpoint folder; empty = the embedded default model
N=${N:-12}                        # prompts of the 256 table (others scale down: see LANE1/LANE2)
BLOCK_LENGTH=${BLOCK_LENGTH:-32}
BATCH_SIZE=${BATCH_SIZE:-1}
THREADS=${THREADS:-1}             # fixed, so numbers are comparable across machines and runs
WARMUP=${WARMUP:-1}
SEED=${SEED:-0}
OUT=${OUT:-BENCHMARKS.md}
ARTIFACTS=${ARTIFACTS:-benchmarks}  # per-task .md/.json/.png land here
UNMASK=${UNMASK:-unmask}
PYTHON=${PYTHON:-python}

# Decoder sets. The first decoder of each set is the baseline (speedup 1x, exact-match reference):
# vanilla static-1, no cache. `exact` is FreeDave at its default draft_steps (the bench refuses
# the same decoder twice, so plain `freedave` has no row of its own).
MAIN=(  # FreeDave and the caches side by side; FreeDave's K = 2/4/8 side by
  # side is the `drafts` sweep (scripts/bench/sweeps.sh)
  "static-1" "static-1,early_exit=true" "threshold" "freedave++"
  "static-1,cache=dual" "threshold,cache=dual" "threshold,cache=entropy" "freedave++,cache=entropy"
  "threshold,suffix=structured" "exact" "balanced" "fast"
)
LONG=(  # the same at 512
  "static-1" "static-1,early_exit=true" "threshold" "freedave++"
  "threshold,cache=dual" "threshold,cache=entropy" "freedave++,cache=entropy" "exact" "balanced"
  "fast"
)
ABLATION=(  # the ablation: each method alone, each pair, all three, the fast preset and exact
  "static-1" "static-1,early_exit=true"
  "freedave++" "threshold,cache=entropy" "threshold,suffix=structured"
  "freedave++,cache=entropy" "freedave++,suffix=structured" "threshold,cache=entropy,suffix=structured"
  "freedave++,cache=entropy,suffix=structured" "balanced" "fast" "exact"
)
# Tables: NAME:TASK:GEN_LENGTH:N:DECODER_SET[:WARMUP], run in two lanes (one per core) side by
# side. Long canvases skip the warm-up: a static-1 decode there takes minutes, so allocator
# warm-up is noise, and the warm-up would double the table's cost.
# The committed BENCHMARKS.md used N=12 (the defaults below); a static-1 decode at 1024 takes
# about a minute on one core, hence a few prompts for the long tables.
LANE1=${LANE1:-"math-256:math:256:$N:MAIN code-256:code:256:$((N / 2 > 0 ? N / 2 : 1)):MAIN code-512:code:512:$(((N + 3) / 4)):LONG:0 code-1024:code:1024:$(((N + 5) / 6)):LONG:0"}
LANE2=${LANE2:-"math-1024:math:1024:$(((N + 3) / 4)):ABLATION:0 math-512:math:512:$(((N + 2) / 3)):LONG:0"}
ASSEMBLE_ONLY=${ASSEMBLE_ONLY:-0}  # 1: only rebuild BENCHMARKS.md from $ARTIFACTS

mkdir -p "$ARTIFACTS" "$(dirname "$OUT")"
model_args=()
if [[ -n "$MODEL" ]]; then model_args=(--model "$MODEL"); fi

run_table() {  # NAME:TASK:GEN_LENGTH:N:SET[:WARMUP]
  IFS=: read -r name task gen n set warmup <<< "$1"
  local -n specs=$set
  local decoder_args=()
  for d in "${specs[@]}"; do decoder_args+=(--decoder "$d"); done
  echo "== $name: $task, gen_length $gen, $n prompts, ${#specs[@]} decoders" >&2
  "$UNMASK" bench "${model_args[@]}" --task "$task" "${decoder_args[@]}" \
    --n "$n" --gen-length "$gen" --block-length "$BLOCK_LENGTH" \
    --batch-size "$BATCH_SIZE" --warmup "${warmup:-$WARMUP}" --seed "$SEED" --threads "$THREADS" \
    --json "$ARTIFACTS/$name.json" --plot "$ARTIFACTS/$name.png" \
    --markdown "$ARTIFACTS/$name.md" > "$ARTIFACTS/$name.log" 2>&1 \
    || { echo "$name failed: $(tail -n 1 "$ARTIFACTS/$name.log")" >&2; return 1; }
}
lane() { for t in $1; do run_table "$t" || return 1; done; }
if [[ "$ASSEMBLE_ONLY" != 1 ]]; then
  lane "$LANE1" & pid1=$!
  lane "$LANE2" & pid2=$!
  failed=0
  wait $pid1 || failed=1
  wait $pid2 || failed=1
  if [[ $failed == 1 ]]; then echo "a table failed: BENCHMARKS.md left as it was" >&2; exit 1; fi
fi

# Assemble into a temporary file first: a failed run never leaves a half-written BENCHMARKS.md.
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
tables=$(for t in $LANE1 $LANE2; do echo "${t%%:*}"; done)
first=$(echo "$tables" | head -n 1)
outdir=$(dirname "$OUT")
{
  echo "# Benchmarks"
  echo
  # The one-screen summary, written by hand (each row's numbers come from its section below):
  # rerunning a section means updating its row in $ARTIFACTS/summary.md.
  if [[ -e "$ARTIFACTS/summary.md" ]]; then cat "$ARTIFACTS/summary.md"; fi
  cat <<EOF
Generated by \`bash scripts/benchmarks.sh\` (do not edit by hand: rerun it). Each table runs every
decoder on the same prompts in one process, interleaved prompt by prompt with the order rotated,
after a warm-up; the first row is the baseline. Metrics ([docs/design.md](docs/design.md#metrics)): **TPF**
generated positions committed by a forward's decision per forward (early exit's EOS fill does not
count; the fast-variants section below was measured before this definition, and its TPF
column still counts it); **TPS** useful tokens (up to the first EOS) per second, median over prompts;
**cost/token** token-forwards per useful token (an autoregressive model with a KV cache scores
~1); **speedup** the median over prompts of TPS(decoder) / TPS(baseline) on the same prompt, and
**vs static-1+EE** the same against vanilla with early exit (\`static-1,early_exit=true\`);
**exact-match** the share of prompts whose tokens equal the baseline's; p50/p95 s the latency
per prompt; **exact vs own ref** the share of prompts token-identical to the decoder a lossless
method claims to reproduce (FreeDave -> static-1, FreeDave++ -> threshold, same cache/suffix) when
that decoder is in the table. Each section names the exact command that produced it.

Read with care: the embedded model is small (1.38M parameters; 84% on 96 held-out math problems
at 256 with static-1, see its MODEL_CARD.md), so accuracy over a handful of prompts moves in steps
of 100/n points; the long tables use few prompts (a vanilla static-1 decode at 1024 takes about a
minute on one core) — the accuracy of static-1, threshold and \`fast\` on 96 prompts is in the
last section; and on a CPU a batched forward of K FreeDave drafts costs about K forwards, so
FreeDave's gains show in TPF more than in TPS. The Results tables and the sweeps were rerun on
the current engine; fast-variants and "By difficulty" were measured before the decode state
moved to the host ("Host overhead"): their tokens and NFE are what this engine gives (the rerun
tables reproduce every such column, and so do 96 prompts x 5 decoders of "Accuracy on more
prompts"), their TPS and speedups are the older engine's, lower for decoders bound by host time
such as \`fast\`.

**\`balanced\` changed on 2026-12-04** (§ Balanced on hard problems): it was
\`freedave++,threshold=0.99,draft_conf=0.9,early_exit=true\` (token-identical to threshold 0.99)
and is now \`threshold,threshold=0.95,cache=entropy,entropy_tau=0.5,recent_k=8,refresh_on_block=true,early_exit=true\`.
The Results tables were rerun with the new one, and § Balanced on hard problems measures both;
every other table with a \`balanced\` row (the sections after Results) was measured with the
previous preset.

**The default changed on 2026-12-06** (§ The default on unseen problems): it is now
\`static-1,early_exit=true\` (static-1's tokens), no longer \`balanced\`. Every table names its
decoders; a serving table's \`(server default)\` measured before that date is \`balanced\`.

## Machine

EOF
  "$PYTHON" -c 'import json, sys
from unmask.bench.report import machine_markdown
print(machine_markdown(json.load(open(sys.argv[1]))["machine"]))' "$ARTIFACTS/$first.json"
  echo
  echo "## Results"
  for name in $tables; do
    echo
    cat "$ARTIFACTS/$name.md"
    echo
    echo "![$name: speedup vs accuracy]($(realpath -m --relative-to="$outdir" "$ARTIFACTS/$name.png"))"
  done
  for extra in "$ARTIFACTS"/extra/*.md; do
    [[ -e "$extra" ]] || continue
    title=$(basename "$extra" .md)
    title=${title#zz-}
    echo
    echo "## ${title/sweep-/Sweep: }"
    echo
    cat "$extra"
  done
  evals=("$ARTIFACTS"/eval/*.json)
  if [[ -e "${evals[0]}" ]]; then
    echo
    echo "## Accuracy on more prompts (\`unmask eval\`, \`bash scripts/bench/evals.sh\`)"
    echo
    echo "Held-out prompts (seed 0), block_length 32, one thread; each file's command is in its JSON"
    echo "and each prompt's output in the \`.jsonl\` next to it (\`$ARTIFACTS/eval/\`)."
    echo
    "$PYTHON" -c 'import json, sys
from pathlib import Path
from unmask.bench.report import eval_summary_table
print(eval_summary_table([(Path(p).name, json.load(open(p))) for p in sys.argv[1:]]))' "${evals[@]}"
  fi
} > "$tmp"
cat "$tmp" > "$OUT"  # not mv: keep the usual file mode, not mktemp's 0600
trap - EXIT
echo "wrote $OUT" >&2
