# The online path against the offline one on the same prompts, in one call on an H200 (under 9 minutes):
#   bash benchmarks/devrun_serve.sh              on the device, with .whl/ carried (the server's wheels)
#   SMOKE=1 PYTHON=.venv/bin/python bash benchmarks/devrun_serve.sh    the same plumbing on a CPU in
#       about a minute: the tiny dummy model of tests/fixtures/hf/llama3_gqa4_tied, 8 prompts of 8 + 8 tokens
# Steps, each logged under $OUT (default /tmp/devrun_serve):
#   1. the server's wheels from .whl/ into /tmp/site, when fastapi or uvicorn is missing
#   2. the synthetic tokenizer of the model's vocabulary (configs/llama3-8b-dummy-serve.yaml reads it)
#   3. `jaxserve bench throughput`: N prompts of IN tokens, OUTLEN out, seed 0 (precompile on, so it
#      also fills the persistent compilation cache and the server starts warm)
#   4. `jaxserve serve` in the background, then `jaxserve bench serve --request-rate inf` on the same
#      prompts (same seed, lengths and tokenizer: the prompts_fingerprint of both reports shows it)
#   5. `jaxserve bench serve` at RATE req/s for about RATE_S seconds, seed 1 (other prompts: no prefix
#      cache hits from step 4), for TTFT / ITL percentiles
#   6. the table (benchmarks/serve_vs_offline.py), printed last and written to $OUT/summary.md
# Override any of N IN OUTLEN RATE RATE_S PORT from the environment. DEADLINE (default 540 s) bounds the
# whole script: each step's timeout is what is left, the fixed-rate run is skipped when it cannot finish
# in time, and the table is printed from what ran.
set -o pipefail
OUT=${OUT:-/tmp/devrun_serve}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ -n "${SMOKE:-}" ]; then
  MODEL_JSON=tests/fixtures/hf/llama3_gqa4_tied/config.json
  TOK=build/synthetic-tokenizer/smoke
  ENGINE="--config configs/tiny.yaml --model tests/fixtures/hf/llama3_gqa4_tied --load-format dummy
    --tokenizer $TOK --precompile false"
  N=${N:-8} IN=${IN:-8} OUTLEN=${OUTLEN:-8} RATE=${RATE:-4} RATE_S=${RATE_S:-2}
  PORT=${PORT:-$((20000 + RANDOM % 20000))}
else
  MODEL_JSON=configs/models/llama3-8b/config.json
  TOK=build/synthetic-tokenizer/llama3-8b
  ENGINE="--config configs/llama3-8b-dummy-serve.yaml"
  N=${N:-1000} IN=${IN:-1024} OUTLEN=${OUTLEN:-256} RATE=${RATE:-8} RATE_S=${RATE_S:-60} PORT=${PORT:-8000}
  nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
fi
if ! $PY -c "import fastapi, uvicorn, pydantic" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the server's packages are missing and .whl/ did not install them"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"  # a socket per request on each side
DEADLINE=${DEADLINE:-540}
step() { echo "== ${SECONDS}s: $*"; }
left() { echo $((DEADLINE - SECONDS - ${1:-0})); }  # seconds to the deadline, less $1 kept in reserve
limit() { local t; t=$(left "$1"); echo $((t > 1 ? t : 1)); }  # a timeout: `timeout 0` would mean none

step "synthetic tokenizer"
$PY benchmarks/make_synthetic_tokenizer.py --model-config $MODEL_JSON --out $TOK || exit 1

step "offline: bench throughput, $N x ($IN in, $OUTLEN out)"
timeout "$(limit 240)" $PY -m jaxserve.cli bench throughput $ENGINE --disable-tqdm --num-prompts $N --input-len $IN \
  --output-len $OUTLEN --seed 0 --output-json $OUT/throughput.json > $OUT/throughput.log 2>&1 \
  || { tail -30 $OUT/throughput.log; exit 1; }
grep -E "^Throughput|^Total num" $OUT/throughput.log

step "server start"
$PY -m jaxserve.cli serve $ENGINE --port $PORT --log-level warning > $OUT/server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
until $PY -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do
  if ! kill -0 $SERVER 2>/dev/null || [ "$(left 120)" -le 0 ]; then
    echo "the server did not come up:"; tail -30 $OUT/server.log; exit 1
  fi
  sleep 1
done

SERVE="$PY -m jaxserve.cli bench serve --base-url http://127.0.0.1:$PORT --tokenizer $TOK --ignore-eos --disable-tqdm
  --metric-percentiles 50,90,99 --random-input-len $IN --random-output-len $OUTLEN"
step "online: bench serve --request-rate inf, the same $N prompts"
timeout "$(limit 15)" $SERVE --num-prompts $N --seed 0 --request-rate inf --output-json $OUT/serve_inf.json \
  > $OUT/bench_serve.log 2>&1 || { tail -30 $OUT/bench_serve.log; tail -20 $OUT/server.log; exit 1; }
grep -E "Successful|Failed|Output token|Total token" $OUT/bench_serve.log

RATE_JSON=$OUT/serve_rate.json
if [ "$(left $((RATE_S + 30)))" -gt 0 ]; then
  step "online: bench serve at $RATE req/s, $((RATE * RATE_S)) prompts"
  timeout "$(limit 10)" $SERVE --num-prompts $((RATE * RATE_S)) --seed 1 --request-rate $RATE --output-json $RATE_JSON \
    >> $OUT/bench_serve.log 2>&1 || { tail -30 $OUT/bench_serve.log; tail -20 $OUT/server.log; RATE_JSON=; }
else
  step "skipped: bench serve at $RATE req/s (too little time left before DEADLINE=$DEADLINE)"; RATE_JSON=
fi

step "server stop"
kill -TERM $SERVER && timeout 10 tail --pid=$SERVER -f /dev/null
trap - EXIT
step "done"
$PY benchmarks/serve_vs_offline.py $OUT/throughput.json $OUT/serve_inf.json $RATE_JSON | tee $OUT/summary.md
