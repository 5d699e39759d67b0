# Prefill/decode disaggregation on one H200, two processes sharing it (each with half the memory), in one
# call under 9 minutes (benchmarks/pd_bench.py does the measuring):
#   bash benchmarks/devrun_pd.sh                     on the device (Llama-3-8B shape, random weights), with
#                                                    .whl/ carried (the server's wheels)
#   SMOKE=1 PYTHON=/path/to/python bash benchmarks/devrun_pd.sh    the same plumbing on a CPU: the embedded
#       model (jaxserve/assets/tiny-adder), tiny prompts, a few seconds per run
# Steps, logged under $OUT (default /tmp/devrun_pd), each under its own timeout, never past DEADLINE (530 s):
#   0. the synthetic tokenizer of the 8B vocabulary (configs/llama3-8b-dummy-serve.yaml reads it)
#   (a) transfer: a receiver and a sender process, each cache.gpu_memory_utilization 0.45 and
#       XLA_PYTHON_CLIENT_MEM_FRACTION 0.47 (0.485 and 0.495 on an 80 GB GPU); KV of an 8K-token prompt
#       (512 blocks of 16 x 32 layers) moved REPS times through the device path (gather,
#       jax.experimental.transfer pull, scatter) and the host path (gather, device -> host, TCP, host ->
#       device, scatter); GB/s end to end and per phase, beside
#       a plain device copy of the same bytes in the sender -> transfer_device.json, transfer_host.json
#   (b) mixed: STREAMS steady decode streams (64-token prompts, 256 tokens each) plus one LONG-token prompt
#       every 1/RATE s for DURATION s, against
#         colocated      one `jaxserve serve` with gpu_memory_utilization 0.9
#         disaggregated  a prefill and a decode instance (0.45 each) behind `jaxserve router`
#       -> mixed_colocated.json, mixed_pd.json: decode ITL p50/p99, TTFT (short, long), output tokens/s;
#       every server precompiles its step shapes before it answers /health (a shape compiled on first use
#       would show as a TTFT and ITL spike). The steps' time limits are shares of DEADLINE.
# The summary (both JSONs side by side, and the decode instance's /pd/info step log after the mixed run:
# how many of its slowest steps came at or after a block install) is printed and written to
# $OUT/summary.json; then, last, one line per mixed run and per decode step log.
#   GPUS=2 bash benchmarks/devrun_pd.sh  on a machine of two GPUs: the prefill side (sender, prefill instance)
#       on GPU 0 and the decode side (receiver, decode instance) on GPU 1 (CUDA_VISIBLE_DEVICES), each with a
#       whole GPU's memory (gpu_memory_utilization 0.9); (a) adds a plain peer copy GPU 0 -> GPU 1 of the same
#       bytes in one process (pd_bench.py peer -> peer_copy.json); colocated is one server data-parallel over
#       both GPUs (T=1 x D=2)
#   bash benchmarks/devrun_pd.sh mps     (b) only, the disaggregated pair under CUDA MPS: a control daemon of
#       this script's own (pipe and log directories under $OUT/work, stopped at exit) lets the two instances'
#       kernels run side by side instead of time-slicing the GPU; the prefill instance is held to
#       PREFILL_SM_PERCENT (default 60) of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), the decode instance
#       takes any. Where nvidia-cuda-mps-control is missing, the mode says so and stops.
#       MPS_VARIANTS="PCT[:PRIO[:LOCAL]] ..." runs the disaggregated pair once per variant (->
#       mixed_pd_mpsPCTpPRIO[lLOCAL].json, decode_info_...json): the prefill instance at PCT% of the SMs and MPS
#       client priority PRIO (CUDA_MPS_CLIENT_PRIORITY: 0 normal, 1 below normal, so the decode instance's
#       kernels are scheduled first), the router's --local-prefill-max-tokens LOCAL (default LOCAL_PREFILL);
#       PCT "off" runs that pair outside MPS (time-sliced) in the same call (-> mixed_pd_nomps[lLOCAL].json);
#       COLOCATED=0 skips the colocated run. The runs share the deadline evenly. Below 100% of the SMs the
#       prefill instance runs with --xla_gpu_autotune_level=0: XLA's GEMM autotuner, timing kernels under
#       the limit, made its start-up compile take many minutes (and the compilation cache written at 100%
#       does not match); on an 80 GB GPU at 20% its precompile ran out of memory.
#   bash benchmarks/devrun_pd.sh pacing  (b2) only, once per value N of PACING (default "0"; at most two fit
#       the deadline beside the default): the decode instance with server.kv_install_blocks_per_step N
#       (0: each transfer's blocks at once) -> mixed_pd_N.json, decode_info_N.json, then paced at the
#       default (64) -> mixed_pd.json, decode_info.json
#   AB_PATCHES=a.patch[,b.patch] bash benchmarks/devrun_pd.sh ab   (b2) only, once per patch (applied, run,
#       reverted; the decode instance's run and step log -> mixed_pd_NAME.json, decode_info_NAME.json, NAME the
#       patch's file name without .patch and non-alphanumerics), then of the tree -> mixed_pd.json,
#       decode_info.json; the runs share the deadline evenly (at most two patches fit beside the tree)
#   bash benchmarks/devrun_pd.sh pd      (b2) only, at the defaults
#   bash benchmarks/devrun_pd.sh process (b2) only, twice: the decode instance's engine on a thread of its
#       server process (--engine-process false) -> mixed_pd_thread.json, decode_info_thread.json, then in its
#       own process (the default) -> mixed_pd.json, decode_info.json; the runs share the deadline evenly
#   SPY_DECODE=S (any mode with b2): once each disaggregated run's decode instance answers /health, py-spy
#       (from the carried .whl/) attaches to the process of its engine loop (the engine process, else the
#       server) and samples its threads with native frames SPY_RATE times a second (default 10) for S
#       seconds -> spy_decode_NAME.txt (raw collapsed stacks, idle frames included);
#       benchmarks/spy_summary.py's account of the engine loop's samples (all of them, those in block
#       installs, those in steps), first by state (idle, running, taking the GIL back, waiting for an
#       input's event or a device result), then by frame (SPY_DEPTH native frames a row, default 6) ->
#       spy_summary_NAME.txt, printed. The instance starts through benchmarks/ptraceable.py so that a
#       sibling may attach (under py-spy from the start, the native sampling of its XLA compile threads
#       stretches start-up to minutes).
#   LOCAL_PREFILL=N (any mode with b2): the router runs with --local-prefill-max-tokens N, so prompts of at
#       most N tokens (the steady streams' 64-token prompts at N >= 65) are prefilled on the decode instance
#       without a KV transfer, only the long prompts through the prefill instance
#   PREFILL_CHUNK=N (any mode): the prefill instance's steps hold at most N tokens (max_num_batched_tokens,
#       token rungs up to N), so a long prompt is prefilled in N-token chunks: shorter kernels for the decode
#       instance to wait behind on a shared GPU
set -o pipefail
MODE=${1:-all}
OUT=${OUT:-/tmp/devrun_pd}
DEADLINE=${DEADLINE:-530}
source benchmarks/devrun_common.sh
[ -n "${SMOKE:-}" ] || server_packages  # `jaxserve serve` and `router` in (b); on the device from the carried .whl/

