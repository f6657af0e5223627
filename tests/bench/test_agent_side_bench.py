"""Agent-side costs where intents are many (issue 17): applying 1,000 intents, a 10,000-policy REST push,
and the disk cost of a one-intent change after a 10,000-intent push.

Each prints the figure of the current code beside the implementation it replaced, both measured in the
same run where the old path can still be called (kept here as a baseline), and median [min-max] over the
rounds. Figures only, no timed assertions; the assertions are about correctness.
Run: `.venv/bin/python -m pytest -m bench -s -p no:cacheprovider -p no:xdist
tests/bench/test_agent_side_bench.py` (docs/benchmarks.md, "Agent side", has the figures).
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import re2
import structlog

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.intents.model import RE2_MAX_MEM, Intent
from gthulhu_node.intents.parse import intent_to_doc, parse_intent
from gthulhu_node.intents.source_set import SourceSet
from gthulhu_node.intents.state_file import STATE_FORMAT, atomic_write
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.matching import CommMatch, CompiledIntent, PolicySet, precedence_rank
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.rest.translate import node_policies
from gthulhu_node.tasks.procfs import Snapshot, Task
from tests.bench.test_rest_bench import body as manager_body
from tests.host.agent_support import REPO, AgentProcess, client, short_dir, statuses, wait_for, write_config
from tests.unit.rest_support import call, client_context, make_pki, public_pem, write_rsa_key

pytestmark = pytest.mark.bench
ROUNDS = 5


def spread(values: Sequence[float], unit: str = "ms", scale: float = 1e3) -> str:
    """median [min-max] of seconds, in `unit`."""
    v = [x * scale for x in values]
    return f"{statistics.median(v):8.1f} [{min(v):.1f}-{max(v):.1f}] {unit}"


@pytest.fixture(autouse=True)
def quiet_logs() -> None:
    """The reconciler logs every applied policy; thousands of lines would time the terminal."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


# ---- 1,000-intent apply ------------------------------------------------------------------------------


