#!/bin/bash
# The GPU code paths on one CUDA machine, short: the README's first command (the embedded build
# runs on the CPU by design; the distillation on the GPU), then real speculative decoding of
# its draft on the GPU in float32 and bfloat16, greedy and at T = 1.
#
#   bash benchmarks/gpu_check.sh OUT_DIR
#
# Needs a CUDA torch and this package installed (`pip install -e .` after your CUDA torch).
# Each step is bounded by `timeout`; logs and reports go to OUT_DIR.
set -u
OUT=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
export SPECDISTILL_CACHE=${SPECDISTILL_CACHE:-/tmp/specdistill-gpu-cache} WANDB_MODE=disabled
RUNS=${RUNS:-/tmp/specdistill-gpu-runs}

step() {  # step NAME SECONDS CMD...: run CMD with a time limit, log to OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc, $((SECONDS - t0)) s"
    tail -n 12 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'cuda', torch.cuda.is_available(), 'cpus', torch.get_num_threads())"

step distill 300 specdistill distill --recipe recipes/code.yaml "train.output_dir=$RUNS/code"
cp "$RUNS/code/eval.json" "$OUT/distill-eval.json" 2>/dev/null

for dtype in float32 bfloat16; do
    step "speculate-$dtype" 90 specdistill speculate --target embedded:code-deep \
        --draft "$RUNS/code/final" --prompts benchmarks/prompts/HumanEval.jsonl.gz \
        --num-prompts 16 --gamma 1,4,auto --temperature 0,1 --batch-size 8 \
        --max-new-tokens 96 --device cuda --dtype "$dtype" --out "$RUNS/spec-$dtype" --overwrite
    cp "$RUNS/spec-$dtype/report.md" "$OUT/speculate-$dtype.md" 2>/dev/null
done
nvidia-smi --query-gpu=memory.used --format=csv,noheader
