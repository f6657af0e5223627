"""Guest side of tests/bench/test_engine_step.py's request pipeline (issue 17, item 2).

A vLLM-like request pipeline in one C process (tests/vm/pipeline.c: no GIL between its threads): an
`api` thread sending 100 requests/s (open loop), `tokenizer-0/1` (0.5 ms of their own CPU per request),
`EngineCore_DP0` (steps: 2 ms of its own CPU, then 5 ms of sleep, the GPU's turn; every request in the
batch gets one token a step, 8 tokens a request), `detok-0/1` (50 us per token) and a busy background
pool `bg-0/1` (10 ms bursts, 1 ms pauses: what torch or a tokenizer batch brings into the process).
Request latency is end to end, from when the request was due to its last token detokenized.

Beside it `stress-ng --cpu 8`, as in the engine-step cases (tests/vm/engine_step_bench.py, whose hogs,
scheduler, peers and cgroup are reused here). `ours role policy` goes through the agent's path: intents
by role (engine priority 1, tokenizer 5, the rest unboosted; the `seed policy` cases: the seed's policy,
only `^EngineCore(_DP[0-9]+)?$`, at priority 1 and at 10), a PolicySet, the reconciler's full /proc
scan and diff, SchedExtBackend's map write. `EEVDF weight 10000` is what an operator tries first: the
whole process in a cgroup of cpu.weight 10000, its background pool boosted with its engine.
Cases run interleaved, round by round. Prints one JSON object with every run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gthulhu_node.intents.model import Intent
from gthulhu_node.matching import PolicySet
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.scheduler.backend import SchedExtBackend
from tests.vm import engine_step_bench as esb

SOURCE = Path(__file__).resolve().parent / "pipeline.c"

# role -> (commandRegex, priority); threads of no role stay unboosted
ROLES: dict[str, tuple[str, int]] = {
    "engine": ("^EngineCore_DP[0-9]+$", 1),
    "tokenizer": ("^tokenizer-[0-9]+$", 5),
}

# The seed's documented policy: only the engine threads, everything else unboosted (issue 40, item 2), at
# the seed's priority 1 and at 10, the Manager UI's default.
SEED_REGEX = "^EngineCore(_DP[0-9]+)?$"


def seed(priority: int) -> dict[str, tuple[str, int]]:
    return {"engine": (SEED_REGEX, priority)}


# (names hold no comma: --cases is a comma-separated list)
CASES: dict[str, dict[str, Any]] = {
    # the app alone: its own background pool is its only contention; the goal's "uncontended" run
    "no contention": {"hogs": False},
    "no contention (no bg pool)": {"hogs": False, "bg": 0},
    "EEVDF": {"hogs": True},
    "ours no policy": {"hogs": True, "sched": True},
    "ours role policy": {"hogs": True, "sched": True, "roles": ROLES},
    "ours seed policy 1": {"hogs": True, "sched": True, "roles": seed(1)},
    "ours seed policy 10": {"hogs": True, "sched": True, "roles": seed(10)},
    "nice -n -20": {"hogs": True, "prefix": ["nice", "-n", "-20"]},
    # every thread FIFO, the background pool too: its 1 ms pauses are what lets the rest run
    "chrt -f 50": {"hogs": True, "prefix": ["chrt", "-f", "50"]},
    "EEVDF weight 10000": {"hogs": True, "cgroup_weight": 10000},
    "scx_simple nice -20": {"hogs": True, "peer": "scx_simple", "prefix": ["nice", "-n", "-20"]},
    "scx_flatcg weight 10000": {"hogs": True, "peer": "scx_flatcg", "cgroup_weight": 10000},
}


def build(dest: Path) -> Path:
    """The pipeline compiled into `dest` (gcc from the machine's root, which the guest shares)."""
    dest.mkdir(parents=True, exist_ok=True)
    binary = dest / "gth-pipeline"
    subprocess.run(["gcc", "-O2", "-Wall", "-pthread", "-o", str(binary), str(SOURCE)], check=True)
    return binary


def role_of(comm: str) -> str:
    """`EngineCore_DP0` -> engine, `tokenizer-1` -> tokenizer, `bg-0` -> bg, `api` -> api."""
    return "engine" if comm.startswith("EngineCore") else comm.split("-")[0]


def threads_by_role(pid: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        out.setdefault(role_of((task / "comm").read_text().strip()), []).append(int(task.name))
    return out


def apply_roles(backend: SchedExtBackend, roles: dict[str, tuple[str, int]]) -> None:
    """The agent's path: one intent per role -> PolicySet -> reconciler full scan + diff -> backend.apply."""
    intents = [
        (f"bench/{role}", Intent.model_validate({"id": role, "commandRegex": regex, "priority": prio}))
        for role, (regex, prio) in roles.items()
    ]
    Reconciler(backend, policy=PolicySet.build(intents)).rescan()


def run_case(name: str, seconds: float, binary: Path) -> dict[str, Any]:
    case = CASES[name]
    with (
        esb.hogs(case["hogs"], seconds) as hog,
        esb.scheduler(case.get("sched", False), None) as sched,
        esb.peer(case.get("peer")),
        esb.engine_cgroup(case.get("cgroup_weight")) as cgroup,
    ):
        proc = subprocess.Popen(
            [*case.get("prefix", []), str(binary), "--seconds", str(seconds), "--bg", str(case.get("bg", 2))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/tmp",
        )
        try:
            assert esb._out(proc).readline().strip() == "ready"
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text(str(proc.pid))
            counters_before: dict[str, int] = {}
            if sched is not None:
                if case.get("roles"):
                    policy: dict[str, tuple[str, int]] = case["roles"]
                    apply_roles(sched, policy)
                    held = {k.id: e.priority for k, e in sched.read_back().items()}
                    roles = threads_by_role(proc.pid)
                    want = {tid: policy[role][1] for role in policy for tid in roles[role]}
                    got = {t: held.get(t) for t in want}
                    assert got == want, f"the roles are not all held: {held} {roles}"
                    unboosted = [t for r, tids in roles.items() if r not in policy for t in tids]
                    assert not set(unboosted) & set(held), f"an unboosted role is held: {held} {roles}"
                counters_before = sched.counters()
            _in = esb._in(proc)
            _in.write("go\n")
            _in.flush()
            out: dict[str, Any] = json.loads(esb._out(proc).readline())
            if sched is not None:
                after = sched.counters()
                for key in ("preemptions", "boosted_dispatches", "demotions", "direct_dispatches",
                            "fair_dispatches"):
                    out[key] = after[key] - counters_before[key]
                out["health_ok"] = float(sched.health().state.value == "running")
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out.update(hog)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--binary", type=Path, default=None, help="the built pipeline (default: build it)")
    parser.add_argument("--peers-dir", type=Path, default=None, help="where scx_simple and scx_flatcg are")
    parser.add_argument("--progress", type=Path, default=None,
                        help="append each case's result there as a JSON line as soon as it ends")
    esb.add_skip(parser)
    args = parser.parse_args()
    if args.peers_dir is not None:
        esb.PEERS_DIR = args.peers_dir
    binary = args.binary or build(Path(tempfile.mkdtemp(prefix="gth-pipeline-")))
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(CASES)}")
    esb.interleave(names, args.rounds, lambda name: run_case(name, args.seconds, binary),
                   args.progress, args.seconds, args.skip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
