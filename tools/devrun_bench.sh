# End-to-end decode and throughput figures on the device machine (Llama-3-8B shape, random bf16 weights),
# in one call; logs and JSON reports under $OUT.
#   bash tools/devrun_bench.sh [decode|throughput]
#   decode (default): the tight-loop peer, then `jaxserve bench latency` at batch 1 and at batch 64 /
#     context 2048, overlap on and off. The first bench process starts cold (empty compilation cache);
#     later ones start warm from the persistent cache.
#   throughput: `jaxserve bench throughput`, 1000 prompts of 1024 in / 256 out, overlap on.
#   startup: cold start (empty compilation cache, every bucket compiled) then warm start, batch 1.
#   startup64: startup, then batch 64 / ctx 2048 from the warm cache.
#   tp (on nvidia-h200-x2): batch-1 latency at T=1, then T=2 (configs/llama3-8b-dummy-tp2.yaml).
#   decode64: the peer, batch 1 and batch 64 / ctx 2048 (overlap on), T=2 when two GPUs, GPU test tier.
#   tp2 (on nvidia-h200-x2): the GPU tests of the all-reduce kernel and the engine, batch-1 latency at
#     T=1, T=2 (all_reduce auto: the one-shot kernel) and T=2 with XLA's, and XLA's graph-update log.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
BENCH="python3 -m jaxserve.cli bench"
CFG="--config configs/llama3-8b-dummy.yaml --disable-tqdm"
peer() {  # the tight-loop peer at batch 1 / ctx 128 and batch 64 / ctx 2048, both cache layouts; last $1 lines
  python3 benchmarks/tight_loop_decode.py --config-json configs/models/llama3-8b/config.json \
    --batch-sizes 1,64 --context 128,2048 --steps 64 --cache-layout blkh,bklh \
    --output-json $OUT/peer.json 2>&1 | grep -v Warning | tee $OUT/peer.log | tail -"$1"
}
case "${1:-decode}" in
decode)
  peer 8
  for overlap in true false; do
    $BENCH latency $CFG --batch-size 1 --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 3 \
      --async-scheduling $overlap --output-json $OUT/latency_b1_$overlap.json > $OUT/latency_b1_$overlap.log 2>&1
    tail -30 $OUT/latency_b1_$overlap.log
  done
  for overlap in true false; do
    $BENCH latency $CFG --batch-size 64 --input-len 2048 --output-len 128 --num-iters-warmup 1 --num-iters 2 \
      --async-scheduling $overlap --output-json $OUT/latency_b64_$overlap.json > $OUT/latency_b64_$overlap.log 2>&1
    tail -30 $OUT/latency_b64_$overlap.log
  done
  ;;
startup|startup64)
  # Cold then warm start (every bucket compiled) at batch 1; startup64 adds batch 64 / ctx 2048, warm.
  rm -rf ~/.cache/jaxserve/xla
  for start in cold warm; do
    $BENCH latency $CFG --batch-size 1 --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 2 \
      --output-json $OUT/startup_$start.json > $OUT/startup_$start.log 2>&1
    echo "== $start"; tail -6 $OUT/startup_$start.log
  done
  if [ "$1" = startup64 ]; then
    $BENCH latency $CFG --batch-size 64 --input-len 2048 --output-len 128 --num-iters-warmup 1 --num-iters 1 \
      --output-json $OUT/b64_warm.json > $OUT/b64_warm.log 2>&1; echo "== b64"; tail -6 $OUT/b64_warm.log
  fi
  ;;
tp)
  for cfg in llama3-8b-dummy llama3-8b-dummy-tp2; do
    $BENCH latency --config configs/$cfg.yaml --disable-tqdm --batch-size 1 --input-len 128 --output-len 256 \
      --num-iters-warmup 1 --num-iters 3 --precompile false --output-json $OUT/tp_$cfg.json > $OUT/tp_$cfg.log 2>&1
    tail -12 $OUT/tp_$cfg.log
  done
  ;;
throughput)
  $BENCH throughput $CFG --num-prompts 1000 --input-len 1024 --output-len 256 \
    --output-json $OUT/throughput.json > $OUT/throughput.log 2>&1
  tail -40 $OUT/throughput.log
  ;;
