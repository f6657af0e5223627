"""Guest side of tests/vm/test_matrix.py: the agent as a user runs it, on whatever kernel the lab booted.

    guest_smoke.py run [--bpf-object PATH] [--backend KIND]

Starts `gthulhu-node run` (plain init: no systemd here, so the smoke test fits every lab kernel), a
vLLM-like process whose threads name themselves EngineCore_DP0/1, applies the vLLM example policy with
the CLI, waits for Applied, then reads the kernel's own view (sched_ext sysfs, `bpftool map dump` of the
TID map), the agent's status and metrics, stops the agent and prints one JSON object. With an object the
kernel refuses, the same steps show what `backend: auto` fell back to (or how `sched_ext` failed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.vm import warm  # noqa: E402 (after the path it comes from)

PY = str(REPO / ".venv/bin/python")
EXAMPLE = REPO / "systemd/policies.d/vllm.yaml.example"
METRICS = "127.0.0.1:9813"


def _sysfs() -> dict[str, str]:
    state = Path("/sys/kernel/sched_ext/state").read_text().strip()
    try:
        ops = Path("/sys/kernel/sched_ext/root/ops").read_text().strip()
    except OSError:
        ops = ""
    return {"state": state, "ops": ops if state != "disabled" else ""}


def _status(config: Path) -> dict[str, Any]:
    out = warm.run_cli(["status", "-o", "json", "--config", str(config)])
    return dict(json.loads(out.stdout)) if out.returncode == 0 and out.stdout.strip() else {}


def _kernel_tids() -> dict[int, int]:
    out = subprocess.run(["bpftool", "-j", "map", "dump", "name", "tid_map"], capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        return {}
    rows = json.loads(out.stdout)
    return {int(r.get("formatted", r)["key"]): int(r.get("formatted", r)["value"]["priority"]) for r in rows}


def _metric_lines(prefixes: tuple[str, ...]) -> list[str]:
    with urllib.request.urlopen(f"http://{METRICS}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [line for line in text.splitlines() if line.startswith(prefixes)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path("/run/gthulhu-smoke")
    (work / "policies.d").mkdir(parents=True, exist_ok=True)
    config = work / "config.yaml"
    lines = [
        f"backend: {{kind: {args.backend}}}",
        f"policies: {{directory: {work / 'policies.d'}}}",
        f"state: {{directory: {work / 'state'}}}",
        f"api: {{socket: {work / 'api.sock'}}}",
        f'metrics: {{listen: "{METRICS}"}}',
        "log: {format: json}",
    ]
    if args.bpf_object:
        lines.append(f"scheduler: {{bpf_object: {args.bpf_object}}}")
    config.write_text("\n".join(lines) + "\n")
    out: dict[str, Any] = {"before": _sysfs()}
    log = open(work / "agent.log", "w")  # noqa: SIM115 (closed below)
    agent = warm.start_cli(["run", "--config", str(config)], stdout=log, stderr=log)
    engine = subprocess.Popen([PY, str(REPO / "tests/vm/vllm_engine.py"), "--idle", "--tids",
                               str(work / "tids.json")])
    try:
        # Safety nets, not measurements: each `gthulhu-node status` is a Python start (about 20 s under
        # TCG with the other lane busy), and one shared 120 s deadline for all of it ran out in a loaded
        # two-lane run (2026-12-01) before the intent was read.
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and agent.poll() is None and not _status(config):
            time.sleep(0.5)
        out["agent_exit"] = agent.poll()
        if out["agent_exit"] is not None:
            log.flush()
            out["log"] = (work / "agent.log").read_text()[-3000:]
            return out
        out["loaded"] = _sysfs()
        applied = warm.run_cli(["apply", "-f", str(EXAMPLE), "--config", str(config)])
        out["apply_rc"] = applied.returncode
        while time.monotonic() < deadline and not (work / "tids.json").exists():
            time.sleep(0.2)
        named = json.loads((work / "tids.json").read_text())  # {comm: tid}, the leader included
        tids = {int(tid) for comm, tid in named.items() if comm.startswith("EngineCore")}
        out["engine_tids"] = sorted(tids)
        intent: dict[str, Any] = {}
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            found = [i for i in _status(config).get("intents", []) if i.get("key") == "cli/vllm"]
            intent = found[0] if found else {}
            matched = int(intent.get("matchedTasks", 0))
            if intent.get("state") == "INTENT_STATE_APPLIED" and matched == len(tids):
                break
            time.sleep(0.5)
        status = _status(config)
        out["intent_state"] = intent.get("state")
        out["matched"] = int(intent.get("matchedTasks", 0))
        out["backend"] = status.get("agent", {}).get("backend")
        out["backend_reason"] = status.get("agent", {}).get("backendReason", "")
        kernel = _kernel_tids()
        out["kernel_priorities"] = {str(t): kernel.get(t) for t in sorted(tids)}
        out["metrics"] = _metric_lines(("gthulhu_node_sched_ext_refused", "gthulhu_node_backend_info"))
    finally:
        engine.kill()
        agent.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.wait(timeout=60)
        if agent.poll() is None:
            agent.kill()
        log.close()
    out["stopped_rc"] = agent.returncode
    out["after"] = _sysfs()
    events = [json.loads(line) for line in (work / "agent.log").read_text().splitlines()
              if line.startswith("{")]
    out["log_events"] = sorted({e.get("event", "") for e in events})
    refused = [e for e in events if e.get("event") == "sched_ext_refused"]
    out["refused_log"] = refused[0] if refused else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["run"])
    parser.add_argument("--bpf-object", default="")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    os.chdir("/tmp")
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
