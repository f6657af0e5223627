"""`make demo`: the agent scheduling a vLLM-like workload in the sched_ext lab VM, shown plainly.

Boots the lab (plain init: faster than systemd), then measures the same vLLM-like workload (engine threads
EngineCore_DP0/1 doing 2 ms CPU steps + 5 ms sleeps, in a process named python3.12) under CPU contention
(stress-ng --cpu 8) three ways:
  1. the kernel's own scheduler (EEVDF), no agent;
  2. the agent running with the vLLM example policy (systemd/policies.d/vllm.yaml.example):
     `^EngineCore(_DP[0-9]+)?$`, priority 5, executionTime 2 ms;
  3. the agent's scheduler still loaded, the policy removed (SIGHUP), so the same threads are unmatched.
It prints what a user would look at (kernel, sched_ext state and ops, `gthulhu-node status`, `gthulhu-node
matches`) and the engine threads' run-queue wait (schedstat) and step rate side by side.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from tests.vm.lab import Lab

SECONDS = 10
DIR = "/tmp/demo"
PY = ".venv/bin/python"
CLI = ".venv/bin/gthulhu-node"


def say(text: str = "") -> None:
    print(text, flush=True)


def indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


def guest(lab: Lab, cmd: str, timeout: float = 120) -> str:
    return lab.run(cmd, timeout=timeout).check(cmd).stdout


def phase(lab: Lab, name: str, matches: bool = False) -> dict[str, Any]:
    out = f"{DIR}/{name}.json"
    guest(lab, f"{PY} -m tests.vm.guest_demo phase {SECONDS} {out}" + (" --matches" if matches else ""),
          timeout=900)  # includes the BCC probe compile, slow on a busy host
    return dict(json.loads(guest(lab, f"cat {out}")))


def wait_agent(lab: Lab, what: str) -> None:
    """Poll the agent's metrics endpoint (a curl is much cheaper in the emulated guest than the CLI)."""
    scrape = "curl -sf http://127.0.0.1:9812/metrics"
    check = {
        "ready": f"{scrape} | grep -q '^gthulhu_node_ready 1'",
        "no-intents": f"m=$({scrape}) && echo \"$m\" | grep -q '^gthulhu_node_intents' && "
                      f"! echo \"$m\" | grep '^gthulhu_node_intents{{' | grep -vq ' 0.0$'",
    }[what]
    guest(lab, f"for i in $(seq 1200); do {check} && exit 0; sleep 0.5; done; exit 1", timeout=660)


def kernel_map(dump: str) -> str:
    """bpftool's JSON dump of tid_map as one line per entry."""
    try:
        rows = json.loads(dump)
    except ValueError:
        return dump.strip() or "(empty)"
    lines = [f"tid {r['key']}: priority {r['value']['priority']}, slice {r['value']['slice_ns']} ns"
             for r in rows]
    return "\n".join(lines) or "(empty)"


def summarise(report: dict[str, Any]) -> dict[str, float]:
    engines = list(report["engine"].values())
    n = len(engines)
    return {
        "steps_per_s": sum(e["steps_per_s"] for e in engines) / n,
        "wait_per_step_ms": sum(e["runqueue_wait_per_step_ms"] for e in engines) / n,
        "wait_ms": sum(e["runqueue_wait_ms"] for e in engines) / n,
        "p99_ms": max(e["step_p99_ms"] for e in engines),
    }


