"""Guest-side workloads for tests/vm/test_scheduler.py: each loads the real scheduler in the lab VM, runs
real tasks under it and prints one JSON object with what it measured (the test asserts on it).

Run inside the lab guest as root: `.venv/bin/python tests/vm/sched_workloads.py <scenario>`.
CPU-bound workers are forked processes (no GIL between them); CPU time comes from /proc/<pid>/schedstat.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import structlog

from gthulhu_node import capabilities
from gthulhu_node.backends.base import (
    BackendState,
    Entry,
    EntryKey,
    InvalidEntryError,
    KeyKind,
    MapFullError,
    TaskGoneError,
)
from gthulhu_node.config import SchedulerConfig
from gthulhu_node.limits import boost_levels_strongest_first
from gthulhu_node.scheduler import libbpf, loader
from gthulhu_node.scheduler.backend import SchedExtBackend, task_start_time
from tests.vm.shares import STALLED_WINDOW
from tests.vm.switch_trace import switches

STRONGEST = boost_levels_strongest_first()[0]  # the top level, whichever number the scale gives it

# stdout carries the JSON result only
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def set_comm(name: str) -> None:
    _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def run_ns(pid: int, tid: int | None = None) -> int:
    """CPU time a task has had (first field of schedstat)."""
    path = f"/proc/{pid}/task/{tid}/schedstat" if tid else f"/proc/{pid}/schedstat"
    return int(Path(path).read_text().split()[0])


def schedstat(pid: int) -> tuple[int, int, int]:
    run, wait, turns = Path(f"/proc/{pid}/schedstat").read_text().split()
    return int(run), int(wait), int(turns)


def fork_worker(body: Callable[[], None], name: str, cpus: set[int] | None = None) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            set_comm(name)
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            body()
        finally:
            os._exit(0)
    return pid


def spin() -> None:
    while True:
        pass


def busy_fraction(busy_ms: float, sleep_ms: float) -> Callable[[], None]:
    """Busy for busy_ms of the thread's own CPU time, then sleep: a fixed share whatever the contention."""

    def body() -> None:
        while True:
            end = time.thread_time_ns() + int(busy_ms * 1e6)
            while time.thread_time_ns() < end:
                pass
            time.sleep(sleep_ms / 1000)

    return body


@contextlib.contextmanager
def workers() -> Iterator[list[int]]:
    pids: list[int] = []
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


@contextlib.contextmanager
def scheduler(**cfg: Any) -> Iterator[SchedExtBackend]:
    # The driver is the agent here: protected like the agent, so measurements are read on time.
    backend = SchedExtBackend(SchedulerConfig(**cfg), protect_agent=True)
    backend.start()
    try:
        yield backend
    finally:
        backend.stop()


def key_for(kind: KeyKind, pid: int) -> tuple[EntryKey, int]:
    start = task_start_time(pid)
    assert start is not None
    return EntryKey(kind, pid), start


