"""Guest side of tests/vm/test_explain_vm.py: `explain` against a real agent on the real gthulhu scheduler,
each reason a thread is not governed produced for real, in one run of one guest.

Runs as root in the lab VM. First an agent with the sched_ext backend and `scheduler.map_capacity: 2`:
- `gn-spin` (a process of its own, busy) under two process-scope intents, `spin` (priority 2) and
  `spin-low` (priority 5): the overlap, and the guard demoting the busy boosted thread over its share;
- four threads `gn-full-0..3` of a worker process (waking every 20 ms) under `full` (priority 3, thread
  scope): two TID entries fit in the map, two are refused (map full);
- `gn-sel`, a thread of the same process, under `owner`, which names user 4242 (the selector turns it
  away), and `elsewhere`, for another node; `cmdline` is written against the command line (no comm has it);
- `gn-head`, a thread of a process of its own (waking every 20 ms), under `head` (priority 15, process
  scope: the head-start tier, 10-20), whose runs the per-task counters count as boosted runs;
- the agent's own main thread, which no intent matches: the scheduler boosts it by itself;
then bpftool's dump of tid_map and tgid_map beside explain's read-back, and a Preview before and after
which the agent's state is compared. Then an agent with the eevdf backend on the same kernel, with an
intent whose slice EEVDF cannot hold. Prints the answers as the CLI renders them (for docs/intents.md)
and, last, one JSON object with everything the test asserts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from typing import Any

import structlog
from google.protobuf.json_format import MessageToDict

from gthulhu_node.agent import Agent
from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.commands.explain import describe, exit_status
from tests.host.agent_support import NamedThread, intent, running_agent, stub_of, wait_for

# A busy process named gn-spin (prctl on its only thread names the process).
SPIN = ("import ctypes; ctypes.CDLL(None).prctl(15, b'gn-spin', 0, 0, 0); print('ready', flush=True)\n"
        "while True: pass")
# A process of threads named from its arguments, each waking every 20 ms; prints {name: tid} once up.
# Not threads of the agent's process: the scheduler boosts those by itself (agent protection).
WORKERS = """
import ctypes, json, sys, threading, time
named = {}
def run(name):
    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)
    named[name] = threading.get_native_id()
    while True:
        time.sleep(0.02)
for name in sys.argv[1:]:
    threading.Thread(target=run, args=(name,), daemon=True).start()
while len(named) < len(sys.argv) - 1:
    time.sleep(0.01)
print(json.dumps(named), flush=True)
threading.Event().wait()
"""
SCHED_EXT_INTENTS = [
    intent("spin", "^gn-spin$", priority=2, scope="process"),
    intent("spin-low", "^gn-spin$", priority=5, scope="process"),
    intent("full", "^gn-full-", priority=3),
    intent("owner", "^gn-sel$", priority=4, users=["4242"]),
    # the seed's two questions: an intent for another node, and one written against the command line
    intent("elsewhere", "^gn-sel$", priority=4, node_names=["gpu-node-7"]),
    intent("cmdline", "python3 -c", priority=4),
    # the head-start tier (10-20): no preemption, a share of each run's charge forgiven
    intent("head", "^gn-head$", priority=15, scope="process"),
]
# 200 ms: a valid executionTime that EEVDF clamps to its 100 ms maximum
EEVDF_INTENTS = [intent("long", "^gn-sel$", priority=5, execution_time=200_000_000)]


def preview_state(agent: Agent) -> dict[str, Any]:
    """What a Preview must leave as it is (tests/host/test_explain.py's agent_state, less the status rows:
    here the map-full retries rewrite their reason, naming whichever TID was refused last, on their own)."""
    desired, applied, policy = agent.engine.call(lambda r: (r.desired(), r.applied(), r.policy))
    return {"store": agent.store.snapshot(), "desired": desired, "applied": applied, "policy": policy,
            "matches": [(m.tid, m.intent, m.overlaps) for m in agent.matches()]}


def doc(msg: Any) -> dict[str, Any]:
    out: dict[str, Any] = MessageToDict(msg, always_print_fields_with_no_presence=True)
    return out


def explain(agent: Any, **request: Any) -> list[dict[str, Any]]:
    with stub_of(agent) as stub:
        return [doc(t) for t in stub.Explain(pb.ExplainRequest(**request)).threads]


def bpftool_dump(name: str) -> dict[int, dict[str, int]]:
    """A map's entries as bpftool reads them from the kernel (its BTF-formatted JSON)."""
    out = subprocess.run(["bpftool", "-j", "map", "dump", "name", name], capture_output=True, text=True,
                         check=True).stdout
    return {int(e["formatted"]["key"]): {k: int(v) for k, v in e["formatted"]["value"].items()}
            for e in json.loads(out)}


def as_cli(agent: Agent, shown: str, **request: Any) -> str:
    """The Explain answer as `gthulhu-node explain` prints it (its own `describe`, and its exit status
    rule), rendered here: starting the CLI itself costs ~25 s of TCG, and the host tests run it."""
    with stub_of(agent) as stub:
        threads = stub.Explain(pb.ExplainRequest(**request)).threads
    status = exit_status(threads)
    text = "\n\n".join(describe(t) for t in threads)
    return f"$ gthulhu-node explain {shown}; echo \"exit $?\"\n{text}\nexit {status}\n"


