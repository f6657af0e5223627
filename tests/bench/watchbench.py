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
  latency   runs floor + agent + reader + rename + spawn and prints the report (host and lab VM alike).
  reaction  runs agent + reader + rename for one backend (dry-run or eevdf) and prints rename -> effect
            p50/p99 as one JSON line; the eevdf reader polls the renamed thread's nice in /proc. Also
            the renamer's prctl times and, with --forkexec, fork+exec beside the agent (none: no agent).
  dropall   a proc connector listener whose kernel-side socket filter drops every event.
  forkexec  workload: start /bin/true N times, waiting for each; JSON with each one's time.
  hold      holds N idle threads until stdin closes (the snapshot benchmark's population).
All times are CLOCK_MONOTONIC ns (the clock the kernel stamps proc events with).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import ctypes
import json
import logging
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

PATTERN = "^EngineCore(_DP[0-9]+)?$"
REPO = Path(__file__).resolve().parents[2]
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
    from gthulhu_node.metrics import Metrics, histogram_count, histogram_quantile
    from gthulhu_node.reconciler import Reconciler

    backend: Backend
    if args.backend == "dry-run":
        from gthulhu_node.backends.dryrun import DryRunBackend

        backend = DryRunBackend(record=Path(args.record))
    elif args.backend == "eevdf":
        from gthulhu_node.backends.eevdf import EevdfBackend

        # As the agent builds it (backends/select.py), the journal included: its cost is part of the path.
        backend = EevdfBackend(
            journal=Path(args.journal) if args.journal else None, engine_slice_ns=args.engine_slice_ns
        )
    else:
        from gthulhu_node.scheduler.backend import SchedExtBackend

        backend = SchedExtBackend(protect_agent=not args.unprotected)
    backend.start()
    if args.backend == "dry-run" and args.engine_slice_ns:
        _engine_slice_on_first_apply(backend, args.engine_slice_ns)
    apply_s = _time_apply(backend)
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
    metrics = Metrics()
    engine.add_latency_listener(metrics.observe_reaction)
    engine.start()
    sched_before = backend.counters()
    print("ready", flush=True)
    for _line in sys.stdin:  # each line asks for the figures so far; end of input ends the agent
        events = sum(engine.call(lambda r: r.stats()).events.values())
        print(json.dumps({"cpu_ns": process_cpu_ns(), "events": events}), flush=True)
    st = engine.call(lambda r: r.stats())
    es = engine.stats()
    sched_after = backend.counters()
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
        # from the reaction histogram's buckets, as a dashboard reads them
        "latency_p50_ms": histogram_quantile(metrics.reaction_latency, 0.50) * 1000,
        "latency_p99_ms": histogram_quantile(metrics.reaction_latency, 0.99) * 1000,
        "write_failures": st.write_failures,
        "latency_count": histogram_count(metrics.reaction_latency),
        "scheduler": {k: v - sched_before.get(k, 0) for k, v in sched_after.items()},
        "apply_p50_ms": pct(apply_s, 0.5) * 1e3,
        "apply_p99_ms": pct(apply_s, 0.99) * 1e3,
    }
    print(json.dumps(out), flush=True)
    return 0


