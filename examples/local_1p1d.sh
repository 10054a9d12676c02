#!/usr/bin/env bash
# A local 1P1D on this machine: the rendezvous, one prefill and one decode vLLM-CPU engine with the
# rendezvous connector, and the reference router on 127.0.0.1:8000. Ctrl-C (or SIGTERM) stops everything.
# Needs `make setup-vllm` and the tiny model (`.venv/bin/python scripts/make_tiny_model.py`); PY: the Python
# whose vLLM runs the engines (default .venv/bin/python). An engine that exits before it serves stops it all.
# The ports (RENDEZVOUS_PORT 50051, PREFILL_PORT 8100, DECODE_PORT 8200, ROUTER_PORT 8000) and the engines' log
# folder (LOG_DIR, /tmp) can be set too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-models/tiny-llama}
RENDEZVOUS_PORT=${RENDEZVOUS_PORT:-50051} PREFILL_PORT=${PREFILL_PORT:-8100} DECODE_PORT=${DECODE_PORT:-8200}
ROUTER_PORT=${ROUTER_PORT:-8000} LOG_DIR=${LOG_DIR:-/tmp}
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 UCX_NET_DEVICES=lo UCX_TLS=shm,tcp \
       VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1

config() {  # role pool port [extra json]
  printf '{"kv_connector": "RendezvousConnector", "kv_connector_module_path": "rendezvous.connector.rendezvous_connector",
 "kv_role": "%s", "kv_buffer_device": "cpu", "kv_load_failure_policy": "recompute",
 "kv_connector_extra_config": {"rendezvous": "127.0.0.1:'"$RENDEZVOUS_PORT"'", "pool": "%s",
 "labels": {"url": "http://127.0.0.1:%s"}}}' "$1" "$2" "$3"
}
engine() {  # port role pool; exec: the job is the engine itself, which the trap's kill reaches
  exec "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$1" --dtype float32 \
    --max-model-len 512 --block-size 32 --enforce-eager --seed 0 --kv-transfer-config "$(config "$2" "$3" "$1")"
}
declare -A pids logs
start() {  # port role pool: an engine in the background, its pid and log noted by port
  engine "$1" "$2" "$3" > "$LOG_DIR/kv-rendezvous-$3.log" 2>&1 &
  pids[$1]=$! logs[$1]=$LOG_DIR/kv-rendezvous-$3.log
}

trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT INT TERM
.venv/bin/kv-rendezvous serve --listen "127.0.0.1:$RENDEZVOUS_PORT" --metrics-listen off &
start "$PREFILL_PORT" kv_producer prefill
start "$DECODE_PORT" kv_consumer decode
for port in "$PREFILL_PORT" "$DECODE_PORT"; do
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    kill -0 "${pids[$port]}" 2>/dev/null || { echo "the engine on port $port exited: ${logs[$port]}" >&2; exit 1; }
    sleep 1
  done
done
.venv/bin/kv-rendezvous router --listen "127.0.0.1:$ROUTER_PORT" --address "127.0.0.1:$RENDEZVOUS_PORT" &
until curl -sf "http://127.0.0.1:$ROUTER_PORT/health" > /dev/null; do sleep 0.2; done
echo "ready: curl -s 127.0.0.1:$ROUTER_PORT/v1/completions -H 'Content-Type: application/json' \\"
echo "  -d '{\"model\": \"$MODEL\", \"prompt\": \"Hello\", \"max_tokens\": 16, \"temperature\": 0}'"
wait