def bench_tasks(n: int = 2000) -> dict[int, Task]:
    """A host's worth of threads: workers the intents name, and names no intent matches (kernel
    threads, runtimes), many threads per name as on a real host (about 700 distinct names)."""
    names = (
        [f"worker-{k * 3}" for k in range(300)]
        + [f"worker-{k}_{k % 4}" for k in range(100)]
        + [f"kworker/{k % 8}:{k}" for k in range(150)]
        + [f"tokio-rt-w{k}" for k in range(50)]
        + [f"python3.{k}" for k in range(50)]
        + [f"EngineCore_DP{k}" for k in range(50)]
    )
    return {1000 + t: Task(1000 + t // 4 * 4, 1000 + t, names[t % len(names)], 1) for t in range(n)}


def bench_intents(n: int, salt: int) -> list[tuple[str, Intent]]:
    """`salt` makes every round's patterns new to the process (no compiled pattern cached)."""
    return [
        (f"bench/i{k}", parse_intent({"id": f"i{k}", "commandRegex": f"^worker-{k}(_[0-9]{{1,{salt + 2}}})?$",
                                      "priority": 1 + k % 20, "executionTime": 1_000_000 + k}))
        for k in range(n)
    ]


class PerPatternPolicySet(PolicySet):
    """The replaced matcher: every pattern compiled at build, one RE2 search per (comm, pattern)."""

    _programs: dict[str, Any]

    @classmethod
    def build_old(cls, intents: Sequence[tuple[str, Intent]]) -> PerPatternPolicySet:
        options = re2.Options()
        options.max_mem = RE2_MAX_MEM
        options.log_errors = False
        built = cls(CompiledIntent(key, i, precedence_rank(key, i)) for key, i in intents)
        built._programs = {c.key: re2.compile(c.intent.matching_pattern, options) for c in built.ordered}
        return built

    def match(self, comm: str) -> CommMatch:
        hit = self._cache.get(comm)
        if hit is not None:
            return hit
        return self._remember(
            comm, [c for c in self.ordered if self._programs[c.key].search(comm) is not None])


def test_apply_1000_intents_to_2000_threads() -> None:
    """Time from validated intents (as the store holds them) to the entries written: the policy build
    and the reconciler's full recompute. Patterns new to the process each round, so the new code's
    compiled-pattern cache gives it nothing (an apply after validation finds them compiled: "warm")."""
    backend = DryRunBackend()
    backend.start()
    reconciler = Reconciler(backend)
    reconciler.apply_snapshot(Snapshot(bench_tasks()))
    timings: dict[str, list[float]] = {"old": [], "new": [], "new, warm": []}
    entries: dict[str, int] = {}

    def timed(name: str, build: Callable[[], PolicySet]) -> None:
        reconciler.set_policy(PolicySet.empty())
        t0 = time.perf_counter()
        reconciler.set_policy(build())
        timings[name].append(time.perf_counter() - t0)
        entries[name] = len(backend.table)

    for r in range(ROUNDS):
        intents = bench_intents(1000, salt=2 * r)
        timed("old", lambda i=intents: PerPatternPolicySet.build_old(i))  # type: ignore[misc]
        fresh = bench_intents(1000, salt=2 * r + 1)
        timed("new", lambda i=fresh: PolicySet.build(i))  # type: ignore[misc]
        timed("new, warm", lambda i=fresh: PolicySet.build(i))  # type: ignore[misc]
    backend.stop()
    assert entries["old"] == entries["new"] == entries["new, warm"] > 0
    old = statistics.median(timings["old"])
    print(f"\n1,000-intent apply against 2,000 threads ({len({t.comm for t in bench_tasks().values()})} "
          f"names), {ROUNDS} rounds, median [min-max]")
    for name, values in timings.items():
        print(f"  {name:32s} {spread(values)}  {old / statistics.median(values):6.1f}x faster than old")


# ---- 10,000 policies over REST ------------------------------------------------------------------------

# The agent before issue 17's agent-side work: run from this commit's files beside the current one.
BASELINE_COMMIT = "309ede70b88cbeb6b26c5cf82ac4a848d3891fd3"
# What issue 17 measured for the exchange before; printed when the baseline cannot be built (no git).
REST_10K_BEFORE_S = 2.6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def baseline_tree(dest: Path) -> Path | None:
    """BASELINE_COMMIT's package (with this checkout's generated gRPC code, which git does not hold)."""
    r = subprocess.run(["git", "-C", str(REPO), "archive", BASELINE_COMMIT, "gthulhu_node"],
                       capture_output=True, check=False)
    if r.returncode != 0:
        return None
    dest.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=r.stdout, check=True)
    shutil.copytree(REPO / "gthulhu_node" / "api" / "gen", dest / "gthulhu_node" / "api" / "gen")
    return dest


class TreeAgent(AgentProcess):
    """`gthulhu-node run` from the package in `tree`."""

    def __init__(self, config: Path, socket_path: Path, tree: Path) -> None:
        super().__init__(config, socket_path)
        self.tree = tree

    def _env(self) -> dict[str, str]:
        return {**super()._env(), "PYTHONPATH": str(self.tree)}


def rest_rounds(base: Path, tree: Path) -> dict[str, list[float]]:
    """The Manager's exchange with an agent process run from `tree`, ROUNDS times."""
    pki = make_pki(base)
    key = write_rsa_key(base / "jwt.key")
    port = free_port()
    rest = {"enabled": True, "listen": f"127.0.0.1:{port}", "tls_cert": str(pki.server_cert),
            "tls_key": str(pki.server_key), "tls_client_ca": str(pki.ca),
            "jwt_private_key": str(base / "jwt.key")}
    out: dict[str, list[float]] = {"token+push+merkle": [], "push alone": [],
                                   "until status shows it in effect": []}
    config = write_config(base, node={"name": "bench-node"}, rest=rest)
    agent = TreeAgent(config, base / "run" / "api.sock", tree)
    agent.start()
    try:
        with client(agent.socket) as stub:
            ctx = client_context(pki)
            url = f"https://localhost:{port}"
            for r in range(ROUNDS):
                raw = json.dumps(manager_body(10_000, r + 1))
                t0 = time.perf_counter()
                tok = call(url, "POST", "/api/v1/auth/token",
                           json.dumps({"public_key": public_pem(key), "client_id": "manager-client"}),
                           {"Content-Type": "application/json"}, ctx)
                auth = {"Authorization": f"Bearer {tok.body['data']['token']}"}
                t1 = time.perf_counter()
                push = call(url, "POST", "/api/v1/node-intents", raw,
                            {**auth, "Content-Type": "application/json"}, ctx)
                t2 = time.perf_counter()
                merkle = call(url, "GET", "/api/v1/node-intents/merkle", None, auth, ctx)
                t3 = time.perf_counter()
                assert push.status == 200 and push.body["data"]["accepted"] == 10_000, push.body
                assert merkle.status == 200
                out["token+push+merkle"].append(t3 - t0)
                out["push alone"].append(t2 - t1)
                wanted = f"manager/{r + 1:08x}{9999:016x}"

                def applied(w: str = wanted) -> bool | None:
                    row = statuses(stub, "manager").get(w)
                    return (row is not None and row.state == pb.INTENT_STATE_APPLIED) or None

                wait_for(applied, timeout=300, what="the pushed policies in effect")
                out["until status shows it in effect"].append(time.perf_counter() - t0)
    finally:
        agent.stop()
    return out


def test_10000_policies_over_rest_to_an_agent_process() -> None:
    """A real agent process (dry-run backend, state on ext4 with fsync), the Manager's exchange over mutual
    TLS on loopback: token, push of 10,000 new policies, merkle check; then the time until the agent's
    status shows them in effect. The agent of BASELINE_COMMIT runs the same rounds first."""
    results: dict[str, dict[str, list[float]]] = {}
    base = short_dir()
    try:
        old_tree = baseline_tree(base / "baseline")
        if old_tree is not None:
            (base / "old").mkdir()
            results["old"] = rest_rounds(base / "old", old_tree)
        (base / "new").mkdir()
        results["new"] = rest_rounds(base / "new", REPO)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n10,000 policies over REST (mTLS, loopback) to an agent process, {ROUNDS} rounds, "
          "median [min-max]")
    for row in results["new"]:
        for name, rows in results.items():
            print(f"  {row:32s} {name:3s} {spread(rows[row])}")
        new = statistics.median(results["new"][row])
        if "old" in results:
            print(f"  {row:32s} new vs old: {statistics.median(results['old'][row]) / new:.1f}x faster")
        elif row == "token+push+merkle":
            print(f"  {row:32s} {REST_10K_BEFORE_S / new:.1f}x faster than issue 17's {REST_10K_BEFORE_S} s "
                  "(no baseline: git archive failed)")


