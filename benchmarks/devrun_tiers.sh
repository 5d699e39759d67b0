# KV cache tiers on an H200 (Llama-3-8B shape, random weights), one call under 9 minutes; the table is
# printed last.
#   bash benchmarks/devrun_tiers.sh                    on the device
#   SMOKE=1 PYTHON=/path/to/python bash benchmarks/devrun_tiers.sh    the same plumbing on a CPU: the embedded
#       model (jaxserve/assets/tiny-adder), tiny shapes, about a minute
# Steps (logged under $OUT/work, each under its own timeout and never past DEADLINE, 540 s), most important
# first:
#   kv_tiers    benchmarks/kv_tiers.py on configs/llama3-8b-dummy.yaml: device <-> host copies of 512 blocks
#               through kv_transfer beside plain pinned copies, then 128 two-turn conversations (1024-token
#               prompts, 64 out, 64 appended) on a device pool a third of the working set, host tier off then
#               on. Memory: a block is 16 tokens x 128 KiB = 2 MiB; the working set is 128 x 140 blocks = 35 GiB,
#               the device pool ~12 GiB, the host tier 1.1 x the working set, ~39 GiB of the host's 128 GiB
#               (the bench's default 256 conversations would pin ~77 GiB)
#   preempt_recompute, preempt_swap, preempt_auto    `jaxserve bench throughput`, 128 prompts of 1024 in / 256
#               out on kv_tiers' device pool of 5973 blocks (~12 GiB: 93 prompts fit, about 74 requests at full
#               length, so decode preempts) with a 16 GiB host tier, --preemption-mode each in turn;
#               --precompile true, so elapsed_s (queueing to the last finish) excludes compiling; with the pool
#               of the kv_tiers engines (the KV cache's shape is part of every step program) the shapes come
#               from the persistent cache
# Then the table (benchmarks/tiers_summary.py; it reads kv_tiers.log when a cut-short run wrote no JSON) to
# stdout and $OUT/summary.txt, $OUT/summary.json, and every log and report in $OUT/tiers_logs.tar.gz.
#   bash benchmarks/devrun_tiers.sh multiturn      instead: `jaxserve bench multi-turn` (the product's bench, the
#       issue's workload) with the host tier off, then on, at each turn count of TURNS (default "3 4 2"): 128
#       conversations, 1024-token first prompts, 64 out and 64 appended per turn, one device pool for every
#       turn count (compiled once): a third of the bench's working set (conversations x the last turn's
#       prompt) at 3 turns, so 2.7x at 2 turns and 3.3x at 4; a 32 GiB host tier when on; then the table
#       (BLOCK=64: KV blocks of 64 tokens instead of the config's 16, the pool the same tokens; a tier move's
#       host cost is per block; CONCURRENCY=N: the bench's closed loop, --max-concurrency N, instead of rounds)
#   AB_PATCHES=A.patch[,B.patch] bash benchmarks/devrun_tiers.sh multiturn_ab    instead: 3 turns with the host
#       tier on, of the tree, then with the tier off, then with each patch alone (applied, run, reverted), then
#       of the tree again (the drift, skipped when DEADLINE comes first); the table (a row per tree, each
#       against the one off run)
#   bash benchmarks/devrun_tiers.sh trace      instead: the 3-turn closed loop (32 in the engine) with the host tier
#       on under benchmarks/host_timers.py, a jax.profiler trace of engine steps TRACE_STEPS (default 200:300);
#       the timers' table, then benchmarks/trace_waits.py's account of the slowest timed calls (what the
#       runtime and the device did while they waited); the Perfetto trace in $OUT
#       On GPUs the trace perturbs what it shows: CUPTI's buffer flushes hold the runtime's calls that run meanwhile
#       (a slow call in the trace may be the profiler's), and the first device read after the trace stops may fail
#       with CUDA_ERROR_LAUNCH_FAILED (a JAX GPU profiler fault), ending the bench; the trace is written before that
set -o pipefail
OUT=${OUT:-/tmp/devrun_tiers}
DEADLINE=${DEADLINE:-540}
source benchmarks/devrun_common.sh
SHOW="GB/s|^host_tier_o|^on / off|^Throughput|^KV cache|^compiled"
if [ -n "${SMOKE:-}" ]; then
  TIERS="--smoke"
  # 12 requests of 4 blocks (block size 4) on 12 blocks: three at a time, the rest preempted
  PRE="--num-prompts 12 --input-len 9 --output-len 6 --num-blocks 12 --host-kv-gib 0.001 --precompile false"
