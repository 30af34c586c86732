#!/usr/bin/env bash
# Every single-GPU check in one go, for a short GPU lease: logs and JSON land in OUT (default ./gpu-out).
#
#   bash benchmarks/gpu_checks.sh [OUT] [first|second|third|all]
#
# Runs, each under its own time limit so one stuck step cannot eat the lease: the runtime smoke (NCCL/bf16,
# resume, cp blocks, throughput), `autopar profile` of this GPU, the reference shape against torch.compile and
# Liger, the kernel benchmark, the optimizer step piece by piece (benchmarks/optimizer_step.py), predicted vs
# measured steps of three shapes on the measured profile (plan, run, diagnose), `autopar tune` on GPT 1.3B, the
# published H100 runs re-priced on the measured GPU, the fused fp32 gradient accumulation and sustained GEMM rate
# of NVIDIA's H100 recipes (benchmarks/wgrad_accumulation.py), their GEMMs cut into overlap pieces against the
# model (benchmarks/gemm_pieces.py) and the MoE grouped-GEMM run. About 18 minutes on one H100: more than one
# 15-minute lease, so PART runs half of them: `first` (profile, optimizer, the three plans, validate_h100, wgrad,
# pieces, smoke: about 8 minutes) or `second` (profile again, peers, kernels, tune, MoE, attention head dims:
# about 10); `third` (profile again, then the step's GEMM kernels under torch.profiler for GPT 350M and llama-1b
# beside the sampled clock, and the table re-timed against the models' shapes: about 5); default all. nvidia-smi
# samples the SM clock, power and throttle reasons every 250 ms into OUT/smi.csv throughout (the clock a workload settles at under the power cap moves its GEMM rate).
# Needs, besides PyTorch and Triton: pydantic, pulp, highspy (and liger-kernel for the Liger peer).
set -u
case ${1:-} in first|second|third|all) set -- gpu-out "$1";; esac  # `gpu_checks.sh first`: the first part into gpu-out
OUT=${1:-gpu-out}
PART=${2:-all}
case $PART in first|second|third|all) ;; *) echo "gpu_checks.sh: PART must be first, second, third or all, not '$PART'" >&2
  exit 2;; esac
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, report rc and time
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? $(( $(date +%s) - t0 ))s"
}
part() { [ "$PART" = all ] || [ "$PART" = "$1" ]; }  # part first|second|third: whether this run does that part
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python -c "import json; from benchmarks.profile_check import GPU_MODELS as M; [json.dump(M[k], open('$OUT/' + k + '.json', 'w')) for k in ('gpt-350m', 'gpt-1.3b')]"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv -lms 250 \
  > "$OUT/smi.csv" 2>&1 &
SMI=$!
trap 'kill $SMI 2>/dev/null' EXIT
step profile 300 python -m planner.cli profile --nproc 1 --out "$OUT/h100.yaml"
if part first; then
  step optimizer_step 150 python benchmarks/optimizer_step.py --profile "$OUT/h100.yaml" --json "$OUT/optimizer_step.json"
  for m in llama-1b "$OUT/gpt-1.3b.json" "$OUT/gpt-350m.json"; do
    n=$(basename "$m" .json)
    step "plan-$n" 200 bash -c "python -m planner.cli plan --model $m --cluster $OUT/h100.yaml --gpus 1 --global-batch 8 \
--out $OUT/$n.plan.json && rm -f $OUT/$n.jsonl && python -m planner.cli run $OUT/$n.plan.json --steps 20 --metrics-out $OUT/$n.jsonl && \
python -m planner.cli diagnose $OUT/$n.jsonl --warmup 5"
  done
  step validate_h100 120 python benchmarks/validate_h100.py --gpu-profile "$OUT/h100.yaml" --json "$OUT/validate_h100.json"
  step wgrad_accumulation 150 python benchmarks/wgrad_accumulation.py --sustain 20 --json "$OUT/wgrad.json"
  step gemm_pieces 90 python benchmarks/gemm_pieces.py --profile "$OUT/h100.yaml" --json "$OUT/pieces.json"
  step smoke 300 python tests/runtime/gpu_smoke.py
fi
if part second; then
  step single_gpu_step 400 python benchmarks/single_gpu_step.py --mbs 2 4 --peers compiled,liger --backends auto,native --json "$OUT/step.json"
  step kernels 300 python benchmarks/kernels.py --json "$OUT/kernels.json"
  step tune 300 python -m planner.cli tune --model "$OUT/gpt-1.3b.json" --cluster "$OUT/h100.yaml" --gpus 1 \
    --global-batch 8 --trials 3 --steps 10 --warmup 3
  step moe 200 bash -c "python -m planner.cli plan --model tiny-moe --cluster dgx-h100 --gpus 1 --global-batch 8 \
--out $OUT/moe.json && rm -f $OUT/moe.jsonl && python -m planner.cli run $OUT/moe.json --steps 5 --metrics-out $OUT/moe.jsonl"
  step attention_head_dim 60 python benchmarks/attention_head_dim.py --profile "$OUT/h100.yaml" --json "$OUT/head_dim.json"
fi
if part third; then  # the step's own GEMM kernels beside the sampled clock (OUT/smi.csv): session 32's open question
  step kernels_gpt 200 python benchmarks/single_gpu_step.py --mbs 8 --peers none --profile --model "$OUT/gpt-350m.json" \
    --json "$OUT/kernels_gpt.json"
  step kernels_llama 200 python benchmarks/single_gpu_step.py --mbs 2 --peers none --profile --json "$OUT/kernels_llama.json"
  step gemm_layouts 150 python benchmarks/profile_check.py gpu-gemm --profile "$OUT/h100.yaml" --json "$OUT/gemm.json"
fi
echo "logs in $OUT"