if [ -n "${SMOKE:-}" ]; then
  cp jaxserve/configs/tiny.yaml "$W/half.yaml"; cp jaxserve/configs/tiny.yaml "$W/full.yaml"
  TOKENS=16 REPS=3 STREAMS=${STREAMS:-4} SHORT=4 OUTTOK=8 LONG=20 RATE=${RATE:-2} DURATION=${DURATION:-8}
  VOCAB=16
  export JAX_PLATFORMS=cpu
else
  # A warm machine may still run an earlier call's servers or MPS server, holding GPU memory: stop them first
  pkill -f "jaxserve.cli (serve|router)" 2>/dev/null; pkill -x nvidia-cuda-mps-server 2>/dev/null
  pkill -x nvidia-cuda-mps-control 2>/dev/null; sleep 2
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
  TOK=build/synthetic-tokenizer/llama3-8b
  $PY benchmarks/make_synthetic_tokenizer.py --model-config configs/models/llama3-8b/config.json --out $TOK \
    > "$W/tokenizer.log" 2>&1 || { echo "synthetic tokenizer failed"; tail -5 "$W/tokenizer.log"; exit 1; }
  # 8K-token prompts need max_model_len past 8192 tokens of KV: 8320, past the Llama-3 config's 8192
  # positions, so the Llama-3.1 config (the same shapes, 131072 positions; the transfer runs no model step).
  # Half the memory each: 0.45 on an H200; on an 80 GB GPU (H100) 0.45 leaves too few blocks for one
  # 8,320-token request beside the 8B weights, so each half takes 0.485 (HALF_MEM below follows).
  HALF_UTIL=0.45
  [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -ge 100000 ] || HALF_UTIL=0.485
  for pair in "half $HALF_UTIL" "full 0.9"; do
    set -- $pair
    sed -e "s|path: models/llama3-8b|path: $PWD/configs/models/llama3.1-8b|" \
        -e "s|tokenizer: ../build/|tokenizer: $PWD/build/|" \
        -e "s|max_model_len: 4096|max_model_len: 8320|" \
        -e "s|memory_fraction: 0.85|gpu_memory_utilization: $2|" \
        configs/llama3-8b-dummy-serve.yaml > "$W/$1.yaml"
  done
  TOKENS=8192 REPS=5 STREAMS=${STREAMS:-32} SHORT=64 OUTTOK=256 LONG=${LONG:-4096} RATE=${RATE:-0.5}
  DURATION=${DURATION:-60} VOCAB=32000