# ---- a one-intent change after a 10,000-intent push ---------------------------------------------------


class WholeFileStore(IntentStore):
    """The replaced persistence: every change rewrote the whole state file (indented JSON, version 1)."""

    def _persist(self, source: str, old: SourceSet | None, new: SourceSet, docs: Any) -> None:
        target = self.state_file
        assert target is not None
        doc = {"format": STATE_FORMAT, "version": 1, "sources": {
            name: {"generation": ss.generation, "pushDigest": ss.push_digest, "updated": ss.updated,
                   "intents": [intent_to_doc(i) for i in ss.intents],
                   **({"entries": [e.model_dump(by_alias=True, mode="json") for e in ss.entries]}
                      if ss.entries else {})}
            for name, ss in sorted(self.snapshot().items()) if name != "local"}}
        atomic_write(target, json.dumps(doc, indent=1, ensure_ascii=False).encode() + b"\n")


def written_bytes() -> int:
    """Bytes this process has handed to write(2) so far."""
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(io["wchar"])


def test_one_intent_change_after_a_10000_intent_push() -> None:
    """The Manager's 10,000 policies (with their sender entries) stored, then a one-intent change: to
    another source (a CLI apply) and inside the large one (the Manager deletes one policy). State on ext4,
    fsync'd as in service."""
    push = node_policies(manager_body(10_000, 1), 100_000)
    results: dict[str, dict[str, list[float]]] = {}
    for name, kind in (("old: whole file", WholeFileStore), ("new: journal", IntentStore)):
        rows = results[name] = {"cli apply, s": [], "cli apply, bytes": [], "manager delete, s": [],
                                "manager delete, bytes": [], "state file bytes": []}
        base = Path(tempfile.mkdtemp(prefix="gnb-", dir="/var/tmp"))
        try:
            store = kind(base)
            store.apply("manager", 0, push.intents, allow_reserved=True, entries=push.entries)
            rows["state file bytes"].append(sum(p.stat().st_size for p in base.iterdir()))
            for r in range(ROUNDS):
                one = parse_intent({"id": "one", "commandRegex": "^one$", "priority": 1 + r})
                for label, change in (
                    ("cli apply", lambda s=store, i=one: s.apply("cli", 0, [i])),  # type: ignore[misc]
                    ("manager delete", lambda s=store, r=r: s.delete(  # type: ignore[misc]
                        "manager", push.intents[r].id, allow_reserved=True)),
                ):
                    w0, t0 = written_bytes(), time.perf_counter()
                    change()
                    rows[f"{label}, s"].append(time.perf_counter() - t0)
                    rows[f"{label}, bytes"].append(written_bytes() - w0)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\none-intent change after a 10,000-intent Manager push (state on ext4, fsync), {ROUNDS} rounds, "
          "median [min-max]")
    old, new = results["old: whole file"], results["new: journal"]
    print(f"  state after the push: old {old['state file bytes'][0] / 1e6:.1f} MB, "
          f"new {new['state file bytes'][0] / 1e6:.1f} MB")
    for label in ("cli apply", "manager delete"):
        for name, rows in results.items():
            print(f"  {label:15s} {name:17s} {spread(rows[f'{label}, s'])}  "
                  f"written {statistics.median(rows[f'{label}, bytes']) / 1e3:10.1f} kB")
        faster = statistics.median(old[f"{label}, s"]) / statistics.median(new[f"{label}, s"])
        fewer = statistics.median(old[f"{label}, bytes"]) / statistics.median(new[f"{label}, bytes"])
        print(f"  {label:15s} new vs old: {faster:.1f}x faster, {fewer:.0f}x fewer bytes")
