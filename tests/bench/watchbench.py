"""Processes for the watching benchmarks; each role runs in its own process so none measures itself.

  agent     Engine + Reconciler + a backend (dry run mirrored to a record file, or sched_ext in the lab VM),
            policy `^EngineCore(_DP[0-9]+)?$`; prints "ready", runs until stdin closes, then prints one
            JSON line: CPU time, peak RSS, reconciler stats.
  reader    the independent reader: polls the backend from outside (the dry run's record file, or the
            scheduler's BPF map) and logs when each entry became visible: JSON {key: [seen_ns, ...]}.
  floor     a minimal proc connector listener (blocking recv, no library): when the kernel handed over
            each FORK / COMM event: JSON {"fork": {tid: [ns...]}, "comm": {tid: [[ns, comm]...]}}.
  rename    workload: one thread renames itself into the pattern and out again N times; JSON with the
            tid and the time taken just before each prctl(PR_SET_NAME) into the pattern.
  spawn     workload: a thread named EngineCore_DP0 starts N threads (they inherit the name);
            JSON {tid: time just before Thread.start()}.
  storm     workload: like spawn, 100,000 threads, each living >= 20 ms; JSON with every tid and timing.
  hold      holds N idle threads until stdin closes (the snapshot benchmark's population).
All times are CLOCK_MONOTONIC ns (the clock the kernel stamps proc events with).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import resource
import signal
import socket
import struct
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

PATTERN = "^EngineCore(_DP[0-9]+)?$"
PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def set_name(name: bytes) -> None:
    _libc.prctl(PR_SET_NAME, name, 0, 0, 0)


def now() -> int:
    return time.monotonic_ns()


# ---- agent ----------------------------------------------------------------------------------------------


def run_agent(args: argparse.Namespace) -> int:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from gthulhu_node.backends.base import Backend
    from gthulhu_node.engine import Engine
    from gthulhu_node.intents.model import Intent
    from gthulhu_node.matching import PolicySet
    from gthulhu_node.reconciler import Reconciler

    backend: Backend
    if args.backend == "dry-run":
        from gthulhu_node.backends.dryrun import DryRunBackend

        backend = DryRunBackend(record=Path(args.record))
    else:
        from gthulhu_node.scheduler.backend import SchedExtBackend

        backend = SchedExtBackend()
    backend.start()
    intent = Intent.model_validate(
        {
            "id": "vllm",
            "commandRegex": PATTERN,
            "priority": 10,
            "executionTime": 2_000_000,
            "scope": args.scope,
        }
    )
    policy = PolicySet.build([("local/vllm", intent)])
    engine = Engine(Reconciler(backend, policy=policy), rescan_interval_s=args.rescan)
    engine.start()
    print("ready", flush=True)
    sys.stdin.read()
    st = engine.call(lambda r: r.stats())
    es = engine.stats()
    engine.close()
    backend.stop()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "maxrss_kib": ru.ru_maxrss,
        "events": st.events,
        "events_lost": st.events_lost,
        "reopens": es.events_reopens,
        "scans": st.scans,
        "upserts": st.upserts,
        "deletes": st.deletes,
        "batches": st.batches,
        "tasks_gone": st.tasks_gone,
        "tasks_vanished": st.tasks_vanished,
        "latency_p50_ms_last4096": st.latency_p50_s * 1000,
        "latency_p99_ms_last4096": st.latency_p99_s * 1000,
        "write_failures": st.write_failures,
        "latency_count": st.latency_count,
    }
    print(json.dumps(out), flush=True)
    return 0


# ---- reader ---------------------------------------------------------------------------------------------

_stop = False


def _on_term(signum: int, frame: Any) -> None:
    global _stop
    _stop = True


def run_reader(args: argparse.Namespace) -> int:
    """Poll the record file; every U line's key gets the local time it was first seen."""
    signal.signal(signal.SIGTERM, _on_term)
    seen: dict[str, list[int]] = defaultdict(list)
    path = args.record
    while not os.path.exists(path):
        time.sleep(0.001)
    fd = os.open(path, os.O_RDONLY)
    offset = 0
    partial = b""
    interval = args.poll_us / 1e6
    print("ready", flush=True)
    while not _stop:
        data = os.pread(fd, 1 << 20, offset)
        if not data:
            time.sleep(interval)
            continue
        t = now()
        offset += len(data)
        lines = (partial + data).split(b"\n")
        partial = lines.pop()
        for line in lines:
            if line.startswith(b"U "):
                parts = line.split()
                seen[f"{parts[2].decode()}:{parts[3].decode()}"].append(t)
    os.close(fd)
    Path(args.out).write_text(json.dumps(seen))
    return 0


# ---- floor ----------------------------------------------------------------------------------------------


