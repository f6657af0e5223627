"""What the intent API costs, over the real unix socket of a real agent (dry-run backend).

Figures per call (median of N): the health check is the baseline (gRPC round trip, no agent work); the
others are shown as ratios against it. A changing ApplyIntents includes validation, the fsync'd state
write and waiting for the reconciler to take the new policy in.
Run: `make bench` (or `.venv/bin/python -m pytest -m bench -s tests/bench/test_api_bench.py`).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from tests.host.agent_support import client, intent, running_agent

pytestmark = pytest.mark.bench


def median_ms(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def test_api_costs() -> None:
    base = Path(tempfile.mkdtemp(prefix="gnb-", dir="/var/tmp"))  # a real disk: fsync costs what it costs
    try:
        with running_agent(base) as agent, client(agent.config.api.socket) as stub:
            with grpc.insecure_channel(f"unix://{agent.config.api.socket}") as ch:
                health = health_pb2_grpc.HealthStub(ch)
                baseline = median_ms(lambda: health.Check(health_pb2.HealthCheckRequest()), 200)
            rows: list[tuple[str, float]] = []
            gen = [0]
            for size in (10, 1000):
                intents = [intent(f"i{k}", regex=f"^gn-bench-{k}$", priority=k % 21) for k in range(size)]

                def changing(intents: list[pb.Intent] = intents, gen: list[int] = gen) -> None:
                    gen[0] += 1
                    intents[0].priority = gen[0] % 20 + 1
                    stub.ApplyIntents(
                        pb.ApplyIntentsRequest(source="bench", generation=gen[0], intents=intents)
                    )

                n = 100 if size == 10 else 20
                rows.append((f"ApplyIntents, {size} intents, changed", median_ms(changing, n)))
                same = pb.ApplyIntentsRequest(source="bench", generation=gen[0], intents=intents)
                rows.append(
                    (
                        f"ApplyIntents, {size} intents, retry (no-op)",
                        median_ms(lambda r=same: stub.ApplyIntents(r), n),
                    )
                )
                rows.append(
                    (
                        f"GetStatus, {size} intents",
                        median_ms(lambda: stub.GetStatus(pb.GetStatusRequest()), n),
                    )
                )
            rows.append(("ListMatches", median_ms(lambda: stub.ListMatches(pb.ListMatchesRequest()), 100)))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\nintent API over the unix socket (median per call; baseline: health Check {baseline:.2f} ms)")
    for name, ms in rows:
        print(f"  {name:45s} {ms:8.2f} ms  {ms / baseline:7.1f}x baseline")
    assert all(ms > 0 for _, ms in rows)
