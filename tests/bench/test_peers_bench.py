"""Slow and numerous peers against a real `gthulhu-node run` (issue 38, items 4 and 5): what a flood costs
the clients that matter, against the same steps measured in the same run without it.

Item 4: 15 scrapes and 25 Manager calls (a token over mutual TLS), 5 s timeout each, first alone, then
with 200 never-finishing connections from `nobody` (then from root, the good clients' own user) on each
of the two ports (tests/host/test_hostile.py's
SlowFlood: the same address as the good client, 127.0.0.1). Figures: answered, medians, their ratio
(goal: at most 3x); the agent's RSS before, during and after (goal: back within 20 MB).
Item 5: the agent's fd limit at its baseline + 64; a status call over the unix socket (median of 10), a
new matching thread until it is matched, and a policy edit until it applies, alone and then with 600
plain connections from `nobody` on the two ports (goal: each within 3x).
Run: `.venv/bin/python -m pytest -m bench -s -p no:cacheprovider tests/bench/test_peers_bench.py`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import pytest

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from tests.host.agent_support import NamedThread, wait_for
from tests.host.test_hostile import (  # noqa: F401 (agent: the fixture)
    HTTP_HEAD_PREFIX,
    TLS_RECORD_PREFIX,
    Agent,
    Flood,
    SlowFlood,
    absorbed,
    agent,
    manager_call,
    nofile_limit,
    scraped,
    token_again,
)

pytestmark = pytest.mark.bench


def timed(fn: Callable[[], bool], rounds: int) -> tuple[int, float]:
    """How many of `rounds` calls of fn succeeded, and the median time of one (s)."""
    times, ok = [], 0
    for _ in range(rounds):
        t0 = time.monotonic()
        ok += fn()
        times.append(time.monotonic() - t0)
    return ok, statistics.median(times)


@pytest.mark.parametrize("user", ["nobody", "root"])
def test_clients_through_slow_peers(agent: Agent, user: str) -> None:  # noqa: F811
    """From `nobody`, and from root: the same user as the good clients, so only the eviction of the
    slowest unfinished connection keeps them in (no per-user share of their own)."""
    wait_for(lambda: token_again(agent), what="the Manager getting a token")
    rss_before = agent.rss_mb()
    base_scrapes, base_scrape_s = timed(lambda: scraped(agent), 15)
    base_calls, base_call_s = timed(lambda: manager_call(agent), 25)
    floods = [SlowFlood(agent.metrics_port, 200, HTTP_HEAD_PREFIX, user=user),
              SlowFlood(agent.rest_port, 200, TLS_RECORD_PREFIX, user=user)]
    try:
        time.sleep(2.0)
        rss_during = agent.rss_mb()
        scrapes, scrape_s = timed(lambda: scraped(agent), 15)
        calls, call_s = timed(lambda: manager_call(agent), 25)
    finally:
        dropped = [f.close() for f in floods]
    time.sleep(2.0)
    rss_after = agent.rss_mb()
    print(f"\nscrapes alone: {base_scrapes}/15, median {base_scrape_s * 1000:.1f} ms; with 200+200 slow "
          f"peers of {user}: {scrapes}/15, median {scrape_s * 1000:.1f} ms ({scrape_s / base_scrape_s:.2f}x)")
    print(f"Manager calls alone: {base_calls}/25, median {base_call_s * 1000:.1f} ms; with the flood: "
          f"{calls}/25, median {call_s * 1000:.1f} ms ({call_s / base_call_s:.2f}x)")
    print(f"RSS {rss_before:.0f} -> {rss_during:.0f} (flood) -> {rss_after:.0f} MB "
          f"({rss_after - rss_before:+.0f} MB); slow connections the agent dropped (reopened): {dropped}")


def _status_s(a: Agent) -> float:
    channel, stub = a.stub()
    with channel:
        _, median = timed(lambda: bool(stub.GetStatus(pb.GetStatusRequest(), timeout=5).agent.ready), 10)
    return median


ROUNDS = 5


def _match_s(a: Agent, name: str) -> float:
    """Median over ROUNDS of: a new thread named `name` started until ListMatches shows it matched."""
    (a.policies / "bench.yaml").write_text(f"id: bench\ncommandRegex: '^{name}$'\npriority: 3\n")
    wait_for(lambda: "local/bench" in a.states(), what="the bench intent")
    times = []
    for _ in range(ROUNDS):
        t0 = time.monotonic()
        with NamedThread(name) as t:
            wait_for(lambda: a.matched(t.tid), what=f"{name} matched")
            times.append(time.monotonic() - t0)
    return statistics.median(times)


def _edit_s(a: Agent, first_priority: int) -> float:
    """Median over ROUNDS of: a changed policy file written until status shows it applied (the poller
    looks every 0.2 s, so one edit alone is mostly the poll's phase)."""
    times = []
    for priority in range(first_priority, first_priority + ROUNDS):
        def applied(priority: int = priority) -> bool:
            return any(i.key == "local/bench" and i.intent.priority == priority
                       and i.state == pb.INTENT_STATE_APPLIED for i in a.status().intents)

        t0 = time.monotonic()
        (a.policies / "bench.yaml").write_text(f"id: bench\ncommandRegex: '^gn-b$'\npriority: {priority}\n")
        wait_for(applied, what="the edit applied")
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def test_agent_work_through_an_fd_flood(agent: Agent) -> None:  # noqa: F811
    baseline = agent.fds()
    with nofile_limit(agent, baseline + 64):
        alone = (_status_s(agent), _match_s(agent, "gn-bench-a"), _edit_s(agent, 1))
        floods = [Flood(port, processes=1, each=300) for port in (agent.metrics_port, agent.rest_port)]
        try:
            t0 = time.monotonic()
            for port in (agent.metrics_port, agent.rest_port):
                absorbed(agent, port)
            took = time.monotonic() - t0
            flooded = (_status_s(agent), _match_s(agent, "gn-bench-b"), _edit_s(agent, 11))
            fds = agent.fds()
        finally:
            for f in floods:
                f.close()
        (agent.policies / "bench.yaml").unlink()
    print(f"\nfd limit {baseline + 64} (baseline {baseline} + 64), {fds} fds open during 600 connections "
          f"(their accept queues drained in {took:.2f} s, then measured)")
    for what, a, b in zip(("status call (median of 10)", f"new thread matched (median of {ROUNDS})",
                           f"policy edit applied (median of {ROUNDS})"),
                          alone, flooded, strict=True):
        print(f"{what}: alone {a * 1000:.1f} ms, flooded {b * 1000:.1f} ms ({b / a:.2f}x)")