def process_cpu_ns(pid: int | str = "self") -> int:
    """CPU time of every thread of a process, in ns (schedstat: exact, not in clock ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def _engine_slice_on_first_apply(backend: Any, slice_ns: int) -> None:
    """For the dry run: the same slice request the eevdf backend gives the engine thread, so both
    agents wake alike and the comparison measures the backends."""
    from gthulhu_node.backends.sched_attr import SchedAttr, SchedAttrSyscalls

    apply = backend.apply
    done: list[int] = []

    def first(*args: Any, **kw: Any) -> Any:
        if not done:
            calls, tid = SchedAttrSyscalls(), threading.get_native_id()
            now = calls.get(tid)
            calls.set(tid, SchedAttr(now.policy, now.nice, slice_ns, now.reset_on_fork))
            done.append(tid)
        return apply(*args, **kw)

    backend.apply = first


def _time_apply(backend: Any) -> list[float]:
    """Wrap the backend's apply() to time every batch (seconds): what the backend adds to a reaction."""
    times: list[float] = []
    apply = backend.apply

    def timed(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return apply(*args, **kw)
        finally:
            times.append(time.perf_counter() - t)

    backend.apply = timed
    return times


# ---- reader ---------------------------------------------------------------------------------------------

_stop = False


def _on_term(signum: int, frame: Any) -> None:
    global _stop
    _stop = True


def _open_map_by_name(name: str) -> int:
    """An fd for the newest loaded BPF map called `name` (another process's map, found by id)."""
    from gthulhu_node.scheduler import libbpf

    lib = libbpf.lib()
    cur, nxt = ctypes.c_uint32(0), ctypes.c_uint32()
    found = -1
    while lib.bpf_map_get_next_id(cur.value, ctypes.byref(nxt)) == 0:
        cur.value = nxt.value
        fd = lib.bpf_map_get_fd_by_id(nxt.value)
        if fd < 0:
            continue
        info = libbpf._MapInfo()
        size = ctypes.c_uint32(ctypes.sizeof(info))
        if (
            lib.bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)) == 0
            and info.name == name.encode()
        ):
            if found >= 0:
                os.close(found)
            found = fd
        else:
            os.close(fd)
    if found < 0:
        raise SystemExit(f"no BPF map {name} is loaded")
    return found


def run_bpf_reader(args: argparse.Namespace) -> int:
    """Poll the scheduler's tid_map (read from the kernel): each key's appearances get the local time."""
    from gthulhu_node.scheduler import libbpf

    signal.signal(signal.SIGTERM, _on_term)
    fd = _open_map_by_name("tid_map")
    seen: dict[str, list[int]] = defaultdict(list)
    present: set[int] = set()
    interval = args.poll_us / 1e6
    print("ready", flush=True)
    while not _stop:
        keys = set(libbpf.map_keys(fd, ctypes.c_uint32))
        t = now()
        for k in keys - present:
            seen[f"tid:{k}"].append(t)
        present = keys
        time.sleep(interval)
    os.close(fd)
    Path(args.out).write_text(json.dumps(seen))
    return 0


def run_nice_reader(args: argparse.Namespace) -> int:
    """Poll one thread's nice (field 19 of /proc/<tid>/stat, re-read through one open fd): each change
    from not boosted (nice >= 0) to boosted gets the local time. The tid comes from the workload's file."""
    signal.signal(signal.SIGTERM, _on_term)
    print("ready", flush=True)
    tid_file = Path(args.tid_file)
    while not _stop and not tid_file.exists():
        time.sleep(0.001)
    seen: dict[str, list[int]] = defaultdict(list)
    if _stop:
        Path(args.out).write_text(json.dumps(seen))
        return 0
    tid = int(tid_file.read_text())
    fd = os.open(f"/proc/{tid}/stat", os.O_RDONLY)
    interval = args.poll_us / 1e6
    boosted = False
    while not _stop:
        try:
            data = os.pread(fd, 4096, 0)
        except ProcessLookupError:
            break
        t = now()
        if not data:
            break
        nice = int(data[data.rindex(b")") + 2 :].split()[16])
        if nice < 0 and not boosted:
            seen[f"tid:{tid}"].append(t)
        boosted = nice < 0
        time.sleep(interval)
    os.close(fd)
    Path(args.out).write_text(json.dumps(seen))
    return 0


def run_reader(args: argparse.Namespace) -> int:
    """Poll the record file; every U line's key gets the local time it was first seen."""
    if args.source == "bpf":
        return run_bpf_reader(args)
    if args.source == "nice":
        return run_nice_reader(args)
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