def sched_ext_phase(out: dict[str, Any]) -> None:
    started = time.monotonic()
    spin = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
    with contextlib.ExitStack() as stack:
        stack.callback(spin.wait)
        stack.callback(spin.kill)
        assert spin.stdout is not None and spin.stdout.readline().strip() == "ready"
        names = [f"gn-full-{i}" for i in range(4)] + ["gn-sel"]
        workers = subprocess.Popen([sys.executable, "-c", WORKERS, *names], stdout=subprocess.PIPE, text=True)
        stack.callback(workers.wait)
        stack.callback(workers.kill)
        assert workers.stdout is not None
        tids: dict[str, int] = json.loads(workers.stdout.readline())
        head = subprocess.Popen([sys.executable, "-c", WORKERS, "gn-head"], stdout=subprocess.PIPE, text=True)
        stack.callback(head.wait)
        stack.callback(head.kill)
        assert head.stdout is not None
        tids.update(json.loads(head.stdout.readline()))
        agent = stack.enter_context(running_agent(backend_kind="sched_ext", scheduler={"map_capacity": 2}))
        with stub_of(agent) as stub:
            stub.ApplyIntents(pb.ApplyIntentsRequest(source="ex", intents=SCHED_EXT_INTENTS))
        agent.sync()
        out["agent_up_s"] = round(time.monotonic() - started, 1)

        # the guard: poll until the busy boosted thread's own counter shows a demotion (a liveness wait)
        def demoted() -> dict[str, Any] | None:
            (t,) = explain(agent, tid=spin.pid)
            return t if int(t["taskStats"].get("demotions", 0)) > 0 else None

        out["spin"] = wait_for(demoted, timeout=30, what="a guard demotion of gn-spin")

        def full_settled() -> list[dict[str, Any]] | None:
            got = explain(agent, comm_regex="^gn-full-")
            written = [t for t in got if any("readBack" in e for e in t["entries"])]
            refused = [t for t in got if any(e["failure"] for e in t["entries"])]
            boosted = all(int(t["taskStats"].get("boosted_runs", 0)) > 0 for t in written)
            return got if len(written) == 2 and len(refused) == 2 and boosted else None

        out["full"] = wait_for(full_settled, timeout=30, what="two gn-full threads written, two refused")
        (out["sel"],) = explain(agent, tid=tids["gn-sel"])

        def head_boosted() -> dict[str, Any] | None:  # a liveness wait: its entry written, then its runs
            (t,) = explain(agent, tid=tids["gn-head"])
            return t if int(t["taskStats"].get("boosted_runs", 0)) > 0 else None

        out["head"] = wait_for(head_boosted, timeout=30, what="a boosted run of gn-head (priority 15)")
        out["head_pid"] = head.pid
        (out["agent"],) = explain(agent, tid=os.getpid())  # the agent's own main thread
        out["cli_agent"] = as_cli(agent, str(os.getpid()), tid=os.getpid())
        out["tid_map"] = bpftool_dump("tid_map")
        out["tgid_map"] = bpftool_dump("tgid_map")
        out["spin_pid"] = spin.pid
        before = preview_state(agent)
        with stub_of(agent) as stub:
            preview = stub.Preview(pb.PreviewRequest(source="ui", intents=[
                intent("take-sel", "^gn-sel$", priority=1), intent("lose", "^gn-spin$", priority=15,
                                                                   scope="process")]))
        out["preview"] = doc(preview)
        after = preview_state(agent)
        out["preview_changed"] = sorted(k for k in before if before[k] != after[k])
        shown = "^gn-(spin|full-[01]|sel)$"
        out["cli"] = as_cli(agent, f"--comm '{shown}'", comm_regex=shown)
        out["sched_ext_s"] = round(time.monotonic() - started, 1)


def eevdf_phase(out: dict[str, Any]) -> None:
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        sel = stack.enter_context(NamedThread("gn-sel"))
        agent = stack.enter_context(running_agent(backend_kind="eevdf"))
        with stub_of(agent) as stub:
            stub.ApplyIntents(pb.ApplyIntentsRequest(source="ex", intents=EEVDF_INTENTS))
        agent.sync()

        def read_back() -> dict[str, Any] | None:
            (t,) = explain(agent, tid=sel.tid)
            return t if t["entries"] and "readBack" in t["entries"][0] else None

        out["eevdf"] = wait_for(read_back, timeout=30, what="the eevdf entry read back")
        (out["eevdf_agent"],) = explain(agent, tid=os.getpid())
        out["cli_eevdf"] = as_cli(agent, str(sel.tid), tid=sel.tid)
        out["eevdf_s"] = round(time.monotonic() - started, 1)


def main() -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    out: dict[str, Any] = {"kernel": platform.release()}
    sched_ext_phase(out)
    eevdf_phase(out)
    for key in ("cli", "cli_agent", "cli_eevdf"):
        print(out[key])
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
