#!/usr/bin/env bash
# Reproduces bench/results/ablate_smollm2.{md,json,png}, ablate_smollm2_nonret.{json,png} (random heads
# drawn only from heads scoring < 0.1), ablate_smollm2_single_heads.json and niah_smollm2.{json,png} on
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
# Single non-retrieval heads of the draw that collapsed (random-k5-s2 of the non-retrieval curve).
run python - <<'PY'
import json, statistics, sys
import torch
import retmask
from retmask.evaluate.niah import evaluate_niah
from retmask.niah import default_haystack_text, load_needles
torch.set_num_threads(2)
model, tok = retmask.load_model()
out = {}
for head in [(1, 5), (26, 3), (26, 6), (29, 1), (29, 3)]:
    r = evaluate_niah(model, tok, lengths=[500, 1250, 2000], depths=[0, 50, 100], needles=load_needles()[:3],
                      haystack_text=default_haystack_text(), heads=[head], progress=False)
    out[f"{head[0]}-{head[1]}"] = {
        "mean": statistics.fmean(e["rouge1_recall"] for e in r.entries),
        "exact": sum(e["rouge1_recall"] == 1 for e in r.entries),
        "examples": [e["response"] for e in r.entries[:3]],
    }
    print(head, round(out[f"{head[0]}-{head[1]}"]["mean"], 3))
json.dump(out, open("bench/results/ablate_smollm2_single_heads.json", "w"), indent=1)
PY
# Heatmap of the unmasked model (5 lengths in 500-4000 x 4 depths x the first 2 needles).
run retmask niah --min-len 500 --max-len 4000 --num-lengths 5 --num-depths 4 --num-needles 2 --no-progress \
    --out bench/results/niah_smollm2.json --plot bench/results/niah_smollm2.png \
    --title "NIAH: SmolLM2-135M-Instruct (embedded), no heads masked" | tee "$OUT/niah.txt"