def main() -> int:
    started = time.monotonic()
    say("gthulhu-node demo: a vLLM-like engine under CPU contention, in the sched_ext lab VM")
    say("booting the lab VM (qemu, 2 vCPUs, TCG emulation: everything runs ~10x slower than on hardware)...")
    # A generous boot timeout: the machine may be busy (a quiet one boots the lab in ~10 s).
    with Lab("plain", boot_timeout=600) as lab:
        say(f"  booted in {lab.boot_seconds or 0:.0f} s")
        kernel = guest(lab, "uname -r").strip()
        state = guest(lab, "cat /sys/kernel/sched_ext/state").strip()
        say(f"  kernel {kernel}; /sys/kernel/sched_ext/state: {state}")
        guest(lab, f"mkdir -p {DIR}/policies.d {DIR}/state && "
                   f"cp systemd/policies.d/vllm.yaml.example {DIR}/vllm.yaml && "
                   f"printf 'policies: {{directory: {DIR}/policies.d}}\\nstate: {{directory: {DIR}/state}}\\n"
                   f"log: {{format: json}}\\n' > {DIR}/config.yaml")

        say(f"\n[1/3] no agent: the kernel's EEVDF scheduler ({SECONDS} s, stress-ng --cpu 8 beside it)")
        eevdf = phase(lab, "eevdf")

        say("\n[2/3] starting the agent with the vLLM example policy:")
        say(indent(guest(lab, f"grep -v '^#' {DIR}/vllm.yaml")))
        guest(lab, f"cp {DIR}/vllm.yaml {DIR}/policies.d/vllm.yaml && "
                   f"setsid -f sh -c 'echo $$ > {DIR}/agent.pid; exec {CLI} run --config {DIR}/config.yaml' "
                   f"> {DIR}/agent.log 2>&1 < /dev/null")
        wait_agent(lab, "ready")
        ops = guest(lab, "cat /sys/kernel/sched_ext/state /sys/kernel/sched_ext/root/ops").split()
        say(f"  scheduler loaded: /sys/kernel/sched_ext/state: {ops[0]}, /sys/kernel/sched_ext/root/ops: "
            f"{ops[1] if len(ops) > 1 else '?'}")
        say(f"  running the workload ({SECONDS} s); the scheduler's TID map in the kernel meanwhile "
            "(bpftool map dump name tid_map):")
        policy = phase(lab, "policy", matches=True)
        say(indent(kernel_map(policy["matches"])))
        tids = {name: e["tid"] for name, e in policy["engine"].items()}
        say(f"  the engine threads were: {', '.join(f'{n}={t}' for n, t in tids.items())}; "
            "the agent's log says:")
        say(indent(guest(lab, f"grep -h '\"task_matched\"' {DIR}/agent.log | cut -c1-150 || true")))
        say("  `gthulhu-node status` (the workload has exited by now, so the intent matches no task):")
        say(indent(guest(lab, f"{CLI} status")))

        say("\n[3/3] the same scheduler without the policy (policy file removed, SIGHUP)")
        guest(lab, f"rm {DIR}/policies.d/vllm.yaml && kill -HUP $(cat {DIR}/agent.pid)")
        wait_agent(lab, "no-intents")
        nopolicy = phase(lab, "nopolicy")
        guest(lab, f"pid=$(cat {DIR}/agent.pid); kill -TERM $pid; for i in $(seq 120); do "
                   "kill -0 $pid 2>/dev/null || exit 0; sleep 0.5; done; exit 1", timeout=90)
        after = guest(lab, "cat /sys/kernel/sched_ext/state").strip()
        say(f"  agent stopped (SIGTERM): /sys/kernel/sched_ext/state: {after}")

    rows = [("EEVDF, no agent", summarise(eevdf)), ("gthulhu + vLLM policy", summarise(policy)),
            ("gthulhu, no policy", summarise(nopolicy))]
    say("\nEngine threads EngineCore_DP0/1 (2 ms CPU steps + 5 ms sleeps) beside stress-ng --cpu 8, "
        f"{SECONDS} s each, mean of the two threads:")
    say(f"  {'':24} {'steps/s':>9} {'rq wait/step':>13} {'rq wait total':>14} {'step p99':>9}")
    for name, s in rows:
        say(f"  {name:24} {s['steps_per_s']:9.1f} {s['wait_per_step_ms']:10.2f} ms {s['wait_ms']:11.0f} ms "
            f"{s['p99_ms']:6.1f} ms")
    say("  (rq wait: time runnable but waiting for a CPU, from /proc/<pid>/task/<tid>/schedstat; "
        "no contention: ~130 steps/s)")
    probed = [(name, report.get("probe")) for (name, _), report in
              zip(rows, (eevdf, policy, nopolicy), strict=True)]
    if all(waits and waits["intents"] for _, waits in probed):  # BCC ran in the guest (docs/probe.md)
        say("\nEach run-queue wait of the engine threads, from the BCC probe (gthulhu_node.probe; "
            "percentiles within log2 buckets):")
        say(f"  {'':24} {'waits':>7} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}")
        for name, waits in probed:
            w = waits["intents"][0]
            say(f"  {name:24} {w['count']:7d} " + " ".join(f"{w[k] / 1000:6.2f} ms" for k in
                                                       ("p50_us", "p90_us", "p99_us", "max_us")))
    say(f"\ndemo done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