def run_dropall(args: argparse.Namespace) -> int:
    """A proc connector listener whose socket filter (classic BPF: `ret 0`) drops every message in the
    kernel: nothing is queued and it never wakes. What fork+exec costs beside it is what the kernel pays
    for one listener even when a kernel-side filter spares the agent every event of no interest."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 11)  # NETLINK_CONNECTOR
    drop_all = ctypes.create_string_buffer(struct.pack("=HBBI", 0x06, 0, 0, 0))  # BPF_RET | BPF_K, 0
    sock.setsockopt(socket.SOL_SOCKET, 26, struct.pack("HxxxxxxQ", 1, ctypes.addressof(drop_all)))
    sock.bind((0, 1))  # CN_IDX_PROC
    cn = struct.pack("=IIIIHH", 1, 1, 0, 0, 4, 0) + struct.pack("=I", 1)  # PROC_CN_MCAST_LISTEN
    sock.send(struct.pack("=IHHII", 16 + len(cn), 3, 0, 0, os.getpid()) + cn)
    print("ready", flush=True)
    sys.stdin.read()
    sock.close()
    return 0


# ---- workloads ------------------------------------------------------------------------------------------


def run_rename(args: argparse.Namespace) -> int:
    starts: list[int] = []
    prctl_ns: list[int] = []  # how long each prctl(PR_SET_NAME) took, in and out: what the agent costs it
    seen: list[int] = []  # --self-poll: when the thread saw its own nice go negative (0: not in time)
    result: dict[str, Any] = {}

    def body() -> None:
        set_name(b"idle")
        result["tid"] = threading.get_native_id()
        if args.tid_file:
            tmp = Path(args.tid_file + ".tmp")
            tmp.write_text(str(result["tid"]))
            tmp.rename(args.tid_file)
        stat_fd = os.open(f"/proc/self/task/{result['tid']}/stat", os.O_RDONLY)
        time.sleep(0.2)
        interval_ns = int(args.interval_ms * 1e6)
        for _ in range(args.count):
            time.sleep(args.interval_ms / 1000)
            t = now()
            set_name(args.name.encode())
            done = now()
            starts.append(t)
            prctl_ns.append(done - t)
            if args.self_poll:  # busy reading its own nice until boosted (issue 43's measurement)
                seen.append(_poll_own_nice(stat_fd, t + interval_ns))
                while now() - t < interval_ns:
                    pass
            elif args.spin:  # an engine that renamed itself and computes: busy on its CPU, as the agent wakes
                while now() - t < interval_ns:
                    pass
            else:
                time.sleep(args.interval_ms / 1000)
            t = now()
            set_name(b"idle")
            prctl_ns.append(now() - t)

    th = threading.Thread(target=body)
    th.start()
    th.join()
    result["starts"] = starts
    result["prctl_ns"] = prctl_ns
    result["self_seen"] = seen
    Path(args.out).write_text(json.dumps(result))
    return 0


def _poll_own_nice(fd: int, deadline: int) -> int:
    """Read this thread's nice (field 19 of its stat) without pause until it is negative: the time
    then, or 0 at the deadline."""
    while (t := now()) < deadline:
        data = os.pread(fd, 4096, 0)
        if int(data[data.rindex(b")") + 2 :].split()[16]) < 0:
            return t
    return 0


def run_forkexec(args: argparse.Namespace) -> int:
    """Start /bin/true and wait for it, N times (posix_spawn: vfork + exec, as a shell does): how long
    each took. Each one is a fork, an exec and an exit event for every proc connector listener."""
    times: list[int] = []
    for _ in range(args.count):
        t = now()
        pid = os.posix_spawn("/bin/true", ["/bin/true"], {})
        os.waitpid(pid, 0)
        times.append(now() - t)
    Path(args.out).write_text(json.dumps({"ns": times}))
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
    if args.name:
        set_name(args.name.encode())  # the threads inherit it
    done = threading.Event()
    threads = [threading.Thread(target=done.wait, daemon=True) for _ in range(args.count)]
    for th in threads:
        th.start()
    print("ready", flush=True)
    sys.stdin.read()
    done.set()
    return 0


class Role:
    """One helper process of this module; waits for its "ready" line."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.watchbench", *args],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.p.stdout is not None
        line = self.p.stdout.readline().strip()
        if line != "ready":
            self.kill()
            raise SystemExit(f"{args[0]} did not start: {line!r}")

    def figures(self) -> dict[str, Any]:
        """The agent's figures so far (one line in, one JSON line out)."""
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write("\n")
        self.p.stdin.flush()
        while True:  # a log line (structlog writes warnings to stdout) may come first
            line = self.p.stdout.readline()
            if not line:
                raise SystemExit("the agent ended before answering")
            if line.startswith('{"cpu_ns"'):
                result: dict[str, Any] = json.loads(line)
                return result

    def finish(self) -> str:
        """Close stdin (the agent's stop signal); the last line it printed."""
        out, _ = self.p.communicate(timeout=300)
        return out.strip().splitlines()[-1] if out.strip() else ""

    def terminate(self) -> None:
        self.p.terminate()
        self.p.wait(timeout=120)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def workload(role: str, out: Path, **kw: object) -> dict[str, Any]:
    flags = {f"--{k.replace('_', '-')}": v for k, v in kw.items() if v is not False}
    args = [k if v is True else f"{k}={v}" for k, v in flags.items()]
    subprocess.run(
        [sys.executable, "-m", "tests.bench.watchbench", role, f"--out={out}", *args],
        cwd=REPO,
        check=True,
        timeout=900,
    )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _first_at_or_after(times: list[int], t0: int) -> int | None:
    i = bisect.bisect_left(times, t0)
    return times[i] if i < len(times) else None


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def _start_hogs(count: int, cwd: Path) -> subprocess.Popen[bytes]:
    """`stress-ng --cpu count` for the whole measurement: the load of the engine-step benchmark."""
    return subprocess.Popen(
        ["stress-ng", "--cpu", str(count), "--timeout", "3600s"],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its workers are killed with it, as a group
    )