def run_floor(args: argparse.Namespace) -> int:
    """The kernel's delivery time to the simplest listener there is: blocking recv, unpack two fields."""
    signal.signal(signal.SIGTERM, _on_term)
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 11)  # NETLINK_CONNECTOR
    sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
    sock.bind((0, 1))  # CN_IDX_PROC
    cn = struct.pack("=IIIIHH", 1, 1, 0, 0, 4, 0) + struct.pack("=I", 1)  # PROC_CN_MCAST_LISTEN
    sock.send(struct.pack("=IHHII", 16 + len(cn), 3, 0, 0, os.getpid()) + cn)
    sock.settimeout(0.2)
    forks: dict[int, list[int]] = defaultdict(list)
    comms: dict[int, list[tuple[int, str]]] = defaultdict(list)
    print("ready", flush=True)
    while not _stop:
        try:
            data = sock.recv(4096)
        except TimeoutError:
            continue
        t = now()
        what = struct.unpack_from("=I", data, 36)[0]
        if what == 0x1:
            forks[struct.unpack_from("=I", data, 60)[0]].append(t)
        elif what == 0x200:
            tid = struct.unpack_from("=I", data, 52)[0]
            comm = data[60:76].split(b"\0", 1)[0].decode("utf-8", "replace")
            comms[tid].append((t, comm))
    Path(args.out).write_text(json.dumps({"fork": forks, "comm": comms}))
    return 0


# ---- workloads ------------------------------------------------------------------------------------------


def run_rename(args: argparse.Namespace) -> int:
    starts: list[int] = []
    result: dict[str, Any] = {}

    def body() -> None:
        set_name(b"idle")
        result["tid"] = threading.get_native_id()
        time.sleep(0.2)
        for _ in range(args.count):
            time.sleep(args.interval_ms / 1000)
            t = now()
            set_name(b"EngineCore_DP1")
            starts.append(t)
            time.sleep(args.interval_ms / 1000)
            set_name(b"idle")

    th = threading.Thread(target=body)
    th.start()
    th.join()
    result["starts"] = starts
    Path(args.out).write_text(json.dumps(result))
    return 0


def run_spawn(args: argparse.Namespace) -> int:
    set_name(b"EngineCore_DP0")  # threads inherit their creator's name
    time.sleep(0.2)
    starts: dict[int, int] = {}
    threads = []
    for _ in range(args.count):
        time.sleep(args.interval_ms / 1000)
        th = threading.Thread(target=time.sleep, args=(args.life_ms / 1000,))
        t = now()
        th.start()
        assert th.native_id is not None
        starts[th.native_id] = t
        threads.append(th)
        if len(threads) > 64:
            threads.pop(0).join()
    for th in threads:
        th.join()
    Path(args.out).write_text(json.dumps({"starts": starts}))
    return 0


def run_storm(args: argparse.Namespace) -> int:
    """N threads that each live >= life_ms, at most `concurrency` alive at once, as fast as that allows."""
    threading.stack_size(256 << 10)
    set_name(b"EngineCore_DP0")
    gate = threading.BoundedSemaphore(args.concurrency)
    tids: list[int] = []
    life = args.life_ms / 1000

    def body() -> None:
        time.sleep(life)
        gate.release()

    t0 = now()
    for _ in range(args.count):
        gate.acquire()
        th = threading.Thread(target=body)
        th.start()
        assert th.native_id is not None
        tids.append(th.native_id)
    for _ in range(args.concurrency):
        gate.acquire()
    elapsed = (now() - t0) / 1e9
    Path(args.out).write_text(json.dumps({"tids": tids, "elapsed_s": elapsed, "pid": os.getpid()}))
    return 0


def run_hold(args: argparse.Namespace) -> int:
    """Hold `count` idle threads until stdin closes (the population the snapshot benchmark scans)."""
    threading.stack_size(64 << 10)
    done = threading.Event()
    threads = [threading.Thread(target=done.wait, daemon=True) for _ in range(args.count)]
    for th in threads:
        th.start()
    print("ready", flush=True)
    sys.stdin.read()
    done.set()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="role", required=True)
    a = sub.add_parser("agent")
    a.add_argument("--backend", default="dry-run", choices=["dry-run", "sched_ext"])
    a.add_argument("--record", default="")
    a.add_argument("--scope", default="thread")
    a.add_argument("--rescan", type=float, default=30.0)
    r = sub.add_parser("reader")
    r.add_argument("--record", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--poll-us", type=float, default=100.0)
    f = sub.add_parser("floor")
    f.add_argument("--out", required=True)
    h = sub.add_parser("hold")
    h.add_argument("--count", type=int, default=20_000)
    for name in ("rename", "spawn", "storm"):
        w = sub.add_parser(name)
        w.add_argument("--out", required=True)
        w.add_argument("--count", type=int, default=1000)
        w.add_argument("--interval-ms", type=float, default=4.0)
        w.add_argument("--life-ms", type=float, default=20.0)
        w.add_argument("--concurrency", type=int, default=256)
    for sp in (a, r, f):
        sp.add_argument("--nice", type=int, default=0, help="raise this process's priority (e.g. -10)")
        sp.add_argument("--fifo", type=int, default=0, help="run this process SCHED_FIFO at this priority")
    args = p.parse_args()
    # Only this benchmark process (started by the benchmark itself) is touched, before its threads exist.
    if getattr(args, "nice", 0):
        os.nice(args.nice)
    if getattr(args, "fifo", 0):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.fifo))
    roles = {
        "agent": run_agent,
        "reader": run_reader,
        "floor": run_floor,
        "rename": run_rename,
        "spawn": run_spawn,
        "storm": run_storm,
        "hold": run_hold,
    }
    return roles[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