fi
# Where each side runs: one GPU shared by both (half the memory each), or GPUS=2 (a whole GPU each).
PREFILL_ENV=() DECODE_ENV=() COLOCATED_FLAGS=() HALF_MEM=0.47
[ "${HALF_UTIL:-0.45}" = 0.45 ] || HALF_MEM=0.495
if [ "${GPUS:-1}" = 2 ]; then
  PREFILL_ENV=(CUDA_VISIBLE_DEVICES=0) DECODE_ENV=(CUDA_VISIBLE_DEVICES=1) COLOCATED_FLAGS=(--data-parallel-size 2)
  HALF_MEM=0.92
  if [ -n "${SMOKE:-}" ]; then export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=2"
  else sed -i "s|gpu_memory_utilization: 0.45|gpu_memory_utilization: 0.9|" "$W/half.yaml"; fi
fi

if [ "$MODE" = mps ]; then
  command -v nvidia-cuda-mps-control > /dev/null || { echo "mps: nvidia-cuda-mps-control is not installed"; exit 1; }
  export CUDA_MPS_PIPE_DIRECTORY=$W/mps-pipe CUDA_MPS_LOG_DIRECTORY=$W/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "mps: the control daemon did not start"; exit 1; }
  trap 'cleanup; echo quit | nvidia-cuda-mps-control' EXIT
  PREFILL_BASE_ENV=("${PREFILL_ENV[@]}")
  PREFILL_ENV+=("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${PREFILL_SM_PERCENT:-60}")
  what="prefill instance at ${PREFILL_SM_PERCENT:-60}% of the SMs"; [ -z "${MPS_VARIANTS:-}" ] || what="variants $MPS_VARIANTS"
  echo "== mps: control daemon started ($what)"
elif [ "$MODE" != all ] && [ "$MODE" != pacing ] && [ "$MODE" != ab ] && [ "$MODE" != pd ] \
    && [ "$MODE" != process ]; then
  echo "unknown mode $MODE: all, mps, pacing, ab, pd or process"; exit 2
elif [ "$MODE" = ab ] && [ -z "${AB_PATCHES:-}" ]; then
  echo "ab: name the patches in AB_PATCHES (a comma list)"; exit 2
fi

