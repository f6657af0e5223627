"""An earlier revision of the agent's Python as a case beside this one (issue 41, item 5): the reaction
benchmark (rename -> effect, tests/bench/watchbench.py's `reaction` role, dry run and EEVDF), the engine
blocking benchmark (tests/bench/blockbench.py, dry run and EEVDF) and the reconciler's hot paths
in-process (tests/bench/hotpaths.py), each run from a checkout of the earlier revision and from this one,
interleaved round by round so drift in the machine's load hits both alike. Prints medians [min-max] over
the rounds and after/before ratios of the medians (goal: at most 1.10).

The earlier checkout is a `git worktree` (it needs no build: these roles import only pure-Python parts):
  git worktree add --detach /tmp/gthulhu-earlier d9f7f60
  .venv/bin/python -m tests.bench.revisions --earlier=/tmp/gthulhu-earlier --rounds=5
Copy both trees alike (this one as a worktree beside the earlier, run from it): one in the work tree and one
in /tmp read 1.18-1.34 for the same eevdf reaction that reads 0.95-1.02 alike. The blocking figures fall in
clusters a few ms apart (the engine thread waiting to run, not working), so a median of 15 rounds can land
in either: give them 40 (about 2 minutes per backend; docs/benchmarks.md has a 1.81 and a 0.98 of one pair).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from gthulhu_node.backends.eevdf import ENGINE_SLICE_NS

REPO = Path(__file__).resolve().parents[2]
REACTION_FIELDS = ("p50_ms", "p90_ms", "p99_ms", "agent_us_per_event")
BLOCKING_FIELDS = ("hook_gap_max_ms", "call_p99_ms", "apply_s", "apply_gap_ms", "reload_gap_ms")
HOTPATH_FIELDS = ("rematch_ms", "events_us_per_pair")


def _run(tree: Path, args: list[str]) -> Any:
    # `-m` from the checkout: its tests/ and gthulhu_node/ come first on sys.path (an installed or
    # editable gthulhu_node would otherwise win for a script run by path)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{tree}: {' '.join(args)} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def reaction(tree: Path, backend: str, count: int, forkexec: int) -> dict[str, Any]:
    result: dict[str, Any] = _run(tree, [
        "-m", "tests.bench.watchbench", "reaction", f"--backend={backend}", f"--count={count}",
        f"--forkexec={forkexec}", f"--engine-slice-ns={ENGINE_SLICE_NS}", "--hogs=0",
        "--observer-prio=--fifo=1",
    ])
    return result


def blocking(tree: Path, backend: str) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = _run(tree, [
        "-m", "tests.bench.blockbench", f"--backends={backend}", "--rounds=1"])
    return rows[backend][0]


def hotpaths(tree: Path) -> dict[str, Any]:
    """This checkout's tests/bench/hotpaths.py against `tree`'s package (the earlier one may not have
    the file)."""
    result: dict[str, Any] = _run(tree, [str(REPO / "tests" / "bench" / "hotpaths.py")])
    return result


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--earlier", type=Path, required=True, help="a checkout of the earlier revision")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="dry-run,eevdf")
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--forkexec", type=int, default=500)
    parser.add_argument("--only", choices=("reaction", "blocking", "hotpaths"), default=None)
    args = parser.parse_args()
    trees = {"before": args.earlier.resolve(), "after": REPO}
    backends = args.backends.split(",")
    benches = [b for b in ("reaction", "blocking", "hotpaths") if args.only in (None, b)]
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for n in range(args.rounds):
        for bench in benches:
            for backend in (backends if bench != "hotpaths" else ["dry-run"]):
                # alternate which revision goes first, so neither always runs on a warmer machine
                order = list(trees.items()) if n % 2 == 0 else list(trees.items())[::-1]
                for which, tree in order:
                    got = (reaction(tree, backend, args.count, args.forkexec) if bench == "reaction"
                           else blocking(tree, backend) if bench == "blocking" else hotpaths(tree))
                    rows.setdefault((bench, backend, which), []).append(got)
                    print(f"round {n + 1}: {bench} {backend} {which} done", file=sys.stderr, flush=True)
    print(f"{args.rounds} interleaved rounds; before = {trees['before']}, after = {REPO}; "
          "median [min-max] over rounds")
    for bench in benches:
        fields = {"reaction": REACTION_FIELDS, "blocking": BLOCKING_FIELDS, "hotpaths": HOTPATH_FIELDS}[bench]
        for backend in (backends if bench != "hotpaths" else ["dry-run"]):
            for f in fields:
                before = [float(r[f]) for r in rows[(bench, backend, "before")]]
                after = [float(r[f]) for r in rows[(bench, backend, "after")]]
                base = statistics.median(before)
                ratio = statistics.median(after) / base if base else 0.0
                print(f"  {bench:8} {backend:8} {f:20} before {spread(before)}  after {spread(after)}  "
                      f"after/before {ratio:.2f}")
    print(json.dumps({"|".join(k): v for k, v in rows.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
