# Shared by the benchmarks/devrun_*.sh scripts (sourced after they set OUT and DEADLINE):
#   PY W       the Python to run (PYTHON, default python3) and the scripts' work folder $OUT/work
#   left [R]   seconds to DEADLINE less R kept in reserve;  limit [R]  the same as a timeout (at least 1)
#   run NAME MAX_S RESERVE_S CMD...   CMD logged to $W/NAME.log, at most MAX_S and never into the last
#              RESERVE_S before DEADLINE (skipped when under 20 s are left); a failure shows its rc and the
#              log's tail; then the log's lines matching $SHOW (an extended regex), indented. A command out
#              of time gets SIGABRT: Python's fault handler writes every thread's stack to the log first
#   port       a free loopback port;  wait_up URL PID MAX_S  until URL/health answers (0), PID exits or
#              MAX_S pass (1);  PIDS + cleanup (run at exit): background processes killed
PY=${PYTHON:-python3}
W=$OUT/work
mkdir -p "$W"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
ulimit -c 0  # (no core files from the aborted commands)
left() { echo $((DEADLINE - SECONDS - ${1:-0})); }
limit() { local t; t=$(left "$1"); echo $((t > 1 ? t : 1)); }  # `timeout 0` would mean no timeout
run() {
  local name=$1 max=$2 reserve=$3 t; shift 3
  t=$(limit "$reserve"); t=$((t < max ? t : max))
  if [ "$t" -lt 20 ]; then echo "== ${SECONDS}s: $name skipped (no time left)"; return; fi
  echo "== ${SECONDS}s: $name (timeout ${t}s)"
  timeout -s ABRT -k 15 "$t" "$@" > "$W/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || { echo "   rc $rc"; tail -4 "$W/$name.log"; }
  [ -z "${SHOW:-}" ] || grep -E "$SHOW" "$W/$name.log" | sed 's/^/   /'
}
port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_up() {
  local t=0
  until curl -sf "$1/health" > /dev/null; do
    kill -0 "$2" 2>/dev/null || return 1
    sleep 1; t=$((t + 1)); [ "$t" -lt "$3" ] || return 1
  done
}
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT
server_packages() {
  $PY -c "import fastapi, uvicorn, pydantic" 2>/dev/null && return
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the server's packages are missing and .whl/ did not install them"; exit 1; }
  export PYTHONPATH=$PYTHONPATH:/tmp/site PATH=$PATH:/tmp/site/bin
}
