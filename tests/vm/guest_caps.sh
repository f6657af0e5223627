#!/bin/bash
# Measures which capabilities gthulhu-node needs (run in the systemd lab guest by tests/vm/measure_caps.py,
# after tests/vm/guest_service.py install DIR). For each bounding set: start the unit, then report whether
# it became active, which backend it chose, whether sched_ext runs our ops, whether proc events work, and
# the agent's error if it failed. Usage: guest_caps.sh DIR [--narrow-only]
set -u
dir=$1
# the set the unit had before this measurement, and the candidates for it
full="CAP_SYS_ADMIN CAP_BPF CAP_PERFMON CAP_NET_ADMIN CAP_SYS_NICE"
dropin=/etc/systemd/system/gthulhu-node.service.d/caps.conf
try() {
    local label=$1 caps=$2
    printf '[Service]\nRestart=no\nCapabilityBoundingSet=\nCapabilityBoundingSet=%s\n' "$caps" > "$dropin"
    systemctl daemon-reload
    systemctl reset-failed gthulhu-node 2>/dev/null
    timeout 240 systemctl start gthulhu-node 2>/dev/null
    local rc=$? active state ops metrics backend events err
    active=$(systemctl is-active gthulhu-node)
    state=$(cat /sys/kernel/sched_ext/state)
    ops=$(cat /sys/kernel/sched_ext/root/ops 2>/dev/null)
    metrics=$(curl -sf http://127.0.0.1:9812/metrics)
    backend=$(echo "$metrics" | sed -n 's/^gthulhu_node_backend_info{kind="\([^"]*\)".*/\1/p')
    events=$(echo "$metrics" | sed -n 's/^gthulhu_node_proc_events_available \(.*\)/\1/p')
    err=$(journalctl -u gthulhu-node -o json --no-pager -n 200 PRIORITY=3 2>/dev/null | tail -1 |
          python3 -c 'import json,sys; l=sys.stdin.read().strip(); print(json.loads(l).get("MESSAGE","")[:200] if l else "")')
    echo "$label|start_rc=$rc|$active|sched_ext=$state:${ops:-none}|backend=${backend:-?}|proc_events=${events:-?}|$err"
    systemctl stop gthulhu-node 2>/dev/null
    journalctl --rotate >/dev/null 2>&1; journalctl --vacuum-time=1s >/dev/null 2>&1
}
[ "${2:-}" = --narrow-only ] || {
try "all five" "$full"
for cap in $full; do
    try "without $cap" "$(echo $full | tr ' ' '\n' | grep -vx "$cap" | tr '\n' ' ')"
done
}
# CAP_SYS_ADMIN covers CAP_BPF and CAP_PERFMON in the kernel's checks: try the narrower sets on their own
try "CAP_BPF CAP_PERFMON CAP_SYS_NICE" "CAP_BPF CAP_PERFMON CAP_SYS_NICE"
try "CAP_BPF CAP_PERFMON" "CAP_BPF CAP_PERFMON"
try "CAP_BPF only" "CAP_BPF"
try "CAP_PERFMON only" "CAP_PERFMON"
try "none" ""
rm -f "$dropin"
systemctl daemon-reload
