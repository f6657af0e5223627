"""Guest side of `make demo` (tests/vm/demo.py): one measurement phase, run inside the lab guest.

  python -m tests.vm.guest_demo phase SECONDS OUT.json [--matches]

Starts CPU contention (`stress-ng --cpu 8`, from /tmp: it refuses a read-only working directory), runs the
vLLM-like engine (tests/vm/vllm_engine.py: EngineCore_DP0/1 doing 2 ms CPU steps and 5 ms sleeps) for
SECONDS, and writes the engine's report to OUT.json. With --matches, the scheduler's TID map is read from
the kernel (bpftool) while the engine runs: the TIDs the agent matched, as the kernel holds them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PY = REPO / ".venv" / "bin" / "python"


def start_probe() -> Any:
    """The BCC run-queue probe on the engine threads (docs/probe.md), or None where it cannot run."""
    from gthulhu_node.probe import BackgroundProbe, ProbeUnavailable

    try:
        return BackgroundProbe(regex="^EngineCore")
    except ProbeUnavailable as exc:
        print(exc, file=sys.stderr)
        return None


def phase(seconds: float, out: Path, matches: bool) -> int:
    probe = start_probe()  # before the contention: compiling next to 8 hogs takes minutes under TCG
    stress = subprocess.Popen(["stress-ng", "--cpu", "8", "--timeout", f"{int(seconds) + 5}s", "--quiet"],
                              cwd="/tmp", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # let the contention start before the engine does
        tids = out.with_suffix(".tids.json")
        engine = subprocess.Popen([str(PY), str(REPO / "tests/vm/vllm_engine.py"), "--seconds", str(seconds),
                                   "--tids", str(tids), "--out", str(out)], cwd="/tmp")
        shown = ""
        if matches:
            while not tids.exists() and engine.poll() is None:
                time.sleep(0.1)
            time.sleep(0.5)  # the agent reacts within milliseconds
            # bpftool, not the CLI: under this contention the CLI's start-up outlasts the workload
            shown = subprocess.run(["bpftool", "map", "dump", "name", "tid_map"], capture_output=True,
                                   text=True, check=False).stdout
        engine.wait()
    finally:
        stress.terminate()
        stress.wait()
    report = json.loads(out.read_text())
    waits = probe.stop().to_json() if probe is not None else None
    out.write_text(json.dumps({"engine": report, "matches": shown, "probe": waits}))
    return 0 if engine.returncode == 0 else 1


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "phase":
        return phase(float(argv[1]), Path(argv[2]), "--matches" in argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
