#!/usr/bin/env bash
# Reproduces bench/results/ablate_smollm2.{md,json,png}, ablate_smollm2_nonret.{json,png} (random heads
# drawn only from heads scoring < 0.1), ablate_smollm2.each.{json,md} (single heads masked alone) and niah_smollm2.{json,png} on
# the embedded SmolLM2-135M-Instruct with the committed detection scores.
#
# The ablation runs in slices of $SLICE (default 2) mask configurations (`--limit N --resume`), each slice under the heavy-job
# lock $LOCK when set (the 2-core machine is shared), so other jobs can run between slices; the result is
# the same as one uninterrupted `retmask ablate` run (each configuration is an independent greedy evaluation).
#   LOCK=/tmp/retmask-heavy.lock bash bench/ablate_smollm2.sh
set -euo pipefail
OUT=${OUT:-runs/ablate_smollm2}
run() { if [ -n "${LOCK:-}" ]; then flock "$LOCK" "$@"; else "$@"; fi; }
mkdir -p "$OUT"
ABLATE=(retmask ablate --scores bench/results/smollm2_scores.json --k 0,5,10,20,40 --seeds 3
        --min-len 500 --max-len 2000 --num-lengths 3 --num-depths 3 --num-needles 3
        --out-dir "$OUT" --prefix ablate_smollm2 --no-progress)
while :; do
  run "${ABLATE[@]}" --resume --limit "${SLICE:-2}" | tee "$OUT/last_slice.txt"
  grep -q "configurations left" "$OUT/last_slice.txt" || break
done
cp "$OUT/ablate_smollm2.json" "$OUT/ablate_smollm2.png" bench/results/
# The same curve with the random heads drawn only from non-retrieval heads (mean score < 0.1).
run "${ABLATE[@]}" --prefix ablate_smollm2_nonret --random-from non-retrieval --resume | tail -8  # last --prefix wins
cp "$OUT/ablate_smollm2_nonret.json" "$OUT/ablate_smollm2_nonret.png" bench/results/
# Single non-retrieval heads of the draw that collapsed (random-k5-s2 of the non-retrieval curve), each
# masked alone.
run retmask ablate --each 1-5,26-3,26-6,29-1,29-3 --scores bench/results/smollm2_scores.json \
    --min-len 500 --max-len 2000 --num-lengths 3 --num-depths 3 --num-needles 3 \
    --out-dir "$OUT" --prefix ablate_smollm2 --no-progress --resume
cp "$OUT/ablate_smollm2.each.json" "$OUT/ablate_smollm2.each.md" bench/results/
# Heatmap of the unmasked model (5 lengths in 500-4000 x 4 depths x the first 2 needles).
run retmask niah --min-len 500 --max-len 4000 --num-lengths 5 --num-depths 4 --num-needles 2 --no-progress \
    --out bench/results/niah_smollm2.json --plot bench/results/niah_smollm2.png \
    --title "NIAH: SmolLM2-135M-Instruct (embedded), no heads masked" | tee "$OUT/niah.txt"
