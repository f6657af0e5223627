"""What refusing a big hostile input costs (issue 38, item 6): process CPU time and peak RSS above the
same process's baseline, for inputs under the byte caps (4 MiB policy files and bodies). The target:
at most 1 s of CPU and 50 MB of RSS each. Two Manager pushes are accepted rather than refused (issue 39:
only an undecodable body is refused whole; entries past the count cap become failed entries): what
accepting them costs (translation and the policy build from its intents) is printed against the same
budget. A 4 MB push of 280-character patterns took 60 MB until the compiled program of every pattern
was no longer kept for the policy's life (matching goes through RE2 sets; per-pattern programs are
compiled when asked for, and only short ones cached): 22-27 MB since (2026-12-05). Every case runs in
a fresh process (peak RSS is per process), through the real reader (`read_file` for policy files, the
REST body parser for bodies).

Before (issue 38's measurements): the 100,000-item YAML was refused after 12 s, agent memory 113 -> 350
MB; a million scalars in 4 MB took 30 s and 690 MB.

`.venv/bin/python -m pytest -m bench -s -p no:cacheprovider tests/bench/test_document_bench.py`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.host.agent_support import PYTHON, REPO

pytestmark = pytest.mark.bench

CPU_BUDGET_S = 1.0
RSS_BUDGET_MB = 50.0

# Writes the case's file, measures the baseline (imports done, the input in memory as bytes), then reads
# it as the agent does and prints {"cpu": s, "rss": MB above baseline, "refused": words}.
MEASURE = r"""
import json, sys, time
from pathlib import Path
from gthulhu_node.intents.localfiles import PolicyFileError, read_file
from gthulhu_node.rest.translate import BodyError, node_policies
from gthulhu_node.intents.documents import DocumentError, load_json
from gthulhu_node.matching import PolicySet

path, kind = Path(sys.argv[1]), sys.argv[2]
blob = path.read_bytes()
def peak_mb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
base_rss = peak_mb()
c0 = time.process_time()
refused = ""
try:
    if kind == "file":
        read_file(path)
    else:  # what accepting a push costs: its translation and the policy the agent builds from it
        push = node_policies(load_json(blob), 10_000)
        PolicySet.build([("manager/" + i.id, i) for i in push.intents])
except (PolicyFileError, DocumentError, BodyError) as exc:
    refused = str(exc)[:100]
print(json.dumps({"cpu": time.process_time() - c0, "rss": peak_mb() - base_rss, "refused": refused}))
"""


def cases() -> dict[str, tuple[str, str]]:
    """name -> (text, how it is read)."""
    return {
        "100,000-item YAML (issue 38)": (
            "".join(f"- id: p{i}\n  commandRegex: '^x{i}$'\n" for i in range(100_000)), "file"),
        "a million scalars in 4 MB, one YAML list": ("[" + ",".join(["100"] * 1_000_000) + "]\n", "file"),
        "a million scalars in 4 MB, YAML lists of 100": (
            "\n".join("- [" + ",".join(["100"] * 100) + "]" for _ in range(10_000)), "file"),
        "a million scalars in 4 MB, JSON lists of 100": (
            "[" + ",".join("[" + ",".join(["100"] * 100) + "]" for _ in range(10_000)) + "]", "file"),
        "10,000 valid intents and a bad last one (YAML)": (
            "".join(f"- id: p{i}\n  commandRegex: '^x{i}$'\n  priority: 5\n" for i in range(10_000))
            + "- id: bad\n  commandRegex: x\n  priority: 99\n", "file"),
        "REST push of 10,001 policies (one past the cap)": (json.dumps({"policies": [
            {"policyID": f"p{i:020d}", "nodeID": "node-a", "commandRegex": f"^x{i}$", "priority": 1,
             "executionTime": 2_000_000} for i in range(10_001)]}), "body"),
        "REST push of 4 MB: 10,000 policies, 280-char patterns": (json.dumps({"policies": [
            {"policyID": f"p{i:020d}", "nodeID": "node-a", "commandRegex": "^" + "a" * 280 + f"{i}$",
             "priority": 1, "executionTime": 2_000_000} for i in range(10_000)]}), "body"),
        "REST body of 4 MB of nested lists": ("[" * 32 + ",".join("[1,1,1]" for _ in range(500_000))
                                              + "]" * 32, "body"),
    }


def test_refusing_big_inputs_stays_within_1s_and_50mb(tmp_path: Path) -> None:
    rows = []
    for name, (text, kind) in cases().items():
        assert len(text.encode()) <= 4 << 20, name
        path = tmp_path / ("case.yaml" if "YAML" in name else "case.json")
        path.write_text(text)
        os.chmod(path, 0o644)
        out = subprocess.run([str(PYTHON), "-c", MEASURE, str(path), kind], capture_output=True, text=True,
                             cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((name, len(text.encode()), got))
    print(f"\n{'input':48} {'bytes':>9} {'CPU s':>7} {'RSS MB':>7}  refused with")
    for name, size, got in rows:
        print(f"{name:48} {size:9d} {got['cpu']:7.2f} {got['rss']:7.1f}  {got['refused'] or '(accepted)'}")
    print(f"budget: {CPU_BUDGET_S} s CPU, {RSS_BUDGET_MB} MB RSS above the process's baseline; "
          f"python {sys.version.split()[0]}")
    over = [name for name, _, got in rows if got["cpu"] > CPU_BUDGET_S or got["rss"] > RSS_BUDGET_MB]
    print(f"over the budget: {over or 'none'}")
    for name, _, got in rows:
        assert bool(got["refused"]) != name.startswith("REST push"), (name, got)
    assert not over
