# Mixture-of-experts figures on an H200, each mode one call under 9 minutes; the table is printed last.
#   bash benchmarks/devrun_moe.sh [latency|gemm|throughput|ep|ep_tput|eplb]   on the device (default: latency)
#   SMOKE=1 PYTHON=/path/to/python bash benchmarks/devrun_moe.sh [MODE]    the same plumbing on a CPU: the
#       tiny Qwen3-MoE fixture (tests/fixtures/hf/qwen3_moe_8x2_sparse2) and a dense Qwen3 fixture,
#       float32, a few tokens; the grouped GEMM step only imports its script
# Modes (steps logged under $OUT/work, each under its own timeout and never past DEADLINE, 565 s):
#   latency     `jaxserve bench latency --precompile false` (only the shapes a run uses compile, on
#               first use; each model's later runs find them in the persistent cache), the MoE
#               (configs/qwen3-30b-a3b-dummy.yaml) then its dense peer of equal active parameters
#               (configs/qwen3-30b-a3b-dense-peer-dummy.yaml): batch 1 (128 in, 128 out), batch 64
#               (512 in, 64 out); about 6 minutes, most of it compiling the 48-layer MoE's shapes;
#               then the down projection's decode shapes (grouped GEMM, 1 and 64 tokens) if time is left
#   gemm        benchmarks/grouped_gemm.py without the dense einsum: both projections at 4096 tokens
#               (about 3 minutes, XLA's ragged_dot compiles slowly there), then down at 1, 8, 64 tokens
#   throughput  `jaxserve bench throughput`, TPUT_N prompts (default 200) of 1024 in / 256 out, dense
#               peer first (the MoE compiles ~8 shapes of ~25 s each on a cold cache)
# Expert parallelism, on a machine of two GPUs (issue 22's run 2; the E=2 config is written into $W from the
# MoE one with parallel.expert 2):
#   ep          batch 1 and batch 64 (as in latency) at E=1, then at E=2
#   ep_tput     throughput (as above) at E=1, then at E=2
#   eplb        benchmarks/eplb_bench.py at E=2 (a skewed workload: device load max/mean and tokens/s before
#               and after a rebalance), then benchmarks/profile_step.py at E=2, batch 64 (the all-to-all and
#               collective kernels' time per step in its kernel table; per layer: / 48)
# Then the table (benchmarks/moe_summary.py) to stdout and $OUT/summary.txt, $OUT/summary.json, and every
# log and report in $OUT/moe_logs.tar.gz (the device tool returns at most 8 files).
set -o pipefail
OUT=${OUT:-/tmp/devrun_moe}
DEADLINE=${DEADLINE:-565}
source benchmarks/devrun_common.sh
SHOW="^Decode:|^steady decode|^roofline|^experts:|^Throughput|^compiled|^(down|gate_up) +T=|^before|^after|^rebalance|nccl|all_to_all|all-to-all"
TPUT_N=${TPUT_N:-200}
if [ -n "${SMOKE:-}" ]; then
  MOE="--config configs/qwen3-30b-a3b-dummy.yaml --model tests/fixtures/hf/qwen3_moe_8x2_sparse2 --dtype float32
    --max-model-len 256"
  DENSE="--config configs/qwen3-30b-a3b-dense-peer-dummy.yaml --model tests/fixtures/hf/qwen3_gqa4_tied
    --dtype float32 --max-model-len 256"
  B1="--input-len 8 --output-len 8" B64="--batch-size 8 --input-len 16 --output-len 8" TPUT="--input-len 32 --output-len 8"
  TPUT_N=8
else
  MOE="--config configs/qwen3-30b-a3b-dummy.yaml" DENSE="--config configs/qwen3-30b-a3b-dense-peer-dummy.yaml"
  B1="--input-len 128 --output-len 128" B64="--batch-size 64 --input-len 512 --output-len 64"
  TPUT="--input-len 1024 --output-len 256"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total --format=csv,noheader
fi
BENCH="$PY -m jaxserve.cli bench"
COMMON="--disable-tqdm --precompile false"
# The MoE config at E=2 (parallel.expert 2), for the ep modes
sed -e "s|path: models/qwen3-30b-a3b|path: $PWD/configs/models/qwen3-30b-a3b|" configs/qwen3-30b-a3b-dummy.yaml \
  > "$W/moe_ep2.yaml"