decode64)
  # The decode figures against the peer (both cache layouts) in one call, then T=2 (when two
  # GPUs) and the GPU test tier of the kernels and the engine (skip with SKIP_TP=1 / SKIP_TESTS=1).
  CFG1="--config configs/llama3-8b-dummy.yaml --disable-tqdm --precompile false"
  peer 6
  $BENCH latency $CFG1 --batch-size 1 --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 3 \
    --output-json $OUT/b1.json > $OUT/b1.log 2>&1; tail -11 $OUT/b1.log
  $BENCH latency $CFG1 --batch-size 64 --input-len 2048 --output-len 128 --num-iters-warmup 1 --num-iters 2 \
    --output-json $OUT/b64.json > $OUT/b64.log 2>&1; tail -11 $OUT/b64.log
  if [ -z "${SKIP_TP:-}" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    $BENCH latency --config configs/llama3-8b-dummy-tp2.yaml --disable-tqdm --precompile false --batch-size 1 \
      --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 3 --output-json $OUT/tp2_b1.json \
      > $OUT/tp2_b1.log 2>&1; tail -11 $OUT/tp2_b1.log
  fi
  [ -z "${SKIP_TESTS:-}" ] && python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_paged_attention_gpu.py \
    tests/test_engine_pallas.py 2>&1 | tail -3
  ;;
tp2)
  timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_all_reduce_gpu.py tests/test_engine_pallas.py \
    > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
  for run in "llama3-8b-dummy auto" "llama3-8b-dummy-tp2 auto" ${WITH_XLA:+"llama3-8b-dummy-tp2 xla"}; do
    set -- $run
    timeout 300 $BENCH latency --config configs/$1.yaml --disable-tqdm --precompile false --all-reduce $2 \
      --batch-size 1 --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 3 \
      --output-json $OUT/${1}_$2.json > $OUT/${1}_$2.log 2>&1
    echo "== $1 all_reduce=$2"; tail -11 $OUT/${1}_$2.log
  done
  # does the T=2 decode step's CUDA graph still get updated each step? (XLA's own log)
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 timeout 200 \
    python3 tools/profile_dispatch.py --config configs/llama3-8b-dummy-tp2.yaml --steps 20 > $OUT/vlog.log 2>&1
  grep -v "^[IW]1" $OUT/vlog.log | tail -9
  echo "graph updates in the last 40 log lines:"; grep -E "command_buffer_thunk|command_executor" $OUT/vlog.log | tail -40 \
    | grep -oE "num_commands=[0-9]+; updated_allocs=[0-9]+|Updated [0-9]+ commands" | sort | uniq -c
  ;;
final)
  # The single-GPU and T=2 figures in one call on nvidia-h200-x2 (T=1 runs use one of its GPUs).
  CFG1="--config configs/llama3-8b-dummy.yaml --disable-tqdm --precompile false"
  $BENCH throughput $CFG1 --num-prompts 1000 --input-len 1024 --output-len 256 \
    --output-json $OUT/throughput.json > $OUT/throughput.log 2>&1; tail -14 $OUT/throughput.log
  peer 6
  for overlap in true false; do
    $BENCH latency $CFG1 --batch-size 1 --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 3 \
      --async-scheduling $overlap --output-json $OUT/b1_$overlap.json > $OUT/b1_$overlap.log 2>&1
    tail -11 $OUT/b1_$overlap.log
    $BENCH latency $CFG1 --batch-size 64 --input-len 2048 --output-len 128 --num-iters-warmup 1 --num-iters 2 \
      --async-scheduling $overlap --output-json $OUT/b64_$overlap.json > $OUT/b64_$overlap.log 2>&1
    tail -11 $OUT/b64_$overlap.log
  done
  $BENCH latency --config configs/llama3-8b-dummy-tp2.yaml --disable-tqdm --precompile false --batch-size 1 \
    --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 3 --output-json $OUT/tp2_b1.json \
    > $OUT/tp2_b1.log 2>&1; tail -11 $OUT/tp2_b1.log
  python3 -m pytest -q -m gpu -p no:cacheprovider benchmarks/experimental/tests/test_flash_attention.py 2>&1 | tail -4
  ;;
esac
