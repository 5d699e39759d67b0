#!/usr/bin/env bash
# Where the host time of a decode step goes on the device machine (8B dummy, batch 1), T=1 and T=2.
#   bash tools/devrun_dispatch.sh trace   # profile + jax.profiler trace, command buffers on/off
#   bash tools/devrun_dispatch.sh flags   # host time of the step under XLA command-buffer options
#   bash tools/devrun_dispatch.sh kernel  # T=2 with the one-shot all-reduce kernel: traces, update log
#   bash tools/devrun_dispatch.sh state   # T=1 / T=2 latency, then traces: device ms per step by kernel kind
#   bash tools/devrun_dispatch.sh ar      # the all-reduce kernels: GPU tests, latency; T=2 latency + trace
#   bash tools/devrun_dispatch.sh ratio   # GPU tests; T=1 and T=2 latency, default flags and SKIP_TEMP
#   bash tools/devrun_dispatch.sh buckets # T=1 / T=2 latency with the configs' token buckets, then with 1 and 4 added
#   bash tools/devrun_dispatch.sh cublas  # decode GEMMs with XLA's Triton GEMMs on/off; T=1 / T=2 latency off
#   bash tools/devrun_dispatch.sh t2 | hostcost  # T=2 with and without SKIP_TEMP; XLA's graph-update log
#   bash tools/devrun_dispatch.sh loop    # engine step period vs forwards queued back to back, T=1 and T=2
#   bash tools/devrun_dispatch.sh steady  # traces of 10 overlapped steps, T=1 and T=2: idle gaps, all-reduce skew
#   bash tools/devrun_dispatch.sh ab      # this tree against the files under .alt/ (same paths): GPU tests
#                                             (AB_TESTS=... to choose them), latency
# Logs and traces under $OUT; a table last.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T1=configs/llama3-8b-dummy.yaml
T2=configs/llama3-8b-dummy-tp2.yaml
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
SUMMARY=()
run() {  # name config xla_flags [trace [steady]]: steady traces 10 overlapped steps, without the json
  local name=$1 config=$2 flags=$3 trace=${4:-} steady=${5:-}
  local extra="${EXTRA:-}" steps=5
  [ -n "$steady" ] && extra="$extra --overlap --trace-steps 10" && steps=10
  echo "=== $name ($config, XLA_FLAGS='$flags')"
  XLA_FLAGS="$flags" timeout 240 python3 tools/profile_dispatch.py --config "$config" --steps 20 $extra \
    ${trace:+--trace /tmp/trace_$name} > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -10 "$OUT/$name.log"
  SUMMARY+=("$name rc=$rc $(grep -E '^  (forward|sample|prepare) ' "$OUT/$name.log" | awk '{printf "%s=%s ", $1, $2}')")
  grep -q "^loop of" "$OUT/$name.log" && SUMMARY+=("  $(grep "^loop of" "$OUT/$name.log")")
  if [ -n "$trace" ]; then
    python3 tools/trace_summary.py "/tmp/trace_$name" --top 16 --steps $steps --by-kernel --gaps \
      > "$OUT/${name}_trace.txt" 2>&1
    [ -n "$steady" ] || cp "$(find /tmp/trace_$name -name '*.json.gz' | head -1)" "$OUT/$name.json.gz" 2>/dev/null
    SUMMARY+=("$name trace: $(grep -E 'span .* ms/step|all-reduce kernels' "$OUT/${name}_trace.txt" | tr '\n' ' ')")
  fi
}
gpu_tests() {  # the GPU tier of the given test files; its last line into the summary
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > "$OUT/tests.log" 2>&1
  SUMMARY+=("tests: $(tail -1 "$OUT/tests.log")"); grep -E "^FAILED|Error" "$OUT/tests.log" | head
}
latency() {  # name config [xla_flags]: batch-1 decode (128 in, 256 out, overlap on) into the summary
  XLA_FLAGS="${3:-}" timeout 300 python3 -m jaxserve.cli bench latency --config "$2" --disable-tqdm \
    --precompile false --batch-size 1 --input-len 128 --output-len 256 --num-iters-warmup 1 --num-iters 3 \
    > "$OUT/$1.log" 2>&1
  SUMMARY+=("$1: $(grep -iE 'decode|step  ms|idle' "$OUT/$1.log" | head -4 | tr '\n' ' ')")
}
SKIP_TEMP=--xla_gpu_command_buffer_update_mode=SKIP_TEMP
case ${1:-flags} in
  ar)  # the all-reduce kernels' GPU tests and latency, then T=2 batch-1 latency and a trace
    gpu_tests tests/test_all_reduce_gpu.py
    timeout 200 python3 benchmarks/all_reduce.py > "$OUT/all_reduce.log" 2>&1; tail -12 "$OUT/all_reduce.log"
    latency t2_latency $T2
    run t2 $T2 "" trace
    head -5 "$OUT/t2_trace.txt"
    ;;
  t2)  # GPU tests; T=2 batch-1 latency with default flags and with SKIP_TEMP; T=2 host profile (SKIP_TEMP)
    gpu_tests tests/test_all_reduce_gpu.py tests/test_engine_pallas.py
    latency t2_latency $T2
    latency t2_latency_skiptemp $T2 $SKIP_TEMP
    run t2_prof_skip $T2 $SKIP_TEMP
    ;;
  ratio)  # GPU tests; batch-1 latency T=1 and T=2 with default flags, then both with SKIP_TEMP (KV sized by the driver)
    gpu_tests tests/test_all_reduce_gpu.py tests/test_engine_pallas.py
    latency t1_latency $T1
    latency t2_latency $T2
    latency t1_latency_skiptemp $T1 $SKIP_TEMP
    latency t2_latency_skiptemp $T2 $SKIP_TEMP
    ;;
  buckets)  # GPU tests; batch-1 latency T=1 and T=2 with the configs' buckets, then with token buckets 1 and 4
    gpu_tests tests/test_engine_pallas.py
    latency t1_latency $T1
    latency t2_latency $T2
    for c in $T1 $T2; do sed 's/token_buckets: \[16,/token_buckets: [1, 4, 16,/' $c > ${c%.yaml}-small.yaml; done
    latency t1_small ${T1%.yaml}-small.yaml
    latency t2_small ${T2%.yaml}-small.yaml
    rm -f ${T1%.yaml}-small.yaml ${T2%.yaml}-small.yaml  # (beside the originals: model.path is relative)
    ;;
  cublas)  # decode GEMMs through XLA's dot with Triton GEMMs on and off, then T=1 / T=2 latency with them off
    NOTRITON=--xla_gpu_enable_triton_gemm=false
    for flags in "" "$NOTRITON" "$NOTRITON --xla_gpu_enable_cublaslt=true"; do
      XLA_FLAGS="$flags" timeout 120 python3 benchmarks/decode_gemm.py --xla-only --tp 1 2 > "$OUT/gemm.log" 2>&1
      SUMMARY+=("decode_gemm XLA_FLAGS='$flags'" "$(grep -E '^tp=' "$OUT/gemm.log" | cut -c1-46)")
    done
    latency t1_notriton $T1 $NOTRITON
    latency t2_notriton $T2 $NOTRITON
    ;;
  hostcost)  # GPU tests; T=2 with SKIP_TEMP; graph updates of the T=2 engine under overlap (XLA's log)
    gpu_tests tests/test_all_reduce_gpu.py tests/test_engine_pallas.py
    latency t2_latency_skiptemp $T2 $SKIP_TEMP
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 timeout 200 \
      python3 -m jaxserve.cli bench latency --config $T2 --disable-tqdm --precompile false --batch-size 1 \
      --input-len 128 --output-len 64 --num-iters-warmup 0 --num-iters 1 > "$OUT/t2_overlap_vlog.log" 2>&1
    grep -E "command_buffer_thunk|command_executor" "$OUT/t2_overlap_vlog.log" | tail -300 \
      | grep -oE "num_commands=[0-9]+; updated_allocs=[0-9]+|Updated [0-9]+ commands" | sort | uniq -c
    ;;
  loop)  # step period of the engine under overlap vs decode forwards queued back to back, T=1 and T=2
    EXTRA="--loop 200"
    run t1_loop_skip $T1 $SKIP_TEMP
    run t2_loop_skip $T2 $SKIP_TEMP
    run t2_loop $T2 ""
    ;;
  steady)  # traces of 10 steps under overlap (the engine's loop), T=1 and T=2: gaps on each GPU, skew
    # NOTE: the profiler slows the host enough that these steps are host-bound (benchmarks/RESULTS.md)
    run t1s $T1 "" trace steady
    run t2s $T2 "" trace steady
    ;;
  ab)  # this tree, then with .alt/'s files over it (same relative paths): GPU tests, T=1 / T=2 latency
    latency t1_a $T1
    latency t2_a $T2
    [ -d .alt ] || { echo "ab: no .alt/ here (carry it)" >&2; exit 2; }
    (cd .alt && find . -type f) | while read -r f; do mkdir -p "$(dirname "$f")"; cp ".alt/$f" "$f"; done
    gpu_tests ${AB_TESTS:-tests/test_paged_attention_gpu.py tests/test_engine_pallas.py}
    latency t1_b $T1
    latency t2_b $T2
    run t2_b_prof $T2 "" trace  # kernels per step (a trace without overlap)
    ;;
  state)  # batch-1 latency T=1 and T=2 (overlap on), then traces of both: device ms per step by kernel kind
    latency t1_latency $T1
    latency t2_latency $T2
    run t1 $T1 "" trace
    run t2 $T2 "" trace
    head -3 "$OUT/t1_trace.txt" "$OUT/t2_trace.txt"
    ;;
  trace)
    run t1 $T1 "" trace
    run t1_nocb $T1 "--xla_gpu_enable_command_buffer=" trace
    run t2 $T2 "" trace
    ;;
  skiptemp)
    run t1 $T1 ""
    run t1_skip $T1 "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    run t2_skip $T2 "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    run t2_coll_skip $T2 "$CB,COLLECTIVES --xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    run t2_coll_skip_tr $T2 "$CB,COLLECTIVES --xla_gpu_command_buffer_update_mode=SKIP_TEMP" trace
    python3 -c "import jax; print(jax.devices()[0].memory_stats())" > "$OUT/vmm_stats.txt" 2>&1
    XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP python3 -c "import jax; print(jax.devices()[0].memory_stats())" >> "$OUT/vmm_stats.txt" 2>&1
    cat "$OUT/vmm_stats.txt"
    ;;
  oneshot)
    NO1="--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false"
    run t2 $T2 ""
    run t2_no1 $T2 "$NO1"
    run t2_no1_coll $T2 "$NO1 $CB,COLLECTIVES"
    run t2_no1_coll_tr $T2 "$NO1 $CB,COLLECTIVES" trace
    run t1_coll $T1 "$CB,COLLECTIVES"
    ;;
  overlap)  # T=2 engine with overlap: does the step's graph get updated? then a trace without overlap
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 timeout 200 \
      python3 -m jaxserve.cli bench latency --config $T2 --disable-tqdm --precompile false --batch-size 1 \
      --input-len 128 --output-len 64 --num-iters-warmup 0 --num-iters 1 > "$OUT/t2_overlap_vlog.log" 2>&1
    grep -v "^[IW]1" "$OUT/t2_overlap_vlog.log" | tail -6
    grep -E "command_buffer_thunk|command_executor" "$OUT/t2_overlap_vlog.log" | tail -200 \
      | grep -oE "num_commands=[0-9]+; updated_allocs=[0-9]+|Updated [0-9]+ commands in [0-9]+" | sed 's/in [0-9]*$//' | sort | uniq -c
    run t2 $T2 "" trace
    ;;
  kernel)  # T=2 with the one-shot all-reduce kernel (parallel.all_reduce auto): graphs and updates
    run t1 $T1 "" trace
    run t2 $T2 "" trace
    run t2_skip $T2 "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_cmd=1,command_executor=1 \
      timeout 200 python3 tools/profile_dispatch.py --config $T2 --steps 3 > "$OUT/t2_vlog.log" 2>&1
    grep -E "updated_allocs|Updated [0-9]+ commands" "$OUT/t2_vlog.log" | tail -8
    ;;
  flags)
    run t1 $T1 ""
    for mode in NEVER_UPDATE CAPTURE_CMD_NEVER_UPDATE VMM_PERSISTENT_TEMP SKIP_TEMP; do
      run "t1_$mode" $T1 "--xla_gpu_command_buffer_update_mode=$mode"
    done
    run t2 $T2 ""
    run t2_coll $T2 "$CB,COLLECTIVES"
    for mode in NEVER_UPDATE CAPTURE_CMD_NEVER_UPDATE VMM_PERSISTENT_TEMP SKIP_TEMP; do
      grep -q "^  forward" "$OUT/t1_$mode.log" && run "t2_coll_$mode" $T2 "$CB,COLLECTIVES --xla_gpu_command_buffer_update_mode=$mode"
    done
    # which allocations change between steps (XLA's own log)
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_buffer_cmd=1,command_executor=1 \
      timeout 200 python3 tools/profile_dispatch.py --config $T1 --steps 3 > "$OUT/t1_vlog.log" 2>&1
    grep -E "updated_allocs|Updated [0-9]+ commands" "$OUT/t1_vlog.log" | tail -6
    ;;
esac
printf '%s\n' "${SUMMARY[@]}"
# PACK=1: the logs in one archive (the device tool returns at most 8 files)
if [ -n "${PACK:-}" ]; then
  shopt -s nullglob
  (cd "$OUT" && files=(./*.log ./*.txt) && { [ ${#files[@]} -eq 0 ] || tar czf "logs_${1:-flags}.tgz" --remove-files "${files[@]}"; })
fi