# (a) transfer bandwidth
[ "$MODE" != all ] || {
echo "== ${SECONDS}s: transfer ($TOKENS tokens)"
P=$(port)
env "${DECODE_ENV[@]}" XLA_PYTHON_CLIENT_MEM_FRACTION=$HALF_MEM $PY benchmarks/pd_bench.py transfer --role recv \
  --config "$W/half.yaml" --port "$P" > "$W/recv.log" 2>&1 &
PIDS+=($!); RECV=$!
t=0; until grep -q "receiver ready" "$W/recv.log"; do
  kill -0 $RECV 2>/dev/null || break; sleep 1; t=$((t + 1)); [ $t -lt 240 ] || break
done
for M in device host; do
  env "${PREFILL_ENV[@]}" XLA_PYTHON_CLIENT_MEM_FRACTION=$HALF_MEM timeout "$(limit $((DEADLINE * 62 / 100)))" \
    $PY benchmarks/pd_bench.py transfer --role send \
    --config "$W/half.yaml" --peer "127.0.0.1:$P" --tokens $TOKENS --reps $REPS --method $M \
    --json "$OUT/transfer_$M.json" > "$W/send_$M.log" 2>&1 \
    || { echo "   transfer ($M) failed"; tail -n 5 "$W/send_$M.log" "$W/recv.log"; }
done
kill $RECV 2>/dev/null; wait $RECV 2>/dev/null
if [ "${GPUS:-1}" = 2 ]; then
  timeout "$(limit $((DEADLINE * 55 / 100)))" $PY benchmarks/pd_bench.py peer --mib 1024 --reps $REPS \
    --json "$OUT/peer_copy.json" > "$W/peer.log" 2>&1 || { echo "   peer copy failed"; tail -n 5 "$W/peer.log"; }
fi
}

SERVE="$PY -m jaxserve.cli serve --log-level warning --access-log false --precompile true"
MIXED="$PY benchmarks/pd_bench.py mixed --streams $STREAMS --short-len $SHORT --out-tokens $OUTTOK \
  --long-len $LONG --rate $RATE --duration $DURATION --vocab $VOCAB"

# (b1) colocated
[ "$MODE" = pacing ] || [ "$MODE" = ab ] || [ "$MODE" = pd ] || [ "$MODE" = process ] || [ "${COLOCATED:-1}" = 0 ] || {
echo "== ${SECONDS}s: mixed, colocated"
P=$(port)
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 $SERVE --config "$W/full.yaml" "${COLOCATED_FLAGS[@]}" --port "$P" \
  > "$W/colocated.log" 2>&1 &
PIDS+=($!); C=$!
if wait_up "http://127.0.0.1:$P" $C 300; then
  timeout "$(limit $((DEADLINE * 30 / 100)))" $MIXED --url "http://127.0.0.1:$P" --label colocated --json "$OUT/mixed_colocated.json" \
    > "$W/mixed_colocated.log" 2>&1 || { echo "   colocated run failed"; tail -5 "$W/mixed_colocated.log"; }
else
  echo "   colocated server did not start"; tail -5 "$W/colocated.log"
fi
kill $C 2>/dev/null; wait $C 2>/dev/null
}

# (b2) disaggregated: the same total memory
PREFILL_CFG=$W/half.yaml
if [ -n "${PREFILL_CHUNK:-}" ]; then
  PREFILL_CFG=$W/prefill.yaml
  $PY - "$W/half.yaml" "$PREFILL_CFG" "$PREFILL_CHUNK" <<'PYEOF'
import re, sys
text, chunk = open(sys.argv[1]).read(), int(sys.argv[3])
text = re.sub(r"max_num_batched_tokens: \d+", f"max_num_batched_tokens: {chunk}", text)
rungs = lambda m: "token_buckets: [" + ", ".join(str(t) for t in map(int, m.group(1).split(",")) if t <= chunk) + "]"
open(sys.argv[2], "w").write(re.sub(r"token_buckets: \[([^\]]*)\]", rungs, text))
PYEOF
  echo "   prefill instance: $PREFILL_CHUNK-token steps ($(grep token_buckets "$PREFILL_CFG" | xargs))"
