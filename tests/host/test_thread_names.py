"""Every thread of a running agent has a name of its own that says what it does (docs/design.md,
"Threads"): three different threads were all `gthulhu-probe`, and a stack dump or `py-spy` said nothing
about which one hung. A real agent (dry-run backend) with its metrics endpoint; the threads read from
`threading.enumerate()` (this Python does not give the kernel's comm a thread's name)."""

from __future__ import annotations

import re
import threading
from collections import Counter

from gthulhu_node.metrics import Metrics
from tests.host.agent_support import running_agent, wait_for

GRPC_SERVE = re.compile(r"Thread-\d+ \(_serve\)")  # Python's default name for grpcio's `_serve`
# the threads an agent run on its own starts (the service adds `agent-start` while it starts)
AGENT_THREADS = {"gthulhu-engine", "policy-builder", "intent-status", "policy-files", "cgroup-limits",
                 "metrics-http"}


def test_a_running_agents_threads_have_unique_names_saying_what_they_do() -> None:
    before = {t.ident for t in threading.enumerate()}
    metrics = Metrics("127.0.0.1:0")
    metrics.start()
    try:
        with running_agent(policies={"poll_interval_s": 0.5}):
            wait_for(lambda: {t.name for t in threading.enumerate()} >= AGENT_THREADS or None,
                     what="the agent's threads")
            names = [t.name for t in threading.enumerate() if t.ident not in before]
    finally:
        metrics.stop()
    assert [n for n, count in Counter(names).items() if count > 1] == []
    assert set(names) >= AGENT_THREADS
    # gRPC's workers are `grpc_<n>`; nothing of ours is left with Python's default `Thread-<n>`: the one
    # unnamed thread is grpcio's own server loop (grpc/_server.py starts `_serve` without a name)
    assert [n for n in names if n.startswith("Thread-") and not GRPC_SERVE.fullmatch(n)] == []
