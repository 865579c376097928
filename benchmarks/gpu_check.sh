#!/bin/bash
# The GPU code paths on one CUDA machine, short: the README's first command (the embedded build
# runs on the CPU by design; the distillation on the GPU), then real speculative decoding of
# its draft on the GPU in float32, bfloat16 and float16, greedy and at T = 1, at batch 1 and 8
# (each T = 0 configuration's greedy check: near-ties and real errors), a profile of where each
# dtype's time goes (benchmarks/gpu_profile.py), and one summary (OUT_DIR/summary.txt).
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

for dtype in float32 bfloat16 float16; do
    for batch in 1 8; do
        prompts=$((batch == 1 ? 4 : 16))
        step "speculate-$dtype-b$batch" 60 specdistill speculate --target embedded:code-deep \
            --draft "$RUNS/code/final" --prompts benchmarks/prompts/HumanEval.jsonl.gz \
            --num-prompts "$prompts" --gamma 1,4,auto --temperature 0,1 --batch-size "$batch" \
            --max-new-tokens 96 --device cuda --dtype "$dtype" \
            --out "$RUNS/spec-$dtype-b$batch" --overwrite
        cp "$RUNS/spec-$dtype-b$batch/report.md" "$OUT/speculate-$dtype-b$batch.md" 2>/dev/null
        cp "$RUNS/spec-$dtype-b$batch/report.json" "$OUT/speculate-$dtype-b$batch.json" 2>/dev/null
    done
done

# where each dtype's time goes: operators, conversions, host reads and syncs per token
step profile 60 python -m benchmarks.gpu_profile --num-prompts 2 --target embedded:code-deep \
    --draft "$RUNS/code/final" --device cuda --dtypes float32,bfloat16,float16 --out "$OUT"

# one summary: per dtype and batch, speedup and τ per configuration, and the greedy check
python3 - "$OUT" >"$OUT/summary.txt" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for path in sorted(out.glob("speculate-*.json")):
    report = json.loads(path.read_text())
    for c in report.get("configs", []):
        check = c.get("greedy_check") or {}
        print(path.stem, c["name"], f"speedup {c.get('speedup')}", f"tau {c.get('tau')}",
              f"near-ties {check.get('near_ties', '-')}", f"real errors {check.get('real_errors', '-')}")
profile = out / "profile.json"
if profile.is_file():
    for s in json.loads(profile.read_text()):
        print("profile", json.dumps(s))
PY
cat "$OUT/summary.txt"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
