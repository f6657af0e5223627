#!/bin/bash
# What a user sees of the running service (for README/docs examples), in the systemd lab guest after
# tests/vm/guest_service.py install DIR. Usage: guest_show.sh DIR
set -u
dir=$1
cd "$(dirname "$0")/../.."
show() { echo "\$ $*"; "$@" 2>&1; echo; }
systemctl start gthulhu-node
cp systemd/policies.d/vllm.yaml.example "$dir/vllm.yaml"
show /opt/gthulhu-node/venv/bin/gthulhu-node apply -f "$dir/vllm.yaml"
systemd-run --unit vllm-like --quiet .venv/bin/python "$PWD/tests/vm/vllm_engine.py" --idle --tids "$dir/tids.json"
.venv/bin/python tests/vm/guest_service.py wait-applied cli/vllm 2 >/dev/null
show systemctl status gthulhu-node --no-pager -n 0
show /opt/gthulhu-node/venv/bin/gthulhu-node status
show /opt/gthulhu-node/venv/bin/gthulhu-node matches
show journalctl -u gthulhu-node --no-pager -o cat EVENT=task_matched
show journalctl -u gthulhu-node --no-pager -o json-pretty EVENT=task_matched -n 1 \
    --output-fields=MESSAGE,EVENT,INTENT_ID,TID,TGID,COMM,SCHED_PRIORITY,SLICE_NS,SCOPE,PRIORITY,SYSLOG_IDENTIFIER,CODE_FILE,CODE_LINE,CODE_FUNC,LOGGER
echo "\$ curl -s 127.0.0.1:9812/metrics | grep -E '^gthulhu_node_(matched|intents|intent_applied|backend_info|scheduler_state|reaction_latency_seconds_(count|sum)|backend_writes)'"
curl -s 127.0.0.1:9812/metrics | grep -E '^gthulhu_node_(matched|intents|intent_applied|backend_info|scheduler_state|reaction_latency_seconds_(count|sum)|backend_writes)'
echo
echo "\$ curl -s 127.0.0.1:9812/metrics | grep '^gthulhu_node_scheduler_events_total'"
curl -s 127.0.0.1:9812/metrics | grep '^gthulhu_node_scheduler_events_total'
echo
show systemctl reload gthulhu-node
show journalctl -u gthulhu-node --no-pager -o cat EVENT=reload_done
show systemctl stop gthulhu-node vllm-like
show cat /sys/kernel/sched_ext/state
show journalctl -u gthulhu-node --no-pager -n 12
