#!/usr/bin/env bash
# Start a batchserve server on 127.0.0.1, run Locust headless against it (bounded: it stops
# by itself), write CSV and HTML reports, print a summary, stop the server gracefully.
# Exits non-zero if any request failed other than by deliberate RESOURCE_EXHAUSTED shedding.
#
#   load_tests/run.sh --users 8 --spawn-rate 2 --duration 60s --out load_out [--model PATH] [--port 50151]
#                     [--protocol grpc|http] [--http-port 50153] [--replicas N]
# --protocol http drives the OpenAI-compatible HTTP API of the same server instead of gRPC.
# --replicas N starts N servers (ports PORT, PORT+3, ...; metrics and HTTP on the next two of
# each) and balances the gRPC load over all of them with round_robin (Client's service config).
set -euo pipefail
cd "$(dirname "$0")/.."

USERS=8; SPAWN=2; DURATION=60s; OUT=load_out; MODEL=""; PORT=50151; METRICS_PORT=""; PROTOCOL=grpc; HTTP_PORT=""
REPLICAS=1; EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --users) USERS=$2; shift 2;;
    --spawn-rate) SPAWN=$2; shift 2;;
    --duration) DURATION=$2; shift 2;;
    --out) OUT=$2; shift 2;;
    --model) MODEL=$2; shift 2;;
    --port) PORT=$2; shift 2;;
    --metrics-port) METRICS_PORT=$2; shift 2;;
    --protocol) PROTOCOL=$2; shift 2;;
    --http-port) HTTP_PORT=$2; shift 2;;
    --replicas) REPLICAS=$2; shift 2;;
    --) shift; EXTRA=("$@"); break;;
    *) echo "unknown option $1" >&2; exit 2;;
  esac
done
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"

[ -n "$METRICS_PORT" ] || METRICS_PORT=$(( PORT + 1 ))  # metrics always on: the idle check reads them
[ -n "$HTTP_PORT" ] || HTTP_PORT=$(( PORT + 2 ))
if [ "$PROTOCOL" = http ] && [ "$REPLICAS" -gt 1 ]; then
  echo "--replicas > 1 balances gRPC; put an HTTP load balancer in front for --protocol http" >&2; exit 2
fi
SERVERS=(); GRPC_ADDRS=(); METRICS_ADDRS=()
cleanup() {
  for pid in "${SERVERS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${SERVERS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
for (( i = 0; i < REPLICAS; i++ )); do
  P=$(( PORT + 3 * i )); M=$(( METRICS_PORT + 3 * i )); H=$(( HTTP_PORT + 3 * i ))
  SERVER_ARGS=(--host 127.0.0.1 --port "$P" --metrics-port "$M" --http-port "$H")
  [ -n "$MODEL" ] && SERVER_ARGS+=(--model "$MODEL")
  LOG="$OUT/server.log"; [ "$i" -gt 0 ] && LOG="$OUT/server-$i.log"
  "$PY" -m batchserve.cli serve "${SERVER_ARGS[@]}" "${EXTRA[@]}" >"$LOG" 2>&1 &
  SERVERS+=($!); GRPC_ADDRS+=("127.0.0.1:$P"); METRICS_ADDRS+=("127.0.0.1:$M")
done
case "$PROTOCOL" in
  grpc) HOST="${GRPC_ADDRS[0]}"; [ "$REPLICAS" -gt 1 ] && HOST="ipv4:$(IFS=,; echo "${GRPC_ADDRS[*]}")";;
  http) HOST="http://127.0.0.1:$HTTP_PORT";;
  *) echo "--protocol must be grpc or http" >&2; exit 2;;
esac

# Wait for health SERVING (model load included) on every replica, at most 5 minutes.
for (( i = 0; i < REPLICAS; i++ )); do
"$PY" - "$(( PORT + 3 * i ))" "${SERVERS[$i]}" <<'PYEOF'
import os, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
port, pid = sys.argv[1], int(sys.argv[2])
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("server exited during start-up; see server.log")
    try:
        if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
            sys.exit(0)
    except grpc.RpcError:
        pass
    time.sleep(0.5)
sys.exit("server not healthy after 300 s")
PYEOF
done

PIDS=$(IFS=,; echo "${SERVERS[*]}")
rss_kb() { ps -o rss= -p "$PIDS" | awk '{s += $1} END {print s}'; }  # all replicas together
rss() { rss_kb | awk '{printf "%.0f MB", $1/1024}'; }
echo "server memory at start: $(rss)" | tee "$OUT/memory.txt"
# The server's resident memory every 10 s, for the soak's growth check (memory_gate in load_tests/summarize.py).
( t=0; while kill -0 "${SERVERS[0]}" 2>/dev/null; do
    echo "$t,$(rss_kb)"; sleep 10; t=$(( t + 10 )); done ) >"$OUT/rss.csv" &
SAMPLER=$!
# Locust's own run-time limit bounds the run; `timeout` is a second guard.
case "$DURATION" in
  *m) SECS=$(( ${DURATION%m} * 60 ));; *h) SECS=$(( ${DURATION%h} * 3600 ));; *s) SECS=${DURATION%s};; *) SECS=$DURATION;;
esac
BATCHSERVE_PROTOCOL=$PROTOCOL timeout --signal=INT "$(( SECS + 180 ))" \
  "$PY" -m locust -f load_tests/locustfile.py --headless --users "$USERS" --spawn-rate "$SPAWN" \
  --run-time "$DURATION" --stop-timeout 120 --host "$HOST" \
  --csv "$OUT/locust" --html "$OUT/report.html" --only-summary --exit-code-on-error 0 >"$OUT/locust.log" 2>&1 || true
echo "server memory at end: $(rss)" | tee -a "$OUT/memory.txt"
kill "$SAMPLER" 2>/dev/null || true
"$PY" load_tests/summarize.py "$OUT/locust" "$OUT/rss.csv" "$(IFS=,; echo "${METRICS_ADDRS[*]}")"