def run_latency(args: argparse.Namespace) -> int:
    """The whole reaction-latency measurement: floor, agent, reader, both workloads; prints a report
    and, last, one JSON line with the figures."""
    tmp = Path(tempfile.mkdtemp(prefix="gthulhu-latency-"))
    record = tmp / "record"
    prio = [args.prio] if args.prio else []
    observer = [args.observer_prio] if args.observer_prio else prio
    roles: list[Role] = []
    hogs = _start_hogs(args.hogs, tmp) if args.hogs else None
    try:
        floor = Role("floor", f"--out={tmp / 'floor.json'}", *observer)
        roles.append(floor)
        agent_args = ["agent", f"--backend={args.backend}", *prio]
        if args.backend == "dry-run":
            agent_args.append(f"--record={record}")
        if args.unprotected:
            agent_args.append("--unprotected")
        agent = Role(*agent_args)
        roles.append(agent)
        source = ["--source=bpf"] if args.backend == "sched_ext" else [f"--record={record}"]
        reader = Role(
            "reader", *source, f"--out={tmp / 'reader.json'}", f"--poll-us={args.poll_us}", *observer
        )
        roles.append(reader)
        rename = workload("rename", tmp / "rename.json", count=args.count, interval_ms=args.interval_ms)
        spawn = workload(
            "spawn", tmp / "spawn.json", count=args.count, interval_ms=args.interval_ms, life_ms=args.life_ms
        )
        time.sleep(0.5)
        reader.terminate()
        floor.terminate()
        agent_stats = json.loads(agent.finish())
    finally:
        for r in roles:
            r.kill()
        if hogs is not None:
            os.killpg(hogs.pid, signal.SIGKILL)
            hogs.wait()
    seen = {k: sorted(v) for k, v in json.loads((tmp / "reader.json").read_text()).items()}
    fl = json.loads((tmp / "floor.json").read_text())
    rows: dict[str, list[float]] = {
        "rename agent": [],
        "rename floor": [],
        "spawn agent": [],
        "spawn floor": [],
    }
    missed = {"rename": 0, "spawn": 0}
    tid = rename["tid"]
    entry_seen = seen.get(f"tid:{tid}", [])
    comm_seen = sorted(t for t, comm in fl["comm"].get(str(tid), []) if comm == "EngineCore_DP1")
    for t0 in rename["starts"]:
        a, f = _first_at_or_after(entry_seen, t0), _first_at_or_after(comm_seen, t0)
        if a is None:
            missed["rename"] += 1
        else:
            rows["rename agent"].append((a - t0) / 1e6)
        if f is not None:
            rows["rename floor"].append((f - t0) / 1e6)
    for tid_s, t0 in spawn["starts"].items():
        a = _first_at_or_after(seen.get(f"tid:{tid_s}", []), t0)
        f = _first_at_or_after(sorted(fl["fork"].get(tid_s, [])), t0)
        if a is None:
            missed["spawn"] += 1
        else:
            rows["spawn agent"].append((a - t0) / 1e6)
        if f is not None:
            rows["spawn floor"].append((f - t0) / 1e6)
    load = f", beside stress-ng --cpu {args.hogs}" if args.hogs else ""
    guard = ", agent NOT protected by the scheduler" if args.unprotected else ""
    print(
        "reaction latency, workload timestamp -> entry seen by an independent reader"
        f" ({args.backend}{load}{guard})"
    )
    for name, ms in rows.items():
        print(
            f"  {name:<14} n={len(ms):5d}  p50={pct(ms, 0.5):8.3f} ms  p99={pct(ms, 0.99):8.3f} ms  "
            f"max={max(ms, default=float('nan')):8.3f} ms"
        )
    ratios = {k: pct(rows[f"{k} agent"], 0.99) / pct(rows[f"{k} floor"], 0.99) for k in ("rename", "spawn")}
    for k, v in ratios.items():
        print(f"  {k}: agent p99 / floor p99 = {v:.1f}x")
    print(f"  agent: {agent_stats}")
    summary = {
        name: {"n": len(ms), "p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99)} for name, ms in rows.items()
    }
    print(json.dumps({"rows": summary, "ratios": ratios, "missed": missed, "agent": agent_stats}))
    return 0


def run_reaction(args: argparse.Namespace) -> int:
    """Rename -> effect for one backend, every role its own process: the agent (Engine + Reconciler +
    backend), the independent reader (the dry run's record file, or the renamed thread's nice) and the
    rename workload; then, with `--forkexec N`, N starts of /bin/true beside the agent alone. `--backend
    none` runs the workloads without agent or reader: the baseline of what the agent costs them; `dropall`
    beside a listener whose kernel-side filter drops every event (what such a filter could save). Prints
    one JSON line: n, missed, p50/p99/max in ms, the renamer's prctl times, the fork+exec times, the
    agent's CPU per event in the fork+exec phase, the agent's stats."""
    tmp = Path(tempfile.mkdtemp(prefix="gthulhu-reaction-"))
    record, tid_file = tmp / "record", tmp / "tid"
    prio = [args.prio] if args.prio else []
    observer = [args.observer_prio] if args.observer_prio else prio
    roles: list[Role] = []
    agent: Role | None = None
    out: dict[str, Any] = {"backend": args.backend, "load_before": os.getloadavg()[0]}
    hogs = _start_hogs(args.hogs, tmp) if args.hogs else None
    try:
        if args.backend == "dropall":
            roles.append(Role("dropall"))
        elif args.backend != "none":
            agent_args = ["agent", f"--backend={args.backend}", f"--engine-slice-ns={args.engine_slice_ns}",
                          *prio]
            if args.backend == "dry-run":
                agent_args.append(f"--record={record}")
            elif not args.no_journal:
                agent_args.append(f"--journal={tmp / 'journal.json'}")
            agent = Role(*agent_args)
            roles.append(agent)
        if agent is not None and not args.self_poll:
            source = [f"--record={record}"] if args.backend == "dry-run" else ["--source=nice"]
            reader = Role(
                "reader",
                *source,
                f"--tid-file={tid_file}",
                f"--out={tmp / 'reader.json'}",
                f"--poll-us={args.poll_us}",
                *observer,
            )
            roles.append(reader)
        rename = workload(
            "rename",
            tmp / "rename.json",
            count=args.count,
            interval_ms=args.interval_ms,
            name="EngineCore_DP0",
            tid_file=tid_file,
            spin=args.spin,
            self_poll=args.self_poll,
        )
        if agent is not None and not args.self_poll:
            time.sleep(0.3)
            reader.terminate()
        if args.forkexec:
            before = agent.figures() if agent is not None else None
            fe = workload("forkexec", tmp / "forkexec.json", count=args.forkexec)
            ms = [t / 1e6 for t in fe["ns"]]
            out["forkexec_p50_ms"], out["forkexec_p99_ms"] = pct(ms, 0.5), pct(ms, 0.99)
            if agent is not None and before is not None:
                after = agent.figures()
                events = after["events"] - before["events"]
                out["forkexec_events"] = events
                out["agent_us_per_event"] = (after["cpu_ns"] - before["cpu_ns"]) / 1e3 / max(1, events)
        agent_stats = json.loads(agent.finish()) if agent is not None else {}
    finally:
        for r in roles:
            r.kill()
        if hogs is not None:
            os.killpg(hogs.pid, signal.SIGKILL)
            hogs.wait()
    read: dict[str, list[int]] = {}
    if agent is not None and not args.self_poll:
        read = json.loads((tmp / "reader.json").read_text())
    shutil.rmtree(tmp, ignore_errors=True)
    prctl_ms = [t / 1e6 for t in rename["prctl_ns"]]
    out.update(prctl_p50_ms=pct(prctl_ms, 0.5), prctl_p99_ms=pct(prctl_ms, 0.99), agent=agent_stats,
               load_after=os.getloadavg()[0])
    if agent is None:
        print(json.dumps(out))
        return 0
    if args.self_poll:
        seen = sorted(t for t in rename["self_seen"] if t)
    else:
        seen = sorted(read.get(f"tid:{rename['tid']}", []))
    starts = rename["starts"]
    delays: list[float] = []
    missed: list[int] = []
    for i, t0 in enumerate(starts):
        # Seen before the next rename in, else it belongs to that one (or was missed).
        a = _first_at_or_after(seen, t0)
        nxt = starts[i + 1] if i + 1 < len(starts) else None
        if a is None or (nxt is not None and a >= nxt):
            missed.append(i)
        else:
            delays.append((a - t0) / 1e6)
    out.update(
        n=len(delays),
        missed=missed,
        p50_ms=pct(delays, 0.5),
        p90_ms=pct(delays, 0.9),
        p99_ms=pct(delays, 0.99),
        max_ms=max(delays, default=float("nan")),
    )
    print(json.dumps(out))
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="role", required=True)
    a = sub.add_parser("agent")
    a.add_argument("--backend", default="dry-run", choices=["dry-run", "sched_ext", "eevdf"])
    a.add_argument("--record", default="")
    a.add_argument("--journal", default="", help="eevdf: the journal file (none: no journal)")
    a.add_argument("--scope", default="thread")
    a.add_argument("--rescan", type=float, default=30.0)
    a.add_argument("--unprotected", action="store_true", help="sched_ext: no boost for the agent itself")
    a.add_argument("--engine-slice-ns", type=int, default=0, help="eevdf, dry-run: the engine thread's slice")
    r = sub.add_parser("reader")
    r.add_argument("--record", default="")
    r.add_argument("--source", default="record", choices=["record", "bpf", "nice"])
    r.add_argument("--tid-file", default="", help="nice: the file the workload writes its tid to")
    r.add_argument("--out", required=True)
    r.add_argument("--poll-us", type=float, default=100.0)
    f = sub.add_parser("floor")
    f.add_argument("--out", required=True)
    sub.add_parser("dropall")
    lat = sub.add_parser("latency")
    lat.add_argument("--backend", default="dry-run", choices=["dry-run", "sched_ext"])
    lat.add_argument("--prio", default="", help="passed to agent, reader and floor: --fifo=10, --nice=-10")
    lat.add_argument("--count", type=int, default=1000)
    lat.add_argument("--interval-ms", type=float, default=4.0)
    lat.add_argument("--life-ms", type=float, default=50.0, help="how long each spawned thread lives")
    lat.add_argument("--poll-us", type=float, default=100.0, help="the reader's poll interval")
    lat.add_argument("--observer-prio", default="", help="for floor and reader only (default: --prio)")
    lat.add_argument("--hogs", type=int, default=0, help="run stress-ng --cpu N during the measurement")
    lat.add_argument("--unprotected", action="store_true", help="sched_ext: no boost for the agent itself")
    rc = sub.add_parser("reaction")
    rc.add_argument("--backend", default="dry-run", choices=["dry-run", "eevdf", "none", "dropall"])
    rc.add_argument("--prio", default="", help="passed to agent and reader: --fifo=10, --nice=-10")
    rc.add_argument("--observer-prio", default="", help="for the reader only (default: --prio)")
    rc.add_argument("--count", type=int, default=300)
    rc.add_argument("--interval-ms", type=float, default=10.0)
    rc.add_argument("--poll-us", type=float, default=100.0, help="the reader's poll interval")
    rc.add_argument("--no-journal", action="store_true", help="eevdf: without its journal (to measure it)")
    rc.add_argument("--spin", action="store_true", help="the renamed thread is busy while in the pattern")
    rc.add_argument("--self-poll", action="store_true",
                    help="eevdf: the renamed thread itself polls its nice (busy) instead of the reader")
    rc.add_argument("--forkexec", type=int, default=0, help="then start /bin/true N times beside the agent")
    rc.add_argument("--engine-slice-ns", type=int, default=0, help="the agent engine thread's slice request")
    rc.add_argument("--hogs", type=int, default=0, help="run stress-ng --cpu N during the measurement")
    h = sub.add_parser("hold")
    h.add_argument("--count", type=int, default=20_000)
    h.add_argument("--name", default="", help="the name the threads get (inherited from the main thread)")
    for name in ("rename", "spawn", "storm", "forkexec"):
        w = sub.add_parser(name)
        w.add_argument("--out", required=True)
        w.add_argument("--count", type=int, default=1000)
        w.add_argument("--interval-ms", type=float, default=4.0)
        w.add_argument("--life-ms", type=float, default=20.0)
        w.add_argument("--concurrency", type=int, default=256)
        w.add_argument("--name", default="EngineCore_DP1", help="rename: the name taken N times")
        w.add_argument("--tid-file", default="", help="rename: write the renamed thread's tid here first")
        w.add_argument("--spin", action="store_true", help="rename: busy (not asleep) while in the pattern")
        w.add_argument("--self-poll", action="store_true", help="rename: poll its own nice, busy, while in")
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
        "dropall": run_dropall,
        "rename": run_rename,
        "spawn": run_spawn,
        "forkexec": run_forkexec,
        "storm": run_storm,
        "hold": run_hold,
        "latency": run_latency,
        "reaction": run_reaction,
    }
    return roles[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