printf 'parallel:\n  expert: 2\n' >> "$W/moe_ep2.yaml"
MOE_EP2=${MOE/--config configs\/qwen3-30b-a3b-dummy.yaml/--config $W/moe_ep2.yaml}
[ -z "${SMOKE:-}" ] || export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=2"

gemm() {  # NAME MAX_S ARGS...: benchmarks/grouped_gemm.py (only imported in SMOKE mode)
  local name=$1 max=$2; shift 2
  if [ -n "${SMOKE:-}" ]; then
    run "$name" 60 0 $PY -c "import benchmarks.grouped_gemm as g; assert {'gate_up', 'down'} <= set(g.PROJ)"
  else
    run "$name" "$max" 10 $PY benchmarks/grouped_gemm.py --no-dense "$@"
  fi
}
case "${1:-latency}" in
latency)
  run moe_b1 150 300 $BENCH latency $MOE $COMMON --batch-size 1 $B1 --num-iters-warmup 1 --num-iters 2 \
    --output-json $W/moe_b1.json
  run dense_b1 60 10 $BENCH latency $DENSE $COMMON --batch-size 1 $B1 --num-iters-warmup 1 --num-iters 2 \
    --output-json $W/dense_b1.json
  run moe_b64 170 10 $BENCH latency $MOE $COMMON $B64 --num-iters-warmup 1 --num-iters 1 \
    --output-json $W/moe_b64.json
  run dense_b64 60 10 $BENCH latency $DENSE $COMMON $B64 --num-iters-warmup 1 --num-iters 1 \
    --output-json $W/dense_b64.json
  gemm gemm_down 120 --proj down --tokens 1 64
  ;;
gemm)
  gemm gemm_4096 300 --proj down gate_up --tokens 4096
  gemm gemm_down 200 --proj down --tokens 1 8 64
  ;;
throughput)
  run dense_tput 120 10 $BENCH throughput $DENSE $COMMON --num-prompts $TPUT_N $TPUT --output-json $W/dense_tput.json
  run moe_tput 420 5 $BENCH throughput $MOE $COMMON --num-prompts $TPUT_N $TPUT --output-json $W/moe_tput.json
  ;;
ep)
  for e in 1 2; do
    cfg=$MOE; [ $e = 1 ] || cfg=$MOE_EP2
    run moe_e${e}_b1 150 10 $BENCH latency $cfg $COMMON --batch-size 1 $B1 --num-iters-warmup 1 --num-iters 2 \
      --output-json $W/moe_e${e}_b1.json
    run moe_e${e}_b64 150 10 $BENCH latency $cfg $COMMON $B64 --num-iters-warmup 1 --num-iters 1 \
      --output-json $W/moe_e${e}_b64.json
  done
  ;;
ep_tput)
  run moe_tput 270 270 $BENCH throughput $MOE $COMMON --num-prompts $TPUT_N $TPUT --output-json $W/moe_tput.json
  run moe_e2_tput 270 5 $BENCH throughput $MOE_EP2 $COMMON --num-prompts $TPUT_N $TPUT \
    --output-json $W/moe_e2_tput.json
  ;;
eplb)
  EPLB="--config $W/moe_ep2.yaml --expert 2"; [ -z "${SMOKE:-}" ] || EPLB="--smoke --redundant-experts 2"
  run eplb 300 200 $PY benchmarks/eplb_bench.py $EPLB --json $W/eplb.json
  run profile_e2 200 5 $PY benchmarks/profile_step.py $MOE_EP2 $COMMON $B64 --num-iters-warmup 1 --num-iters 1 \
    --top 30
  ;;
*)
  echo "unknown mode ${1}: latency, gemm, throughput, ep, ep_tput or eplb"; exit 2
  ;;
esac
echo "== ${SECONDS}s: done"
tar -czf "$OUT/moe_logs.tar.gz" -C "$OUT" work
$PY benchmarks/moe_summary.py "$W" --tput-label "$TPUT_N prompts, $TPUT" --json "$OUT/summary.json" | tee "$OUT/summary.txt"
rm -rf "$W"
