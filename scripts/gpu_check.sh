#!/usr/bin/env bash
# What a lab with one CUDA GPU runs first: the CUDA path checked and timed at Stable Diffusion
# v1-4's size, in one command, in about ten minutes on an H100-class card.
#
#     scripts/gpu_check.sh OUT_DIR
#
# Stages, most valuable first; each has its own time cap, a failed stage is logged and the next
# one still runs, and stages that no longer fit in GPU_CHECK_BUDGET_S (default 900) are skipped
# with a line saying so (GPU_CHECK_ONLY="cuda-tests sd-proof" runs only the stages named):
#   1. `pytest -m cuda tests/test_cuda.py`: every one-shot method's upload, training set and
#      classifier on the GPU (fp16 LDM, fp16 autocast classifier) against the CPU in float32,
#      and fp16 concept gradients with loss scaling against float32.
#   2. SD v1-4's architecture with random weights (scripts/build_sd_architecture.py), unless
#      SD_MODEL already holds a build.
#   3. scripts/sd_proof.py --device cuda: two institutions and a server through the real
#      SuperLink/SuperNodes and `flwr run` at 512 px; time and GPU memory per phase. Then
#      (sim-gpu) the README's one-GPU-box simulation command, conf/sd-v1-4-gpu.toml with three
#      simulated clients on Ray sharing the card with the ServerApp (--engine simulation).
#   4. `fedbip speed` at 512 px: half precision at the paper's 50 PNDM steps (the project's loop
#      against the stock pipeline, both fp16); float32 at 10 steps with the same-images check
#      and the matmul peaks; the concept step against the textual-inversion recipe and the
#      classifier's steps/s; torch.compile; every sampler (run config scheduler) at 10, 25 and 50
#      steps; the compiled UNet given a pass's smaller last batch, padded to the full batch and not.
# Writes OUT_DIR/gpu_check.log, one JSON per stage and OUT_DIR/summary.md, the page to read first
# (scripts/gpu_summary.py; docs/benchmarks/gpu.md has an H200's and an H100's figures to compare
# with).
set -u
OUT=${1:?usage: scripts/gpu_check.sh OUT_DIR}
SD_MODEL=${SD_MODEL:-/tmp/sd-v1-4-random}
BUDGET=${GPU_CHECK_BUDGET_S:-900}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$ROOT" || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 FEDBIP_PROJECT_DIR="$ROOT" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
ONLY=${GPU_CHECK_ONLY:-}  # e.g. "cuda-tests sd-proof": run only these stages
LOG="$OUT/gpu_check.log"
START=$SECONDS

# stage NAME CAP_S COMMAND...: runs COMMAND under min(CAP_S, what is left of the budget)
stage() {
    local name=$1 cap=$2
    shift 2
    if [[ -n $ONLY && " $ONLY " != *" $name "* ]]; then
        return 0
    fi
    local left=$((BUDGET - (SECONDS - START)))
    if ((left < 30)); then
        echo "== $name: skipped, ${left}s of the budget left" | tee -a "$LOG"
        return 0
    fi
    ((cap > left)) && cap=$left
    echo "== $name (cap ${cap}s) at +$((SECONDS - START))s: $*" | tee -a "$LOG"
    local began=$SECONDS
    timeout --kill-after=10 "$cap" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - began))s" | tee -a "$LOG"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), '| diffusers', diffusers.__version__, '| transformers', transformers.__version__)"
    nproc
} >>"$LOG" 2>&1

stage cuda-tests 240 "$PY" -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider -s
stage build-sd 240 "$PY" scripts/build_sd_architecture.py "$SD_MODEL"
WORK=${GPU_CHECK_WORK:-/tmp/gpu-check}  # the proof's run folder (payloads, shards, classifier)
rm -f "$WORK/sd-proof/proof.json"  # never summarize an earlier run's record
stage sd-proof 300 "$PY" scripts/sd_proof.py "$WORK/sd-proof" --device cuda --model "$SD_MODEL" --timeout 280
cp "$WORK/sd-proof/proof.json" "$OUT/sd_gpu_proof.json" 2>/dev/null
tail -n 40 "$WORK"/sd-proof/logs/*.log >"$OUT/sd_proof_logs.txt" 2>/dev/null
rm -f "$WORK/sim-gpu/proof.json"
stage sim-gpu 300 "$PY" scripts/sd_proof.py "$WORK/sim-gpu" --engine simulation --device cuda --model "$SD_MODEL" --timeout 280
cp "$WORK/sim-gpu/proof.json" "$OUT/sd_gpu_simulation.json" 2>/dev/null
tail -n 60 "$WORK"/sim-gpu/logs/*.log "$WORK"/sim-gpu/flwr-home/local-superlink/*.log >"$OUT/sim_logs.txt" 2>/dev/null

speed() {  # speed NAME CAP ARGS...: fedbip speed at 512 px on the GPU, one JSON per call
    local name=$1 cap=$2
    shift 2
    stage "speed-$name" "$cap" "$PY" -m fedbip_tools.speed --device cuda --model "$SD_MODEL" \
        --image-size 512 --repeats 1 --out "$OUT/speed_$name.json" --markdown "$WORK/speed_$name.md" "$@"
}
speed half 150 --cases synth-stock-half,synth-project-half,synth-project-half-cl --batch 8 --steps 50 --guidance 7.5
speed float32 150 --cases synth-check,synth-stock,synth-project,matmul --batch 4 --steps 10 --guidance 7.5
speed concept 150 --cases concept-project,concept-recipe,classifier --concept-images 16
speed compile 200 --cases synth-project-half-compile --batch 8 --steps 50 --guidance 7.5
speed sampler 150 --cases sampler-sweep --batch 8 --sweep-steps 10,25,50 --guidance 7.5
speed compile-bucket 300 --cases compile-bucket --batch 8 --steps 10 --guidance 7.5
echo "== done in $((SECONDS - START))s" | tee -a "$LOG"
"$PY" scripts/gpu_summary.py "$OUT" >/dev/null && echo "summary: $OUT/summary.md"