else
  TIERS="--config configs/llama3-8b-dummy.yaml --conversations 128 --prompt-len 1024 --output-len 64
    --append-len 64 --copy-blocks 512 --repeats 5"
  PRE="--config configs/llama3-8b-dummy.yaml --num-prompts 128 --input-len 1024 --output-len 256 --num-blocks 5973
    --host-kv-gib 16 --precompile true"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total --format=csv,noheader
  free -g | head -2
fi
# preempt MODE MAX_S RESERVE_S: one throughput bench with --preemption-mode MODE
preempt() {
  run "preempt_$1" "$2" "$3" $PY -m jaxserve.cli bench throughput $PRE --preemption-mode "$1" --disable-tqdm \
    --output-json "$W/preempt_$1.json"
}

if [ "${1:-}" = trace ]; then
  if [ -n "${SMOKE:-}" ]; then
    MT="--num-conversations 8 --first-len 8 --append-len 4 --output-len 4 --block-size 4 --precompile false
      --num-blocks 12 --host-kv-gib 0.01"
    STEPS=${TRACE_STEPS:-2:12}
  else
    MT="--config configs/llama3-8b-dummy.yaml --num-conversations 128 --first-len 1024 --append-len 64
      --output-len 64 --block-size 16 --precompile true --num-blocks 3413 --host-kv-gib 32"
    STEPS=${TRACE_STEPS:-200:300}
  fi
  SHOW="^Multi-turn|^TTFT|^KV cache|^TIMING"
  HOST_TIMERS_TRACE="$W/trace" HOST_TIMERS_TRACE_STEPS="$STEPS" run trace 300 0 $PY benchmarks/host_timers.py \
    bench multi-turn $MT --num-turns 3 --max-concurrency 32 --disable-tqdm
  echo "== ${SECONDS}s: done"
  find "$W/trace" -name perfetto_trace.json.gz -size -60M -exec cp {} "$OUT/" \;
  $PY benchmarks/trace_waits.py "$W/trace" | tee "$OUT/trace_waits.txt"
  rm -rf "$W/trace"
  exit
fi
if [ "${1:-}" = multiturn ] || [ "${1:-}" = multiturn_ab ]; then
  if [ -n "${SMOKE:-}" ]; then
    MT="--num-conversations 8 --first-len 12 --append-len 4 --output-len 4 --block-size 4 --precompile false"
    C=8 FIRST=12 STEP=8 BLOCK=4 HOST=0.01
  else
    BLOCK=${BLOCK:-16}
    MT="--config configs/llama3-8b-dummy.yaml --num-conversations 128 --first-len 1024 --append-len 64
      --output-len 64 --block-size $BLOCK --precompile true"
    C=128 FIRST=1024 STEP=128 HOST=32
  fi
  [ -z "${CONCURRENCY:-}" ] || MT="$MT --max-concurrency $CONCURRENCY"
  SHOW="^Multi-turn|^TTFT|^  turn|^KV cache"
  blocks=$((C * (FIRST + 2 * STEP) / BLOCK / 3))
  # mt TURNS TIER [NAME]: one bench at TURNS turns, host tier TIER (on / off), its report mt_t{TURNS}_{TIER}[_NAME]
  mt() {
    local name="mt_t$1_$2${3:+_$3}" host=()
    [ "$2" = off ] || host=(--host-kv-gib "$HOST")
    run "$name" 150 0 $PY -m jaxserve.cli bench multi-turn $MT --num-turns "$1" --num-blocks "$blocks" "${host[@]}" \
      --disable-tqdm --output-json "$W/$name.json"
  }
  if [ "$1" = multiturn ]; then
    for t in ${TURNS:-3 4 2}; do mt "$t" off; mt "$t" on; done
  else
    mt 3 on tree
    mt 3 off
    for patch in ${AB_PATCHES//,/ }; do
      name=$(basename "$patch" .patch)
      git apply "$patch" || { echo "git apply $patch failed"; exit 1; }
      mt 3 on "${name//[^A-Za-z0-9]/}"
      git apply -R "$patch"
    done
    mt 3 on treeagain
  fi
  echo "== ${SECONDS}s: done"
  tar -czf "$OUT/tiers_logs.tar.gz" -C "$OUT" work
  $PY benchmarks/tiers_summary.py "$W" --multi-turn --json "$OUT/summary.json" | tee "$OUT/summary.txt"
  rm -rf "$W"
  exit
fi
run kv_tiers 330 150 $PY benchmarks/kv_tiers.py $TIERS --output-json "$W/kv_tiers.json"
preempt recompute 100 90
preempt swap 90 45
preempt auto 90 5
echo "== ${SECONDS}s: done"
tar -czf "$OUT/tiers_logs.tar.gz" -C "$OUT" work
$PY benchmarks/tiers_summary.py "$W" --json "$OUT/summary.json" | tee "$OUT/summary.txt"
rm -rf "$W"