def cpu_shares(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Fraction of one CPU each task got over about `seconds` (timestamps taken next to the reads)."""
    t0 = time.monotonic()
    before = {name: run_ns(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    after = {name: run_ns(pid) for name, pid in pids.items()}
    elapsed = time.monotonic() - t0
    return {name: (after[name] - before[name]) / 1e9 / elapsed for name in pids}


def measure_stalls(seconds: float, cpu: int | None = None,
                   period: float = 0.001) -> Callable[[], dict[str, float]]:
    """Fork a SCHED_FIFO 99 process (pinned to `cpu` if given) that sleeps `period` at a time for `seconds`
    and adds up every oversleep past 20 ms. Nothing in the guest can delay it that long but the emulator
    itself: a TCG guest loses the host CPU for tens of ms on a loaded machine, and a task's measured wait
    (or run time: the guest clock goes on while its vCPU is stopped) includes that time, which no guest
    scheduler can help (the bound excludes it, as it excludes RT time). Shorter oversleeps are the emulated
    timer's usual lateness (up to ~12 ms measured, about 2 s of it in 3 s), not stalls. Returns a function
    that waits for the end and gives the total and the longest stall in ms."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(99))
            total = longest = 0.0
            end = time.monotonic() + seconds
            while (t := time.monotonic()) < end:
                time.sleep(period)
                late = time.monotonic() - t - period
                if late > 0.020:
                    total += late
                    longest = max(longest, late)
            os.write(w, json.dumps({"total_ms": total * 1e3, "longest_ms": longest * 1e3}).encode())
        finally:
            os._exit(0)
    os.close(w)

    def result() -> dict[str, float]:
        with os.fdopen(r) as f:
            data = f.read()
        os.waitpid(pid, 0)
        return dict(json.loads(data))

    return result


def state() -> dict[str, str]:
    s, ops = loader.sched_ext_state()
    return {"state": s, "ops": ops}


# --- scenarios ---------------------------------------------------------------------------------------


def lifecycle(_: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"before": state()}
    backend = SchedExtBackend(SchedulerConfig(), protect_agent=False)
    backend.start()
    out["loaded"] = state()
    out["health"] = backend.health().state.value
    out["counters_after_load"] = backend.counters()
    backend.stop()
    out["stopped"] = state()
    out["health_stopped"] = backend.health().state.value
    return out


def verifier(_: argparse.Namespace) -> dict[str, Any]:
    """The scheduler loaded with the verifier's statistics: instructions processed, per program."""
    sched = loader.load(loader.LoadSettings(verifier_stats=True))
    try:
        return {"flavour": sched.flavour, "insns": dict(sched.verifier_insns)}
    finally:
        sched.detach()


def load_intruder() -> Any:
    """Another sched_ext scheduler, our object renamed "intruder", loaded (verified) but not attached: its
    attach then takes milliseconds, so it can take the slot the moment ours leaves it."""
    path = loader.object_path(loader.kfunc_flavour())
    elf = loader.patch_ops(path.read_bytes(), name="intruder")
    obj = libbpf.BpfObject(elf, "intruder")
    obj.program("gthulhu_init").add_flags(libbpf.BPF_F_SLEEPABLE)
    obj.load()
    return obj


def other_scheduler(_: argparse.Namespace) -> dict[str, Any]:
    """Another sched_ext scheduler (our object renamed) is running: our start must refuse to displace it."""
    obj = load_intruder()
    link = obj.map(loader.OPS_MAP).attach_struct_ops()
    try:
        out: dict[str, Any] = {"running": state()}
        backend = SchedExtBackend(SchedulerConfig(), protect_agent=False)
        try:
            backend.start()
            out["error"] = None
            backend.stop()
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["after"] = state()
    finally:
        link.destroy()
        obj.close()
    out["final"] = state()
    return out


def crashed_agent(_: argparse.Namespace) -> dict[str, Any]:
    """An agent that loads, writes entries and dies by SIGKILL; the next start must take over cleanly."""
    out: dict[str, Any] = {}
    with workers() as pids:
        pids.append(fork_worker(lambda: time.sleep(600), "crash-victim"))
        time.sleep(0.2)
        child = subprocess.Popen(
            [sys.executable, __file__, "_hold", str(pids[0])], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        out["child_said"] = child.stdout.readline().strip()
        child.kill()
        child.wait()
        time.sleep(0.5)
        out["after_kill"] = state()
        backend = SchedExtBackend(SchedulerConfig(), protect_agent=False)
        backend.start()
        try:
            out["after_takeover"] = state()
            out["entries_after_takeover"] = len(backend.read_back())
            out["live_after_takeover"] = backend.gauges()["live_tid_entries"]
            key, start = key_for(KeyKind.TID, pids[0])
            res = backend.apply({key: Entry(9, 0, start)}, [])
            out["upserted_after_takeover"] = res.upserted
        finally:
            backend.stop()
    out["final"] = state()
    return out


def _hold(args: argparse.Namespace) -> dict[str, Any]:
    backend = SchedExtBackend(SchedulerConfig(), protect_agent=False)
    backend.start()
    key, start = key_for(KeyKind.TID, int(args.arg))
    backend.apply({key: Entry(7, 0, start)}, [])
    print(f"entries={len(backend.read_back())}", flush=True)
    time.sleep(600)
    return {}


def tid_tgid_share(args: argparse.Namespace) -> dict[str, Any]:
    """Boosted by TID, boosted by TGID fallback, and an unmatched twin, among CPU hogs."""
    out: dict[str, Any] = {}
    ncpu = os.cpu_count() or 1
    with scheduler() as backend, workers() as pids:
        for i in range(2 * ncpu):
            pids.append(fork_worker(spin, f"hog{i}"))
        by_tid = fork_worker(spin, "by-tid")
        by_tgid = fork_worker(spin, "by-tgid")
        twin = fork_worker(spin, "twin")
        pids += [by_tid, by_tgid, twin]
        time.sleep(0.3)
        before = backend.counters()
        k1, s1 = key_for(KeyKind.TID, by_tid)
        k2, s2 = key_for(KeyKind.TGID, by_tgid)
        res = backend.apply({k1: Entry(10, 0, s1), k2: Entry(10, 0, s2)}, [])
        out["apply"] = {"upserted": res.upserted, "failed": {str(k): str(e) for k, e in res.failed.items()}}
        out["shares"] = cpu_shares({"by_tid": by_tid, "by_tgid": by_tgid, "twin": twin}, args.seconds)
        after = backend.counters()
        keys = ("tid_hits", "tgid_hits", "boosted_dispatches", "agent_boosts")
        out["delta"] = {k: after[k] - before[k] for k in keys}
        out["health"] = backend.health().state.value
    return out


def slice_only(args: argparse.Namespace) -> dict[str, Any]:
    """Two CPU-bound tasks on one CPU, priority 0, slices far apart: run length per turn follows the slice."""
    out: dict[str, Any] = {}
    cpu = {(os.cpu_count() or 1) - 1}
    with scheduler() as backend, workers() as pids:
        long_ = fork_worker(spin, "long-slice", cpu)
        short = fork_worker(spin, "short-slice", cpu)
        default = fork_worker(spin, "default-slice", cpu)
        pids += [long_, short, default]
        time.sleep(0.3)
        k1, s1 = key_for(KeyKind.TID, long_)
        k2, s2 = key_for(KeyKind.TID, short)
        backend.apply({k1: Entry(0, 40_000_000, s1), k2: Entry(0, 1_000_000, s2)}, [])
        before = {n: schedstat(p) for n, p in (("long", long_), ("short", short), ("default", default))}
        time.sleep(args.seconds)
        for name, pid in (("long", long_), ("short", short), ("default", default)):
            run, _, turns = schedstat(pid)
            d_run, d_turns = run - before[name][0], turns - before[name][2]
            per_turn = d_run / 1e6 / max(d_turns, 1)
            out[name] = {"run_ms": d_run / 1e6, "turns": d_turns, "ms_per_turn": per_turn}
        out["health"] = backend.health().state.value
    return out


def no_leak(args: argparse.Namespace) -> dict[str, Any]:
    """Thousands of short-lived matched threads (tests/vm/leaky_threads.c); a writer scanning /proc races
    their lifetimes and never deletes anything itself: the scheduler and the writer's recheck must."""
    binary = "/tmp/leaky_threads"
    src = Path(__file__).with_name("leaky_threads.c")
    subprocess.run(["clang", "-O2", "-pthread", "-o", binary, str(src)], check=True)
    out: dict[str, Any] = {"threads": args.threads}
    with scheduler() as backend:
        proc = subprocess.Popen(
            [binary, str(args.threads), "4"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdin is not None
        done = threading.Event()
        spawner_out = proc.stdout

        def wait_spawned() -> None:
            spawner_out.readline()
            done.set()

        threading.Thread(target=wait_spawned, daemon=True).start()
        tgid_key, tgid_start = key_for(KeyKind.TGID, proc.pid)
        backend.apply({tgid_key: Entry(9, 0, tgid_start)}, [])
        written = gone = scans = 0
        while True:
            finished = done.is_set()
            batch: dict[EntryKey, Entry] = {}
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(f"/proc/{proc.pid}/task"):
                    tid = int(name)
                    if tid == proc.pid:
                        continue
                    start = task_start_time(tid)
                    if start is not None:
                        batch[EntryKey(KeyKind.TID, tid)] = Entry(8, 0, start)
            res = backend.apply(batch, [])
            written += res.upserted
            gone += sum(isinstance(e, TaskGoneError) for e in res.failed.values())
            scans += 1
            if finished:
                break
        time.sleep(0.5)
        live = {int(n) for n in os.listdir(f"/proc/{proc.pid}/task")} - {proc.pid}
        counters = {**backend.counters(), **backend.gauges()}
        out.update(
            scans=scans,
            writes=written,
            gone_at_write=gone,
            live_matched=sorted(live),
            held=sorted(k.id for k in backend.read_back() if k.kind is KeyKind.TID),
            live_tid_entries=counters["live_tid_entries"],
            live_tgid_entries=counters["live_tgid_entries"],
            exit_deleted_tid=counters["exit_deleted_tid"],
        )
        proc.stdin.close()
        proc.wait()
        time.sleep(0.3)
        counters = {**backend.counters(), **backend.gauges()}
        out["after_exit"] = {
            k: counters[k] for k in ("live_tid_entries", "live_tgid_entries", "exit_deleted_tgid")
        }
    return out


def no_leak_agent(args: argparse.Namespace) -> dict[str, Any]:
    """The same spawner, driven through the agent's engine: proc connector events, RE2 matching and the
    reconciler's batched writes into SchedExtBackend (the path the running agent takes)."""
    from gthulhu_node.engine import Engine
    from gthulhu_node.intents.model import Intent
    from gthulhu_node.matching import PolicySet
    from gthulhu_node.reconciler import Reconciler

    binary = "/tmp/leaky_threads"
    src = Path(__file__).with_name("leaky_threads.c")
    subprocess.run(["clang", "-O2", "-pthread", "-o", binary, str(src)], check=True)
    out: dict[str, Any] = {"threads": args.threads}
    intent = Intent.model_validate({"id": "leaky", "commandRegex": "^leaky$", "priority": 8})
    with scheduler() as backend:
        reconciler = Reconciler(backend, policy=PolicySet.build([("test/leaky", intent)]))
        engine = Engine(reconciler, rescan_interval_s=2.0)
        engine.start()
        try:
            proc = subprocess.Popen(
                [binary, str(args.threads), "4"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            assert proc.stdout is not None and proc.stdin is not None
            proc.stdout.readline()
            time.sleep(5)  # events drained and at least one full rescan
            live = {int(n) for n in os.listdir(f"/proc/{proc.pid}/task")} - {proc.pid}
            # wake the long-lived threads (each reads a byte), so their entries are looked up whatever
            # the race with the short-lived ones gave
            proc.stdin.write("x" * len(live))
            proc.stdin.flush()
            time.sleep(1)
            counters = {**backend.counters(), **backend.gauges()}
            out.update(
                live_matched=sorted(live),
                held=sorted(k.id for k in backend.read_back() if k.kind is KeyKind.TID),
                live_tid_entries=counters["live_tid_entries"],
                exit_deleted_tid=counters["exit_deleted_tid"],
                tid_hits=counters["tid_hits"],
                reconciler=str(reconciler.stats()),
            )
            proc.stdin.close()
            proc.wait()
            time.sleep(3)
            out["after_exit"] = backend.gauges()["live_tid_entries"]
        finally:
            engine.stop()
    return out


def starvation(args: argparse.Namespace) -> dict[str, Any]:
    """Boosted load beyond the node's capacity; an unboosted CPU-bound task must still run (>= 10%)."""
    ncpu = os.cpu_count() or 1
    out: dict[str, Any] = {}
    cases = {
        "cpu_bound": (ncpu, spin),
        "sixty_percent": (2 * ncpu, busy_fraction(6, 4)),
    }
    for case, (n, body) in cases.items():
        with scheduler(watchdog_timeout_ms=2000) as backend, workers() as pids:
            boosted = [fork_worker(body, f"boosted{i}") for i in range(n)]
            pids += boosted
            victim = fork_worker(spin, "unboosted")
            pids.append(victim)
            time.sleep(0.2)
            upserts = {}
            for pid in boosted:
                k, s = key_for(KeyKind.TID, pid)
                upserts[k] = Entry(1, 0, s)
            backend.apply(upserts, [])
            tasks = {"victim": victim, **{f"b{i}": p for i, p in enumerate(boosted)}}
            shares = cpu_shares(tasks, args.seconds)
            c = backend.counters()
            health = backend.health()
            out[case] = {
                "victim_share": shares["victim"],
                "boosted_shares": [v for k, v in shares.items() if k != "victim"],
                "demotions": c["demotions"],
                "throttled_windows": c["throttled_windows"],
                "health": health.state.value,
                "reason": health.reason,
                "state": state(),
            }
    return out


def _wait_pinned(pids: list[int], cpu: int, timeout: float = 10.0) -> None:
    """Until every task's allowed CPUs are exactly `cpu` (fork_worker's child sets them itself)."""
    deadline = time.monotonic() + timeout
    while True:
        allowed = [next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if line.startswith("Cpus_allowed_list:")) for pid in pids]
        if all(a == str(cpu) for a in allowed) or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def affinity(args: argparse.Namespace) -> dict[str, Any]:
    """Boosted and unboosted tasks pinned to one CPU: they run only there, and the kernel keeps us."""
    ncpu = os.cpu_count() or 1
    pin = ncpu - 1
    out: dict[str, Any] = {"pinned_to": pin}
    with scheduler() as backend, workers() as pids:
        for i in range(2 * ncpu):
            pids.append(fork_worker(spin, f"hog{i}"))
        waker = fork_worker(busy_fraction(1, 3), "pinned-waker", {pin})
        hog = fork_worker(spin, "pinned-hog", {pin})
        pids += [waker, hog]
        # Each pins itself after the fork: on a loaded host the hog once had not run that far in 0.2 s, and
        # the CPU it was forked on was read as a violation.
        _wait_pinned([waker, hog], pin)
        time.sleep(0.2)
        k, s = key_for(KeyKind.TID, waker)
        backend.apply({k: Entry(3, 0, s)}, [])
        seen: dict[str, set[int]] = {"waker": set(), "hog": set()}
        before = backend.counters()
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            for name, pid in (("waker", waker), ("hog", hog)):
                seen[name].add(task_cpu(pid))
            time.sleep(0.01)
        after = backend.counters()
        out["cpus_seen"] = {k: sorted(v) for k, v in seen.items()}
        out["boosted_dispatches"] = after["boosted_dispatches"] - before["boosted_dispatches"]
        out["health"] = backend.health().state.value
    return out


def _waking_engine(out_fd: int, wake_fd: int) -> Callable[[], None]:
    """An engine step that wakes a peer halfway through its 2 ms burst, then sleeps 5 ms; it writes the CPU
    of each of its own wake-ups (one byte) to `out_fd`."""

    def body() -> None:
        while True:
            os.write(out_fd, bytes([min(_libc.sched_getcpu(), 255)]))
            for _ in range(2):
                end = time.thread_time_ns() + 1_000_000
                while time.thread_time_ns() < end:
                    pass
                os.write(wake_fd, b"w")
            time.sleep(0.005)

    return body


def _woken_sleeper(read_fd: int) -> Callable[[], None]:
    """In a session of its own, wakes at each message and works 0.1 ms (a request handler)."""

    def body() -> None:
        os.setsid()
        while True:
            os.read(read_fd, 64)
            end = time.thread_time_ns() + 100_000
            while time.thread_time_ns() < end:
                pass

    return body


def bound_steer(args: argparse.Namespace) -> dict[str, Any]:
    """A boosted engine free to use every CPU that wakes a thread pinned to CPU 0 in the middle of each
    burst, hogs on every CPU; the thread unboosted, or with `arg` "boosted" at priority 5 (weaker than the
    engine's 1, so it waits for the burst too). The engine starts on CPU 0 (pinned there, then widened),
    where the thread can only wait for the rest of the burst; its wake-ups should take it to another CPU
    (find_unbound, docs/scheduler.md). The engine reports the CPU of each wake-up itself: a driver polling
    /proc at the agent's rank preempted it, and the boosted queue handed it to whichever CPU took it."""
    ncpu = os.cpu_count() or 1
    out: dict[str, Any] = {"kernel": os.uname().release, "sleeper": args.arg or "unboosted"}
    cpu_r, cpu_w = os.pipe()
    wake_r, wake_w = os.pipe()
    os.set_blocking(cpu_r, False)
    try:
        with scheduler() as backend, workers() as pids:
            for i in range(2 * ncpu):
                pids.append(fork_worker(spin, f"hog{i}"))
            sleeper = fork_worker(_woken_sleeper(wake_r), "bound-sleeper", {0})
            engine = fork_worker(_waking_engine(cpu_w, wake_w), "free-engine", {0})
            pids += [sleeper, engine]
            for fd in (cpu_w, wake_r, wake_w):
                os.close(fd)
            _wait_pinned([sleeper, engine], 0)
            k, s = key_for(KeyKind.TID, engine)
            sk, ss = key_for(KeyKind.TID, sleeper)
            backend.apply({k: Entry(1, 0, s), **({sk: Entry(5, 0, ss)} if args.arg == "boosted" else {})}, [])
            time.sleep(0.3)
            os.sched_setaffinity(engine, range(ncpu))
            before, wait0 = backend.counters(), schedstat(sleeper)
            with contextlib.suppress(BlockingIOError):
                while os.read(cpu_r, 65536):
                    pass
            time.sleep(args.seconds)
            woke = b""
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(cpu_r, 65536):
                    woke += chunk
            after, wait1 = backend.counters(), schedstat(sleeper)
            out["engine_wakeups"] = len(woke)
            out["engine_on_cpu0"] = woke.count(0) / max(1, len(woke))
            out["counters"] = {k: after[k] - before[k] for k in after if after[k] != before[k]}
            turns = max(1, wait1[2] - wait0[2])
            out["sleeper_wait_us_per_turn"] = (wait1[1] - wait0[1]) / turns / 1000
            out["health"] = backend.health().state.value
    finally:
        os.close(cpu_r)
    return out


PINNED_HACKBENCH = ["taskset", "-c", "0", "hackbench", "-p", "-g", "2", "-l", "200"]


def _hackbench_seconds(cmd: list[str]) -> float:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    m = re.search(r"Time:\s*([\d.]+)", r.stdout)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-500:]}\n{r.stderr[-500:]}")
    return float(m[1])


def pinned_group(args: argparse.Namespace) -> dict[str, Any]:
    """hackbench's 80 tasks, one session, all pinned to CPU 0: twice under EEVDF, then twice under ours
    (one load). Every wake-up there is a bound waker against a bound run of its own group."""
    out: dict[str, Any] = {"kernel": os.uname().release,
                           "EEVDF": [_hackbench_seconds(PINNED_HACKBENCH) for _ in range(2)]}
    with scheduler() as backend:
        before = backend.counters()
        out["ours"] = [_hackbench_seconds(PINNED_HACKBENCH) for _ in range(2)]
        after = backend.counters()
        out["fair_preemptions"] = after["fair_preemptions"] - before["fair_preemptions"]
        out["health"] = backend.health().state.value
    return out


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _sleep_until(ns: int) -> None:
    """clock_nanosleep to an absolute CLOCK_MONOTONIC time, as cyclictest sleeps (Python has no wrapper)."""
    ts = _Timespec(ns // 1_000_000_000, ns % 1_000_000_000)
    while _libc.clock_nanosleep(1, 1, ctypes.byref(ts), None) == 4:  # CLOCK_MONOTONIC, TIMER_ABSTIME; EINTR
        pass


JOINT_RECORD = struct.Struct("=Bqq")  # which sleeper, the boundary it slept to, when it ran for it (ns)
JOINT_APART_US = 2500  # half the default slice (5 ms): a waker refused waited for some of a hog's slice


def _boundary_sleeper(which: int, out_fd: int, start_ns: int, period_ns: int) -> Callable[[], None]:
    """In a session of its own, sleeps to each `period_ns` boundary after `start_ns`; records when it ran."""

    def body() -> None:
        os.setsid()
        target = start_ns
        while True:
            target += period_ns
            _sleep_until(target)
            os.write(out_fd, JOINT_RECORD.pack(which, target, time.monotonic_ns()))

    return body


def _boundary_runs(ncpu: int, sleepers: int, seconds: float
                   ) -> Iterator[tuple[str, SchedExtBackend | None, list[int], int, int]]:
    """EEVDF, then ours, each with four hogs per CPU in this session and a pipe for the boundary sleepers'
    records: (its name, ours' backend or None, the workers to kill, the pipe's read and write ends). The
    pipe is read once the sleepers are gone, so a run must fit its 64 KiB: a sleeper blocked on a full pipe
    would measure the pipe. Use it under contextlib.closing, so a failed run unloads ours at once."""
    if sleepers * (seconds + 1) / 0.005 * JOINT_RECORD.size > 65536:
        raise ValueError(f"{sleepers} boundary sleepers for {seconds} s overflow the records' pipe")
    for name in ("EEVDF", "ours"):
        with (scheduler() if name == "ours" else contextlib.nullcontext()) as backend, workers() as pids:
            read_fd, write_fd = os.pipe()
            for i in range(4 * ncpu):
                pids.append(fork_worker(spin, f"hog{i}"))
            yield name, backend, pids, read_fd, write_fd


def _records(read_fd: int) -> list[tuple[int, int, int]]:
    """Every whole record the boundary sleepers wrote (their writers gone), the pipe then closed."""
    data = b""
    while chunk := os.read(read_fd, 65536):
        data += chunk
    os.close(read_fd)
    return list(JOINT_RECORD.iter_unpack(data[: len(data) - len(data) % JOINT_RECORD.size]))


def joint_wake(args: argparse.Namespace) -> dict[str, Any]:
    """Two processes pinned to CPU 0, each in a session of its own, sleep to the same absolute 5 ms
    boundaries, so one timer interrupt wakes both, beside hogs on every CPU: under EEVDF, then under ours.
    The first to wake preempts CPU 0's hog; the second must run right after it, not after that hog's slice
    (docs/scheduler.md, "A bound waker joins the wakers before it"). Per boundary both reached, how far
    apart the two ran: the timer's lateness, which TCG makes long, is the same for both."""
    ncpu = os.cpu_count() or 1
    out: dict[str, Any] = {"kernel": os.uname().release}
    with contextlib.closing(_boundary_runs(ncpu, 2, args.seconds)) as runs:
        for name, backend, pids, read_fd, write_fd in runs:
            start = time.monotonic_ns() + 300_000_000
            for which in range(2):
                pids.append(fork_worker(_boundary_sleeper(which, write_fd, start, 5_000_000), f"joint{which}",
                                        {0}))
            os.close(write_fd)
            before = backend.counters() if backend else {}
            time.sleep(0.3 + args.seconds)
            after = backend.counters() if backend else {}
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            ran: dict[int, list[int]] = {}
            for which, target, at in _records(read_fd):
                ran.setdefault(target, [0, 0])[which] = at
            gaps = sorted(abs(a - b) / 1000 for a, b in ran.values() if a and b)
            out[name] = {"boundaries": len(gaps), "gap_us_p50": gaps[len(gaps) // 2] if gaps else None,
                         "apart": sum(g > JOINT_APART_US for g in gaps) / max(1, len(gaps)),
                         "fair_wakeups_queued": after.get("fair_wakeups_queued", 0)
                         - before.get("fair_wakeups_queued", 0)}
            if backend:
                out["health"] = backend.health().state.value
    return out


def _own_session(body: Callable[[], None]) -> Callable[[], None]:
    """`body` run in a session of its own (an autogroup of its own, as a daemon or a shell's job has)."""

    def run() -> None:
        os.setsid()
        body()

    return run


def lone_busy(args: argparse.Namespace) -> dict[str, Any]:
    """A sleeper pinned to CPU 0 (5 ms periods, a session of its own) beside hogs sharing one session (four
    per CPU) and one busy process alone in a session of its own, as a build or a data loader beside a
    crowded service: under EEVDF, then under ours. Per scheduler, the sleeper's run-queue wait per wake-up
    (schedstat) and how late it ran past each boundary; under ours also how many wake-ups the wake-up rule
    refused (`fair_wakeups_queued`, every unboosted waker of the guest). The hogs' crowded session makes
    vtime_now lead the pool by eight slices' worth: the busy process's deadline then beat a sleeper floored
    against vtime_now alone (docs/scheduler.md, "Floored against the run it would cut")."""
    ncpu = os.cpu_count() or 1
    out: dict[str, Any] = {"kernel": os.uname().release}
    with contextlib.closing(_boundary_runs(ncpu, 1, args.seconds)) as runs:
        for name, backend, pids, read_fd, write_fd in runs:
            pids.append(fork_worker(_own_session(spin), "lone-busy"))
            start = time.monotonic_ns() + 300_000_000
            sleeper = fork_worker(_boundary_sleeper(0, write_fd, start, 5_000_000), "lone-sleeper", {0})
            pids.append(sleeper)
            os.close(write_fd)
            time.sleep(0.3)
            before = backend.counters() if backend else {}
            wait0 = schedstat(sleeper)
            time.sleep(args.seconds)
            after = backend.counters() if backend else {}
            wait1 = schedstat(sleeper)
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            late = [(at - target) / 1000 for _, target, at in _records(read_fd)]
            turns = wait1[2] - wait0[2]
            out[name] = {"wakeups": turns, "wait_us": (wait1[1] - wait0[1]) / max(1, turns) / 1000,
                         "late_us_avg": sum(late) / max(1, len(late)),
                         "fair_wakeups_queued": after.get("fair_wakeups_queued", 0)
                         - before.get("fair_wakeups_queued", 0)}
            if backend:
                out["health"] = backend.health().state.value
    return out


NODES = Path("/sys/devices/system/node")


def numa_nodes() -> list[int]:
    """The NUMA nodes sysfs lists, by number."""
    return sorted(int(p.name[4:]) for p in NODES.glob("node[0-9]*"))


def node_cpus(node: int) -> set[int]:
    """The online CPUs of a NUMA node."""
    return set(loader.parse_cpulist((NODES / f"node{node}" / "cpulist").read_text()))


def task_cpu(pid: int) -> int:
    """The CPU a task runs or last ran on (/proc/<pid>/stat's 39th field; the command before it may hold
    spaces and parentheses, so fields are counted from its closing one)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[36])


def numa(args: argparse.Namespace) -> dict[str, Any]:
    """Tasks bound to one NUMA node's CPUs (as `numactl --cpunodebind` or a cpuset does), boosted and not,
    beside hogs everywhere: they run only on that node, and the kernel keeps the scheduler."""
    nodes = numa_nodes()
    out: dict[str, Any] = {"nodes": {n: sorted(node_cpus(n)) for n in nodes}}
    node = nodes[-1]
    allowed = node_cpus(node)
    ncpu = os.cpu_count() or 1
    with scheduler(watchdog_timeout_ms=2000) as backend, workers() as pids:
        for i in range(2 * ncpu):
            pids.append(fork_worker(spin, f"hog{i}"))
        bound = {f"boosted{i}": fork_worker(busy_fraction(2, 3), f"boosted{i}", allowed) for i in range(3)}
        bound.update({f"plain{i}": fork_worker(spin, f"plain{i}", allowed) for i in range(3)})
        pids += bound.values()
        time.sleep(0.2)
        upserts = {}
        for name, pid in bound.items():
            if name.startswith("boosted"):
                k, st = key_for(KeyKind.TID, pid)
                upserts[k] = Entry(5, 0, st)
        backend.apply(upserts, [])
        seen: set[int] = set()
        ran = {name: run_ns(pid) for name, pid in bound.items()}
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            for pid in bound.values():
                seen.add(task_cpu(pid))
            time.sleep(0.01)
        out.update(
            node=node, allowed=sorted(allowed), cpus_seen=sorted(seen),
            ran_ns={name: run_ns(pid) - ran[name] for name, pid in bound.items()},
            boosted_dispatches=backend.counters()["boosted_dispatches"],
            health=backend.health().state.value, state=state(),
        )
    return out


def node_balance(args: argparse.Namespace) -> dict[str, Any]:
    """CPU hogs that start bound to their NUMA node, three per CPU on the first node and one and a half on
    the second, then may run anywhere. With a fair queue per node each keeps queueing in its node's queue,
    and since neither queue empties, no CPU steals: only the second node's pulls from the more crowded first
    one even them out (about nine and nine; without pulls the first node's hogs would get half of what the
    second's do). Each hog's CPU share afterwards, the mean share of the hogs that started on the crowded
    node over the others' (0.5 with no balancing at all), and which nodes each ran on. With `eevdf` as its
    argument, the same without this scheduler: the kernel's own figures for the same guest (docs/lab.md)."""
    eevdf = args.arg == "eevdf"
    nodes = numa_nodes()
    first, second = node_cpus(nodes[0]), node_cpus(nodes[1])
    every = set(range(os.cpu_count() or 1))
    node_of = {cpu: n for n in nodes for cpu in node_cpus(n)}
    out: dict[str, Any] = {"nodes": {n: sorted(node_cpus(n)) for n in nodes}}
    loaded = contextlib.nullcontext(None) if eevdf else scheduler(watchdog_timeout_ms=2000)
    with loaded as backend, workers() as pids:
        hogs = {f"hog{i}": fork_worker(spin, f"hog{i}", first) for i in range(3 * len(first))}
        hogs.update({f"hog{len(hogs) + i}": fork_worker(spin, f"hog{len(hogs) + i}", second)
                     for i in range(3 * len(second) // 2)})
        pids += hogs.values()
        time.sleep(0.5)
        before = backend.counters() if backend is not None else {}
        for pid in hogs.values():
            os.sched_setaffinity(pid, every)
        time.sleep(1.0)
        ran_on: dict[str, set[int]] = {name: set() for name in hogs}
        t0 = time.monotonic()
        start = {name: run_ns(pid) for name, pid in hogs.items()}
        while time.monotonic() < t0 + args.seconds:
            for name, pid in hogs.items():
                cpu = task_cpu(pid)
                ran_on[name].add(node_of.get(cpu, -1))
            time.sleep(0.02)
        elapsed = time.monotonic() - t0
        shares = {name: (run_ns(pid) - start[name]) / 1e9 / elapsed for name, pid in hogs.items()}
        crowded = [shares[f"hog{i}"] for i in range(3 * len(first))]
        rest = [shares[f"hog{i}"] for i in range(3 * len(first), len(hogs))]
        out.update(
            shares=shares, min_over_max=min(shares.values()) / max(shares.values()),
            crowded_over_rest=(sum(crowded) / len(crowded)) / (sum(rest) / len(rest)),
            nodes_seen={name: sorted(seen) for name, seen in ran_on.items()}, state=state(),
        )
        if backend is not None:
            after = backend.counters()
            out.update(
                domain_pulls=after["domain_pulls"] - before["domain_pulls"],
                domain_steals=after["domain_steals"] - before["domain_steals"],
                health=backend.health().state.value,
            )
    return out


KHUGEPAGED_SLEEP = Path("/sys/kernel/mm/transparent_hugepage/khugepaged/scan_sleep_millisecs")


def _fresh_small_pages(size: int) -> mmap.mmap:
    """An anonymous mapping faulted in as small pages, then marked for huge pages: work for khugepaged,
    which takes this process's mmap_lock for write to collapse each 2 MiB of it."""
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    for off in range(0, size, 4096):
        m[off] = 1
    m.madvise(mmap.MADV_HUGEPAGE)
    return m


def _heartbeat(seconds: float, out_fd: int) -> Callable[[], None]:
    """A light periodic task (10 ms sleeps) whose memory khugepaged keeps collapsing; each wakeup it
    faults in a new page. Writes its largest gap between wakeups and how many it had to out_fd."""

    def body() -> None:
        gaps: list[float] = []
        region = _fresh_small_pages(32 << 20)
        renewed = t = time.monotonic()
        end = t + seconds
        while t < end:
            time.sleep(0.01)
            page = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            page[0] = 1
            page.close()
            now = time.monotonic()
            gaps.append(now - t)
            t = now
            if now - renewed > 1.0:
                region.close()
                region = _fresh_small_pages(32 << 20)
                renewed = time.monotonic()
                t = renewed  # building the region is this task's own work, not a wait
        os.write(out_fd, json.dumps({"max_gap_s": max(gaps), "wakeups": len(gaps)}).encode())

    return body


def _collapses() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_collapse_alloc "):
            return int(line.split()[1])
    return 0


def kthread_lock_holder(args: argparse.Namespace) -> dict[str, Any]:
    """khugepaged (a nice 19 kernel thread) holds a process's mmap_lock while it collapses huge pages.
    With 4 CPU hogs per CPU, a light task that faults in memory must not wait for it for long: kernel
    threads are charged like nice 0 tasks at most. khugepaged scans every 100 ms here (10 s by default)."""
    ncpu = os.cpu_count() or 1
    saved = KHUGEPAGED_SLEEP.read_text().strip()
    out: dict[str, Any] = {}
    try:
        KHUGEPAGED_SLEEP.write_text("100")
        with scheduler() as backend, workers() as pids:
            pids += [fork_worker(spin, f"hog{i}") for i in range(4 * ncpu)]
            r, w = os.pipe()
            collapses = _collapses()
            pids.append(fork_worker(_heartbeat(args.seconds, w), "heartbeat"))
            os.close(w)
            with os.fdopen(r) as f:
                out.update(json.loads(f.read() or "{}"))
            out["khugepaged_collapses"] = _collapses() - collapses
            out["health"] = backend.health().state.value
            out["state"] = state()
    finally:
        KHUGEPAGED_SLEEP.write_text(saved)
    return out


def _cgroup_at(path: str, controls: dict[str, str]) -> Path:
    """A cgroup at `path` below the root (parents created, each enabling the cpu controller below it)."""
    cg = Path("/sys/fs/cgroup")
    for part in path.split("/"):
        if "cpu" not in (cg / "cgroup.subtree_control").read_text().split():
            (cg / "cgroup.subtree_control").write_text("+cpu")
        cg = cg / part
        cg.mkdir(exist_ok=True)
    for control, value in controls.items():
        (cg / control).write_text(value)
    return cg


def _remove_cgroups(*cgroups: Path) -> None:
    """Remove cgroups (children before parents) once their killed tasks are gone."""
    for cg in cgroups:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _hogs_in(cg: Path, name: str, count: int, pids: list[int],
             body: Callable[[], None] = spin) -> dict[str, int]:
    hogs = {f"{name}{i}": fork_worker(body, f"{name}{i}") for i in range(count)}
    for pid in hogs.values():
        (cg / "cgroup.procs").write_text(str(pid))
        pids.append(pid)
    return hogs


BW_PERIOD_S = 0.1  # the cpu.max period every check below uses (100000 us, the default)


class WorkCounter:
    """A hog that counts its loop turns in shared memory: its CPU share by work done, against its own rate
    without a limit, measured in the same boot. Under a quota below one tick the kernel's run time for a
    task of ours (schedstat) reads up to half of what sched_switch timestamps show it held the CPU
    (docs/scheduler.md, cpu.max), so work is the measure there."""

    def __init__(self) -> None:
        self._shm = mmap.mmap(-1, 8)
        self._turns = ctypes.c_uint64.from_buffer(self._shm)
        self.full_rate = 0.0

    def body(self) -> None:
        turns = ctypes.c_uint64.from_buffer(self._shm)
        n = 0
        while True:
            for _ in range(1000):
                n += 1
            turns.value = n

    def rate(self, seconds: float) -> float:
        """Loop turns per second over about `seconds`."""
        w0, t0 = self._turns.value, time.monotonic()
        time.sleep(seconds)
        return (self._turns.value - w0) / (time.monotonic() - t0)

    def share(self, seconds: float) -> float:
        """Fraction of one CPU by work done, against `full_rate`."""
        return self.rate(seconds) / self.full_rate


def _bandwidth_checks(seconds: float, backend: SchedExtBackend | None) -> dict[str, Any]:
    """CPU hogs under cpu.max, each check measured over `seconds` (fractions of one CPU). With `backend`
    (ours), the capped hog is also boosted to the top priority partway."""
    out: dict[str, Any] = {}
    cg = _cgroup_at("gthulhu-bw", {"cpu.max": "20000 100000"})
    work = WorkCounter()
    with workers() as pids:
        hog = _hogs_in(cg, "capped", 1, pids, work.body)
        time.sleep(0.3)
        out["capped"] = cpu_shares(hog, seconds)["capped0"]
        out.update(_changed_limits(cg, hog, seconds, backend, work))
    _remove_cgroups(cg)
    out.update(_parent_and_many(seconds))
    return out


def _changed_limits(cg: Path, hog: dict[str, int], seconds: float,
                    backend: SchedExtBackend | None, work: WorkCounter) -> dict[str, Any]:
    """The capped hog's limit changed while it runs, each measured from one period after the write; with
    `backend`, the hog then boosted to the top priority. Under the quota below one tick also by work done,
    against the hog's rate without a limit (measured first)."""
    out: dict[str, Any] = {}
    (cg / "cpu.max").write_text("max 100000")
    time.sleep(BW_PERIOD_S)
    work.full_rate = out["full_rate"] = work.rate(1.0)
    # "small": a quota under one tick (3 ms at 250 Hz), where only the stop timer can end a run in time
    changes = (("raised", "50000 100000"), ("lowered", "10000 100000"), ("small", "3000 100000"),
               ("restored", "20000 100000"))
    for name, quota in changes:
        (cg / "cpu.max").write_text(quota)
        time.sleep(BW_PERIOD_S)
        before = backend.counters() if backend is not None else {}
        if name == "small":
            out["small_by_work"] = work.share(2 * seconds)  # twice as long: 3 ms runs vary
        out[name] = cpu_shares(hog, seconds)["capped0"]
        if backend is not None:
            after = backend.counters()
            out[f"{name}_counters"] = {n: after[n] - before[n] for n in after if n.startswith("bw_")}
    if backend is not None:
        k, st = key_for(KeyKind.TID, hog["capped0"])
        backend.apply({k: Entry(STRONGEST, 0, st)}, [])
        time.sleep(0.2)
        out["boosted"] = cpu_shares(hog, seconds)["capped0"]
        out["boost_entries"] = backend.counters()["tid_hits"] > 0
        # Boosted and alone, dispatch keeps it for slice after slice with no `running` between.
        (cg / "cpu.max").write_text("3000 100000")
        time.sleep(BW_PERIOD_S)
        before = backend.counters()
        out["boosted_small_by_work"] = work.share(2 * seconds)
        out["boosted_small"] = cpu_shares(hog, seconds)["capped0"]
        after = backend.counters()
        out["boosted_small_counters"] = {n: after[n] - before[n] for n in after if n.startswith("bw_")}
    return out


def _parent_and_many(seconds: float, many: bool = True) -> dict[str, Any]:
    """A parent's limit binding two hogs in a child without one; (`many`) 50 limited cgroups at once."""
    out: dict[str, Any] = {}
    parent = _cgroup_at("gthulhu-bw-parent", {"cpu.max": "30000 100000"})
    child = _cgroup_at("gthulhu-bw-parent/child", {})
    with workers() as pids:
        hogs = _hogs_in(child, "child", 2, pids)
        time.sleep(0.3)
        out["child_hogs"] = sum(cpu_shares(hogs, seconds).values())
    _remove_cgroups(child, parent)
    if not many:
        return out
    # 3 % each: 1.5 CPUs of the 2 in all
    many = [_cgroup_at(f"gthulhu-bw-{i}", {"cpu.max": "3000 100000"}) for i in range(50)]
    with workers() as pids:
        hogs = {}
        for i, m in enumerate(many):
            hogs.update(_hogs_in(m, f"many{i}-", 1, pids))
        time.sleep(0.5)
        # A vCPU the host stops for 100 ms counts 100 ms of run time to the hog it ran, which no limit can
        # prevent: measured per CPU beside the shares (10 ms apart, so 200 RT wake-ups a second cut few
        # runs). A window the host stalled for a tenth of it or more is measured again, up to three times.
        for _ in range(3):
            stalls = [measure_stalls(seconds, cpu, 0.01) for cpu in sorted(os.sched_getaffinity(0))]
            shares = cpu_shares(hogs, seconds)
            out["many_stalls_ms"] = [s()["total_ms"] for s in stalls]
            if sum(out["many_stalls_ms"]) / 1e3 < STALLED_WINDOW * seconds:
                break
        out["many_max"] = max(shares.values())
        out["many_min"] = min(shares.values())
        out["many_total"] = sum(shares.values())
    _remove_cgroups(*many)
    return out


def _long_period() -> float:
    """A hog under cpu.max's longest period (1 s) and a 1 % quota, over three periods: its tasks wait up to
    a second each period, longer than the shortest watchdog timeout allows a task to wait."""
    cg = _cgroup_at("gthulhu-bw-long", {"cpu.max": "10000 1000000"})
    with workers() as pids:
        hog = _hogs_in(cg, "long", 1, pids)
        time.sleep(0.3)
        share = cpu_shares(hog, 3.0)["long0"]
    _remove_cgroups(cg)
    return share


def _reread_checks(seconds: float) -> dict[str, Any]:
    """cpu.max as the objects for kernels before 6.17 take it, from the cgroup's task_group, where 7.3 keeps
    it too: the 6.13 object loaded on 7.3, a hog capped, the cap raised while it runs, a parent's cap
    binding a child's hogs."""
    out: dict[str, Any] = {}
    with scheduler(bpf_object=loader.object_path("6.13")) as backend:
        cg = _cgroup_at("gthulhu-bw-reread", {"cpu.max": "20000 100000"})
        with workers() as pids:
            hog = _hogs_in(cg, "reread", 1, pids)
            time.sleep(0.3)
            out["capped"] = cpu_shares(hog, seconds)["reread0"]
            (cg / "cpu.max").write_text("50000 100000")
            time.sleep(BW_PERIOD_S)
            out["raised"] = cpu_shares(hog, seconds)["reread0"]
        _remove_cgroups(cg)
        out["child_hogs"] = _parent_and_many(seconds, many=False)["child_hogs"]
        out["counters"] = {n: v for n, v in backend.counters().items() if n.startswith(("bw_", "cgroups_"))}
        out["source"] = backend.cpu_max_source
        out["health"] = backend.health().state.value
    out["before_load"] = _limited_before_load(seconds, bpf_object=loader.object_path("6.13"))
    return out


def _limited_before_load(seconds: float, **cfg: Any) -> float:
    """A hog capped at 20 % in a cgroup made before our scheduler loads (an agent started, or restarted, on
    a node whose containers run): the limit is taken at load (cgroup_init), not from a later change."""
    cg = _cgroup_at("gthulhu-bw-pre", {"cpu.max": "20000 100000"})
    with workers() as pids:
        hog = _hogs_in(cg, "pre", 1, pids)
        time.sleep(0.3)
        with scheduler(**cfg):
            time.sleep(BW_PERIOD_S)
            share = cpu_shares(hog, seconds)["pre0"]
    _remove_cgroups(cg)
    return share


def cpu_max(args: argparse.Namespace) -> dict[str, Any]:
    """cpu.max under EEVDF and then under ours in the same boot (every object enforces it: 6.17's as the
    kernel passes it, the older ones from the cgroup's task_group). On 6.17+ also the older objects' way,
    by loading the 6.13 object. No ejection throughout."""
    flavour = loader.kfunc_flavour()
    out: dict[str, Any] = {"eevdf": _bandwidth_checks(args.seconds, None)}
    out["eevdf"]["long_period"] = _long_period()
    # the shortest watchdog the agent accepts (1 s) against the longest period: nobody is ejected
    with scheduler(watchdog_timeout_ms=1000) as backend:
        out["ours_long_period"] = _long_period()
        out["health_long_period"] = backend.health().state.value
    out["before_load"] = _limited_before_load(args.seconds)
    with scheduler() as backend:
        out["ours"] = _bandwidth_checks(args.seconds, backend)
        out["counters"] = backend.counters()
        out["source"] = backend.cpu_max_source
        out["health"] = backend.health().state.value
        out["state"] = state()
    if flavour == "6.17":
        out["reread"] = _reread_checks(args.seconds)
    return out


def _session(body: Callable[[], None], name: str, count: int) -> int:
    """A new session (so its own autogroup) running `count` forked copies of body; returns the leader."""

    def leader() -> None:
        os.setsid()
        kids = [fork_worker(body, name) for _ in range(count)]
        for kid in kids:
            os.waitpid(kid, 0)

    return fork_worker(leader, f"{name}-lead")


def _child_pids(pid: int) -> list[int]:
    """Processes whose parent is pid, from each one's stat (/proc/PID/task/TID/children needs
    CONFIG_PROC_CHILDREN, which the lab's 6.12 kernel does not have)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry.name))
    return sorted(kids)


def _children(pid: int, count: int, timeout: float = 10.0) -> list[int]:
    """The `count` children of pid, waiting for it to fork them all (slow under TCG)."""
    deadline = time.monotonic() + timeout
    while True:
        kids = _child_pids(pid)
        if len(kids) >= count or time.monotonic() > deadline:
            assert len(kids) == count, f"{pid} forked {len(kids)} of {count} children"
            return kids
        time.sleep(0.05)


GroupSetup = Callable[[list[int]], dict[str, list[int]]]


def _group_shares(seconds: float, setup: GroupSetup) -> dict[str, list[float]]:
    """Per-task CPU shares of the groups `setup` starts (it returns name -> pids)."""
    with workers() as pids:
        groups = setup(pids)
        time.sleep(0.5)
        flat = {f"{name}/{pid}": pid for name, members in groups.items() for pid in members}
        shares = cpu_shares(flat, seconds)
    return {name: sorted(shares[f"{name}/{pid}"] for pid in members) for name, members in groups.items()}




def _in_cgroups(spec: dict[str, tuple[int, int]]) -> GroupSetup:
    """name -> (cpu.weight, hogs): each group a cgroup of its own with that many spinning processes."""

    def setup(pids: list[int]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for name, (weight, count) in spec.items():
            cg = _cgroup_at(f"gthulhu-{name}", {"cpu.weight": str(weight)})
            groups[name] = []
            for _ in range(count):
                pid = fork_worker(spin, name)
                pids.append(pid)
                (cg / "cgroup.procs").write_text(str(pid))
                groups[name].append(pid)
        return groups

    return setup


def _in_sessions(pids: list[int]) -> dict[str, list[int]]:
    """Six hogs in one new session, one hog alone in another (autogroup: one group per session)."""
    many = _session(spin, "many", 6)
    one = _session(spin, "one", 1)
    pids += [many, one]
    kids = {"many": _children(many, 6), "one": _children(one, 1)}
    pids += kids["many"] + kids["one"]
    return kids


def group_share(args: argparse.Namespace) -> dict[str, Any]:
    """Fair sharing between task groups, under EEVDF and under ours in the same boot: six hogs in one group
    and one hog alone in another (cgroups, then sessions through autogroup), and two groups of two hogs
    with cpu.weight 300 and 100."""
    cases: dict[str, GroupSetup] = {
        "cgroups": _in_cgroups({"many": (100, 6), "one": (100, 1)}),
        "sessions": _in_sessions,
        "weights": _in_cgroups({"heavy": (300, 2), "light": (100, 2)}),
    }
    out: dict[str, Any] = {"autogroup": Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()}
    try:
        for name, setup in cases.items():
            out[f"eevdf_{name}"] = _group_shares(args.seconds, setup)
        with scheduler() as backend:
            for name, setup in cases.items():
                out[f"ours_{name}"] = _group_shares(args.seconds, setup)
            out["health"] = backend.health().state.value
    finally:
        time.sleep(0.2)
        for name in ("many", "one", "heavy", "light"):
            with contextlib.suppress(OSError):
                Path(f"/sys/fs/cgroup/gthulhu-{name}").rmdir()
    return out


# cgroup trees as the kubelet and systemd build them on a 2-CPU node: path -> cpu.weight. The kubelet turns
# CPU shares into weights as 1 + (shares - 2) * 9999 / 262142: kubepods.slice (2 CPUs allocatable, 2048
# shares) 79, a Guaranteed pod of 1 CPU 39, the Burstable level (requests 500m + 250m) 30 and its pods 20
# and 10, BestEffort (2 shares) 1. Services in system.slice keep the default 100.
K8S_TREE = {
    "gth-system.slice": 100,
    "gth-system.slice/a.service": 100,
    "gth-system.slice/b.service": 100,
    "gth-system.slice/c.service": 100,
    "gth-kubepods.slice": 79,
    "gth-kubepods.slice/pod-guaranteed": 39,
    "gth-kubepods.slice/pod-guaranteed/app": 39,
    "gth-kubepods.slice/burstable": 30,
    "gth-kubepods.slice/burstable/pod-b1": 20,
    "gth-kubepods.slice/burstable/pod-b1/app": 20,
    "gth-kubepods.slice/burstable/pod-b2": 10,
    "gth-kubepods.slice/burstable/pod-b2/app": 10,
    "gth-kubepods.slice/besteffort": 1,
    "gth-kubepods.slice/besteffort/pod-be": 1,
    "gth-kubepods.slice/besteffort/pod-be/app": 1,
}
# Two hogs per leaf: a group can then run on both CPUs, which EEVDF's per-CPU group shares need to come
# near the weights (with one hog, a leaf's weight counts only on the CPU it sits on).
K8S_HOGS = {
    "gth-system.slice/a.service": 2,
    "gth-system.slice/b.service": 2,
    "gth-system.slice/c.service": 2,
    "gth-kubepods.slice/pod-guaranteed/app": 2,
    "gth-kubepods.slice/burstable/pod-b1/app": 2,
    "gth-kubepods.slice/burstable/pod-b2/app": 2,
    "gth-kubepods.slice/besteffort/pod-be/app": 2,
}
BESTEFFORT_PODS = 16
MANY_BE_TREE = {
    "gth-system.slice": 100,
    "gth-system.slice/a.service": 100,
    "gth-system.slice/b.service": 100,
    "gth-kubepods.slice": 79,
    "gth-kubepods.slice/burstable": 30,
    "gth-kubepods.slice/burstable/pod-b1": 20,
    "gth-kubepods.slice/burstable/pod-b1/app": 20,
    "gth-kubepods.slice/besteffort": 1,
    **{f"gth-kubepods.slice/besteffort/pod-be{i}": 1 for i in range(BESTEFFORT_PODS)},
    **{f"gth-kubepods.slice/besteffort/pod-be{i}/app": 1 for i in range(BESTEFFORT_PODS)},
}
MANY_BE_HOGS = {
    "gth-system.slice/a.service": 1,
    "gth-system.slice/b.service": 1,
    "gth-kubepods.slice/burstable/pod-b1/app": 2,
    **{f"gth-kubepods.slice/besteffort/pod-be{i}/app": 1 for i in range(BESTEFFORT_PODS)},
}
# A top-level group of weight 1 whose busy threads outnumber the hogs beside it (each hog a group of 100).
LIGHT_TREE = {"gth-light": 1, **{f"gth-heavy{i}": 100 for i in range(4)}}
LIGHT_HOGS = {**{f"gth-heavy{i}": 1 for i in range(4)}, "gth-light": 8}
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _make_tree(tree: dict[str, int]) -> None:
    """The cgroups of `tree`, parents first, each parent delegating the cpu controller to its children."""
    for path, weight in tree.items():
        cg = CGROUP_ROOT / path
        control = cg.parent / "cgroup.subtree_control"
        if "cpu" not in control.read_text().split():
            control.write_text("+cpu")
        cg.mkdir(exist_ok=True)
        (cg / "cpu.weight").write_text(str(weight))


def _remove_tree(tree: dict[str, int]) -> None:
    for path in sorted(tree, key=lambda p: -p.count("/")):
        with contextlib.suppress(OSError):
            (CGROUP_ROOT / path).rmdir()


def _tree_run(tree: dict[str, int], hogs: dict[str, int], seconds: float) -> dict[str, Any]:
    """A hog in each leaf of `tree` per count in `hogs`: over one window, each hog's CPU share, turns
    (times it was put on a CPU) and mean wait per turn (schedstat)."""
    _make_tree(tree)
    try:
        with workers() as pids:
            named: dict[str, int] = {}
            for leaf, count in hogs.items():
                for i in range(count):
                    pid = fork_worker(spin, "hog")
                    pids.append(pid)
                    (CGROUP_ROOT / leaf / "cgroup.procs").write_text(str(pid))
                    named[f"{leaf}#{i}"] = pid
            time.sleep(1.0)
            before = {name: schedstat(pid) for name, pid in named.items()}
            t0 = time.monotonic()
            time.sleep(seconds)
            after = {name: schedstat(pid) for name, pid in named.items()}
            elapsed = time.monotonic() - t0
    finally:
        time.sleep(0.2)
        _remove_tree(tree)
    out: dict[str, Any] = {}
    for name in named:
        run, wait, turns = (a - b for a, b in zip(after[name], before[name], strict=True))
        out[name] = {"share": run / 1e9 / elapsed, "turns": turns, "mean_wait_s": wait / 1e9 / max(1, turns)}
    return out


def _weight_fractions(tree: dict[str, int], hogs: dict[str, int]) -> dict[str, float]:
    """Each hog's fraction of the CPU time the hogs get, by the weights: its weight in top-level terms
    (1/count of its leaf's load x each busy cgroup's weight over its busy siblings', the top level's
    weights undivided; what EEVDF approximates per CPU), at least 1 (the scheduler's floor,
    docs/scheduler.md), over the sum of all."""

    def parent(path: str) -> str:
        return path.rpartition("/")[0]

    def busy(path: str) -> bool:
        return any(leaf == path or leaf.startswith(path + "/") for leaf in hogs)

    weights = {}
    for leaf, count in hogs.items():
        weight, path = 100.0 / count, leaf
        while parent(path):
            siblings = [p for p in tree if parent(p) == parent(path) and busy(p)]
            weight *= tree[path] / sum(tree[p] for p in siblings)
            path = parent(path)
        weight *= tree[path] / 100
        weights.update({f"{leaf}#{i}": max(weight, 1.0) for i in range(count)})
    total = sum(weights.values())
    return {name: weight / total for name, weight in weights.items()}


def hierarchy(args: argparse.Namespace) -> dict[str, Any]:
    """Nested cpu.weight under EEVDF and under ours in the same boot: a Kubernetes-like tree with a hog in
    each leaf; a weight-1 top-level group with eight busy threads beside four hogs of weight 100; sixteen
    BestEffort pods whose compounded weight is below the floor. Watchdog 10 s throughout."""
    cases = {
        "k8s": (K8S_TREE, K8S_HOGS),
        "light": (LIGHT_TREE, LIGHT_HOGS),
        "many_be": (MANY_BE_TREE, MANY_BE_HOGS),
    }
    if args.arg:  # a comma-separated subset, for a quicker look at one case
        cases = {name: cases[name] for name in args.arg.split(",")}
    out: dict[str, Any] = {"watchdog_ms": 10_000, "weights_k8s": _weight_fractions(K8S_TREE, K8S_HOGS)}
    for name, case in cases.items():
        out[f"eevdf_{name}"] = _tree_run(*case, seconds=args.seconds)
    with scheduler(watchdog_timeout_ms=out["watchdog_ms"]) as backend:
        for name, case in cases.items():
            out[f"ours_{name}"] = _tree_run(*case, seconds=args.seconds)
            out[f"health_{name}"] = backend.health().state.value
        out["state"] = state()
    return out


def bad_input(_: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    me = os.getpid()
    start = task_start_time(me)
    assert start is not None
    good = {EntryKey(KeyKind.TID, me): Entry(3, 0, start)}
    bad = {
        "priority": Entry(21, 0, start),
        "slice_low": Entry(1, 49_999, start),
        "slice_high": Entry(1, 1_000_000_001, start),
    }
    with scheduler(map_capacity=4) as backend:
        for name, entry in bad.items():
            try:
                backend.apply({**good, EntryKey(KeyKind.TGID, me): entry}, [])
                out[name] = "accepted"
            except InvalidEntryError as exc:
                out[name] = f"refused: {exc}"
        out["held_after_bad"] = len(backend.read_back())
        # a full map: 4 entries fit, the next ones are reported per key
        with workers() as pids:
            for i in range(6):
                pids.append(fork_worker(lambda: time.sleep(600), f"fill{i}"))
            time.sleep(0.3)
            upserts = {}
            for pid in pids:
                k, s = key_for(KeyKind.TID, pid)
                upserts[k] = Entry(1, 0, s)
            res = backend.apply(upserts, [])
            out["full"] = {
                "upserted": res.upserted,
                "map_full": sum(isinstance(e, MapFullError) for e in res.failed.values()),
                "messages": sorted({str(e) for e in res.failed.values()}),
            }
            out["held_after_full"] = len(backend.read_back())
        gone = EntryKey(KeyKind.TID, pids[0])
        res = backend.apply({gone: Entry(1, 0, upserts[gone].start_time)}, [])
        out["gone"] = type(res.failed.get(gone)).__name__
    return out


def ejection(_: argparse.Namespace) -> dict[str, Any]:
    """sysrq-S kicks the scheduler out: health says EJECTED with the kernel's reason; a restart works.
    Without CAP_SYS_ADMIN, as in the agent, which drops it before its first thread starts
    (gthulhu_node/privileges.py): loading and reloading need CAP_BPF and CAP_PERFMON only."""
    out: dict[str, Any] = {}
    out["dropped"] = list(capabilities.names(capabilities.drop([capabilities.CAP_SYS_ADMIN]).dropped))
    backend = SchedExtBackend(SchedulerConfig(), protect_agent=False)
    backend.start()
    Path("/proc/sysrq-trigger").write_text("S")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and backend.health().state is BackendState.RUNNING:
        time.sleep(0.05)
    health = backend.health()
    out["health"] = health.state.value
    out["reason"] = health.reason
    out["exit_kind"] = backend.exit_kind()
    backend.stop()
    backend.start()
    out["restarted"] = state()
    out["health_restarted"] = backend.health().state.value
    backend.stop()
    out["final"] = state()
    return out


def _capacities() -> dict[int, int]:
    return {cpu: int(Path(f"/sys/devices/system/cpu/cpu{cpu}/cpu_capacity").read_text())
            for cpu in sorted(os.sched_getaffinity(0))}


def _placement(pids: dict[str, int], big: set[int], seconds: float) -> dict[str, float]:
    """Fraction of each task's run time spent on a CPU of `big`, by sched_switch (switch_trace.py)."""
    with switches(pids.values()) as seen:
        time.sleep(seconds)
    assert not seen.lost, f"the trace lost {seen.lost} events"
    return {name: seen.share_on(pid, big) for name, pid in pids.items()}


def _busy(cpus: set[int], seconds: float) -> dict[int, float]:
    """Fraction of wall time each CPU was not idle, from /proc/stat."""
    def read() -> dict[int, tuple[int, int]]:
        out = {}
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                values = [int(v) for v in fields]
                out[int(name[3:])] = (sum(values), values[3] + values[4])  # idle + iowait
        return out

    before = read()
    time.sleep(seconds)
    after = read()
    return {cpu: round(1 - (after[cpu][1] - before[cpu][1]) / max(1, after[cpu][0] - before[cpu][0]), 3)
            for cpu in sorted(cpus)}


def capacity(args: argparse.Namespace) -> dict[str, Any]:
    """Big and little CPUs (the arm64 guest's device tree): where boosted engines run, and whether the big
    CPUs still serve unboosted work when nothing boosted needs them. Engines are 60 % busy (6 ms of CPU,
    4 ms asleep: an engine's step loop, below the per-task guard), among one CPU hog per CPU."""
    caps = _capacities()
    big = {cpu for cpu, cap in caps.items() if cap == max(caps.values())}
    out: dict[str, Any] = {"capacities": caps, "big": sorted(big)}
    ncpu = len(caps)
    with scheduler() as backend, workers() as pids:
        for i in range(ncpu):
            pids.append(fork_worker(spin, f"hog{i}"))
        engines = {f"engine{i}": fork_worker(busy_fraction(6, 4), f"engine{i}") for i in range(len(big))}
        pids += engines.values()
        time.sleep(0.5)
        out["off"] = _placement(engines, big, args.seconds)
        before = backend.counters()
        keys = dict(key_for(KeyKind.TID, pid) for pid in engines.values())
        res = backend.apply({k: Entry(5, 0, start) for k, start in keys.items()}, [])
        out["apply_failed"] = {str(k): str(e) for k, e in res.failed.items()}
        out["on"] = _placement(engines, big, args.seconds)
        out["capacity_placements"] = backend.counters()["capacity_placements"] - before["capacity_placements"]
        backend.apply({}, list(keys))
        for pid in engines.values():
            os.kill(pid, signal.SIGKILL)
        out["hogs_only_busy"] = _busy(set(caps), args.seconds)
        out["health"] = backend.health().state.value
    return out


SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "lifecycle": lifecycle,
    "verifier": verifier,
    "other-scheduler": other_scheduler,
    "crashed-agent": crashed_agent,
    "_hold": _hold,
    "tid-tgid-share": tid_tgid_share,
    "slice-only": slice_only,
    "no-leak": no_leak,
    "no-leak-agent": no_leak_agent,
    "starvation": starvation,
    "affinity": affinity,
    "bound-steer": bound_steer,
    "pinned-group": pinned_group,
    "joint-wake": joint_wake,
    "lone-busy": lone_busy,
    "numa": numa,
    "node-balance": node_balance,
    "kthread-lock-holder": kthread_lock_holder,
    "cpu-max": cpu_max,
    "group-share": group_share,
    "hierarchy": hierarchy,
    "bad-input": bad_input,
    "ejection": ejection,
    "capacity": capacity,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("arg", nargs="?", default="")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=10_000)
    args = parser.parse_args()
    result = SCENARIOS[args.scenario](args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