fi
# pd_run NAME RESERVE_S [DECODE FLAGS...]: router + prefill + decode instance, the mixed run -> mixed_NAME.json,
# the decode instance's /pd/info after it -> decode_info${NAME#pd}.json
pd_run() {
  local name=$1 reserve=$2; shift 2
  echo "== ${SECONDS}s: mixed, disaggregated ($name${*:+: $*})"
  PP=$(port); DP=$(port); RP=$(port) launch=()
  [ -z "${SPY_DECODE:-}" ] || launch=($PY benchmarks/ptraceable.py)
  env "${DECODE_ENV[@]}" XLA_PYTHON_CLIENT_MEM_FRACTION=$HALF_MEM "${launch[@]}" $SERVE --config "$W/half.yaml" --port "$DP" \
    --pd-role decode "$@" \
    > "$W/decode${name#pd}.log" 2>&1 &
  PIDS+=($!); D=$!
  env "${PREFILL_ENV[@]}" XLA_PYTHON_CLIENT_MEM_FRACTION=$HALF_MEM $SERVE --config "$PREFILL_CFG" --port "$PP" \
    --pd-role prefill \
    > "$W/prefill${name#pd}.log" 2>&1 &
  PIDS+=($!); PF=$!
  $PY -m jaxserve.cli router --prefill "http://127.0.0.1:$PP" --decode "http://127.0.0.1:$DP" --port "$RP" \
    ${LOCAL_PREFILL:+--local-prefill-max-tokens $LOCAL_PREFILL} --log-level warning > "$W/router${name#pd}.log" 2>&1 &
  PIDS+=($!)
  if wait_up "http://127.0.0.1:$DP" $D 300 && wait_up "http://127.0.0.1:$PP" $PF 300; then
    if [ -n "${SPY_DECODE:-}" ]; then  # the engine loop: the decode instance's engine process, else its server
      SPY_PID=$(pgrep -P $D -f jaxserve.engine_process | head -1); SPY_PID=${SPY_PID:-$D}
      echo "   py-spy on pid $SPY_PID ($([ "$SPY_PID" = "$D" ] && echo server || echo engine) process)"
      py-spy record --pid $SPY_PID --native --idle --threads --rate "${SPY_RATE:-10}" --duration "$SPY_DECODE" \
        --format raw -o "$OUT/spy_decode_$name.txt" > "$W/spy_$name.log" 2>&1 &
      SPY=$!
    fi
    timeout "$(limit "$reserve")" $MIXED --url "http://127.0.0.1:$RP" --label "disaggregated${*:+ ($*)}" \
      --json "$OUT/mixed_$name.json" > "$W/mixed_$name.log" 2>&1 \
      || { echo "   disaggregated run failed"; tail -5 "$W/mixed_$name.log"; }
    curl -s "http://127.0.0.1:$DP/pd/info" > "$OUT/decode_info${name#pd}.json"
    curl -s "http://127.0.0.1:$RP/metrics" | grep '^jaxserve:router_events' > "$OUT/router_events_$name.txt"
    echo "   router: $(sed 's/jaxserve:router_events{event="\(.*\)"} \(.*\)/\1 \2/' "$OUT/router_events_$name.txt" | xargs)"
    if [ -n "${SPY_DECODE:-}" ]; then
      timeout 60 tail --pid=$SPY -f /dev/null; tail -2 "$W/spy_$name.log"
      $PY benchmarks/spy_summary.py "$OUT/spy_decode_$name.txt" --states --under _advance_installs --under PDEngine.step \
        --depth "${SPY_DEPTH:-6}" --top 10 > "$OUT/spy_summary_$name.txt" 2>&1; cat "$OUT/spy_summary_$name.txt"
    fi
  else
    echo "   PD instances did not start"; tail -n 5 "$W/decode${name#pd}.log" "$W/prefill${name#pd}.log"
  fi
  cleanup; PIDS=()
}
if [ "$MODE" = pacing ]; then
  set -- ${PACING:-0}; PACING_DONE=()
  for n in "$@"; do
    pd_run "pd_$n" $((DEADLINE * ($# - ${#PACING_DONE[@]}) * 30 / 100)) --kv-install-blocks-per-step "$n"
    PACING_DONE+=("$n")
  done
fi
if [ "$MODE" = ab ]; then
  IFS=, read -ra patches <<< "$AB_PATCHES"
  for i in "${!patches[@]}"; do
    patch=${patches[i]} name=$(basename "${patches[i]}" .patch)
    git apply "$patch" || { echo "git apply $patch failed"; exit 1; }
    pd_run "pd_${name//[^A-Za-z0-9]/}" $((DEADLINE * (${#patches[@]} - i) / (${#patches[@]} + 1)))
    git apply -R "$patch"
  done
fi
if [ "$MODE" = process ]; then
  pd_run pd_thread $((DEADLINE / 2)) --engine-process false
fi
if [ "$MODE" = mps ] && [ -n "${MPS_VARIANTS:-}" ]; then
  set -- $MPS_VARIANTS; left=$#
  DECODE_BASE_ENV=("${DECODE_ENV[@]}"); mkdir -p "$W/no-mps"
  for variant in "$@"; do
    IFS=: read -r pct prio local <<< "$variant"; prio=${prio:-0}
    if [ "$pct" = off ]; then  # both instances outside MPS (no daemon in their pipe directory): time-sliced
      PREFILL_ENV=("${PREFILL_BASE_ENV[@]}" "CUDA_MPS_PIPE_DIRECTORY=$W/no-mps")
      DECODE_ENV=("${DECODE_BASE_ENV[@]}" "CUDA_MPS_PIPE_DIRECTORY=$W/no-mps") name=pd_nomps
    else
      PREFILL_ENV=("${PREFILL_BASE_ENV[@]}" "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct" "CUDA_MPS_CLIENT_PRIORITY=$prio")
      DECODE_ENV=("${DECODE_BASE_ENV[@]}") name=pd_mps${pct}p$prio
      # (below all SMs, XLA's autotuner makes the start-up take many minutes: cuBLAS's own choices instead)
      [ "$pct" -ge 100 ] || PREFILL_ENV+=("XLA_FLAGS=${XLA_FLAGS:-} --xla_gpu_autotune_level=0")
    fi
    limit=${local:-${LOCAL_PREFILL:-}} left=$((left - 1))
    LOCAL_PREFILL=$limit pd_run "$name${limit:+l$limit}" $(((DEADLINE - SECONDS) * left / (left + 1) + 5))
  done
else
  pd_run pd 5
fi

echo "== ${SECONDS}s: done"
tar -czf "$OUT/pd_logs.tar.gz" -C "$OUT" work
$PY - "$OUT" <<'EOF' | tee "$OUT/summary.json"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
summary = {}
paced = sorted(path.stem[len("mixed_"):] for path in out.glob("mixed_pd_*.json"))  # pacing's runs: pd_N
for name in ("transfer_device", "transfer_host", "peer_copy", "mixed_colocated", *(f"mixed_{n}" for n in paced),
             "mixed_pd"):
    path = out / f"{name}.json"
    summary[name] = json.loads(path.read_text()) if path.exists() else None
for suffix in [n[len("pd"):] for n in paced] + [""]:  # each decode instance's step log (/pd/info "steps")
    info = out / f"decode_info{suffix}.json"
    try:
        summary[f"decode_steps{suffix}"] = json.loads(info.read_text()).get("steps") if info.exists() else None
    except ValueError:
        summary[f"decode_steps{suffix}"] = None
print(json.dumps(summary, indent=1))
EOF
# The mixed runs and decode step logs in one line each, last
$PY - "$OUT/summary.json" <<'PYEOF'
import json, sys
summary = json.load(open(sys.argv[1]))
for name, run in summary.items():
    if name.startswith("mixed_") and run:
        print(f"{name:18s} ITL p50 {run['itl_p50_ms']:.2f} / p99 {run['itl_p99_ms']:.2f} ms "
              f"({run['itl_p99_ms'] / run['itl_p50_ms']:.2f}x)  TTFT short p50 {run['ttft_short_p50_ms']:.1f}, long "
              f"p50 / p99 {run['ttft_long_p50_ms']:.0f} / {run['ttft_long_p99_ms']:.0f} ms  "
              f"{run['output_tokens_per_s']:.0f} tok/s  errors {run['errors']}")
    elif name.startswith("decode_steps") and run:
        steps, install = run["step_ms"], run.get("install_ms") or {}
        print(f"{name:18s} {run['count']} steps p50 / p90 / p99 {steps['p50']:.2f} / {steps['p90']:.2f} / "
              f"{steps['p99']:.2f} ms  install p50 {install.get('p50', 0):.2f} ms  slowest 1%: "
              + ", ".join(f"{k} {v:.1f}" for k, v in run["split_ms"]["slowest"].items()) + " ms")
PYEOF
