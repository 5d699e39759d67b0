# `jaxserve serve` with the engine on a thread of the server process against in its own process
# (server.engine_process false / true), the same `jaxserve bench serve` load on each, REPS times, alternating:
#   bash benchmarks/serve_ab.sh                         the embedded model on this machine (CPU or a device)
#   CONC=32 bash benchmarks/serve_ab.sh                 a closed loop of 32 streams (--max-concurrency) instead of
#                                                       RATE requests a second
# Environment: RATE (default 120; "inf" with CONC), CONC, NUM (600 prompts), IN (8), OUT_LEN (20), REPS ("1 2"),
# SERVE_ARGS (more `jaxserve serve` flags, e.g. --config ...), TOKENIZER (default the embedded model's), PYTHON.
# Per run: output tok/s, ITL and TTFT percentiles, and the CPU seconds of the server process and of its
# engine process over the load (from /proc), one line each; the bench JSONs go to $OUT (default /tmp/serve_ab).
set -o pipefail
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/serve_ab}
mkdir -p "$OUT"
RATE=${RATE:-120} NUM=${NUM:-600} IN=${IN:-8} OUT_LEN=${OUT_LEN:-20}
TOKENIZER=${TOKENIZER:-jaxserve/assets/tiny-adder}
[ -z "${CONC:-}" ] || RATE=inf
cpu() { [ -n "$1" ] && awk '{printf "%.2f", ($14 + $15) / 100}' "/proc/$1/stat" 2>/dev/null || echo 0; }
for rep in ${REPS:-1 2}; do
  for mode in false true; do
    port=$((20000 + RANDOM % 20000))
    $PY -m jaxserve.cli serve --port $port --engine-process $mode --log-level warning --access-log false \
      ${SERVE_ARGS:-} > "$OUT/serve_${mode}_$rep.log" 2>&1 &
    server=$!
    until curl -s "127.0.0.1:$port/health" > /dev/null; do
      kill -0 $server 2>/dev/null || { echo "the server did not start:"; tail -20 "$OUT/serve_${mode}_$rep.log"; exit 1; }
      sleep 0.5
    done
    engine=$(pgrep -P $server -f jaxserve.engine_process | head -1)
    s0=$(cpu $server) e0=$(cpu "$engine")
    $PY -m jaxserve.cli bench serve --base-url "http://127.0.0.1:$port" --tokenizer "$TOKENIZER" --num-prompts $NUM \
      --random-input-len $IN --random-output-len $OUT_LEN --ignore-eos --request-rate $RATE \
      ${CONC:+--max-concurrency $CONC} --disable-tqdm --metric-percentiles 50,90,99 --seed $rep \
      --output-json "$OUT/bench_${mode}_$rep.json" > "$OUT/bench_${mode}_$rep.log" 2>&1 \
      || { tail -20 "$OUT/bench_${mode}_$rep.log"; kill $server; exit 1; }
    s1=$(cpu $server) e1=$(cpu "$engine")
    kill $server; wait $server 2>/dev/null
    $PY - "$OUT/bench_${mode}_$rep.json" "$mode" "$rep" "$s0" "$s1" "$e0" "$e1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
s0, s1, e0, e1 = map(float, sys.argv[4:8])
print(f"rep {sys.argv[3]} engine_process={sys.argv[2]:5s} ok {r['completed']} failed {r['failed']} "
      f"{r['output_throughput']:.0f} out tok/s  ITL p50/p90/p99 {r['p50_itl_ms']:.2f}/{r['p90_itl_ms']:.2f}/"
      f"{r['p99_itl_ms']:.2f} ms  TTFT p50 {r['p50_ttft_ms']:.1f} ms  CPU s: server {s1 - s0:.2f}, engine process "
      f"{e1 - e0:.2f}")
PY
  done
done
