"""The sched_ext lab VM: a Debian kernel with sched_ext booted under qemu (TCG), running this machine's
own userland, for tests and for people.

The guest's root is this machine's / shared read-only over virtiofs, and every place the guest writes
gets a tmpfs (tests/vm/guest_init.py), so a guest can never change the machine's files: the virtiofs
daemons even serve read-only bind mounts, so a guest that remounted its root read-write still could not
write. The repository is shared a second time (read-only) and mounted at its own path, because it may
live under a folder that gets a tmpfs in the guest; a per-boot scratch folder is shared read-write at the
same path on both sides, for files a test wants back.

Commands go to tests/vm/guest_agent.py over a virtio-serial port (length-prefixed JSON). A guest that
dies (qemu exits, kernel panic, the port closes) or hangs (no reply and no answer to a ping) is marked
dead, killed, and the next use boots a fresh one; the error carries the tail of the kernel console.
qemu and virtiofsd run in their own sessions with PR_SET_PDEATHSIG, so they die with the process that
started them, even when that process is SIGKILLed.

    with Lab() as lab:
        r = lab.run("cat /sys/kernel/sched_ext/state")

People: `python -m tests.vm.lab shell` and `python -m tests.vm.lab run -- CMD...` (see docs/lab.md).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import itertools
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tests.vm import devicetree
from tests.vm.guest_agent import HEADER, take_frames
from tests.vm.kernel import LabKernel, obtain
from tests.vm.rootfs import install_init, mountpoint_for, obtain_rootfs

REPO = Path(__file__).resolve().parents[2]
RUNTIME = Path(os.environ.get("GTHULHU_LAB_RUNTIME", "/var/tmp/gthulhu-node-lab"))
LOGS = RUNTIME / "logs"
QEMU = os.environ.get("GTHULHU_LAB_QEMU", "qemu-system-x86_64")
VIRTIOFSD = "/usr/lib/qemu/virtiofsd"
GUEST_INIT = "tests/vm/guest_init.py"
REPLY_GRACE = 30.0  # beyond a command's own timeout, for the agent's kill, the transfer and a slow TCG guest
KEEP_LOGS = 200  # console logs kept (a few KB each), across everyone using this machine
# Every vCPU on one host thread: multi-threaded TCG let a vCPU run a stale translation holding a live-patch
# int3 after the patch completed, and the guest died of "Oops: int3" (docs/lab.md, "The emulator hazard":
# 4 in 96 enables of the scheduler with qemu 7.2, 1 in 282 with qemu 10, none in 300 single-threaded).
TCG_THREAD = "single"

Init = Literal["plain", "systemd"]
Arch = Literal["x86_64", "aarch64"]
# The arm64 guest: qemu's virt machine with GICv3 (more than 8 CPUs), a CPU whose pointer authentication
# uses qemu's own cheap hash instead of QARMA (the architected one costs TCG a large share of its time).
AARCH64_QEMU = os.environ.get("GTHULHU_LAB_QEMU_AARCH64", "qemu-system-aarch64")
AARCH64_MACHINE = ["-machine", "virt,gic-version=3", "-cpu", "max,pauth-impdef=on"]


class LabError(RuntimeError):
    """The lab could not do what was asked (the guest may still be fine)."""


class LabDied(LabError):
    """The guest died or hung; it has been killed, and the next use boots a fresh one."""

    def __init__(self, reason: str, console: str) -> None:
        self.reason = reason
        self.console = console
        tail = "\n".join(console.splitlines()[-80:])
        super().__init__(f"{reason}\n--- lab console, last lines ---\n{tail}\n--- end of lab console ---")


class LabBootError(LabDied):
    """The guest did not come up."""


class CommandFailed(LabError):
    """RunResult.check() on a command that failed or timed out."""

    def __init__(self, result: RunResult, what: str) -> None:
        self.result = result
        super().__init__(
            f"{what}: returncode={result.returncode} timed_out={result.timed_out}\n"
            f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
        )


@dataclass(frozen=True)
class RunResult:
    """What a command did in the guest. returncode is negative (-signal) when it was killed."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    duration: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def check(self, what: str = "lab command failed") -> RunResult:
        """Return self, or raise CommandFailed with the output when the command failed."""
        if not self.ok:
            raise CommandFailed(self, what)
        return self


# --- child processes that die with us -----------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with(parent: int) -> Callable[[], None]:
    def preexec() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class _Spawner:
    """Starts children from the main thread or from one long-lived thread: PR_SET_PDEATHSIG fires when
    the *thread* that forked the child ends, so a child forked from a short-lived worker thread (a
    ThreadPoolExecutor, a pytest plugin) would be killed when that thread finishes."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[list[str], dict[str, Any], Future[subprocess.Popen[bytes]]]] = (
            queue.Queue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        if threading.current_thread() is threading.main_thread():
            return self._popen(argv, kwargs)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="lab-spawner", daemon=True)
                self._thread.start()
        done: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((argv, kwargs, done))
        return done.result()

    def _loop(self) -> None:
        while True:
            argv, kwargs, done = self._jobs.get()
            try:
                done.set_result(self._popen(argv, kwargs))
            except BaseException as exc:
                done.set_exception(exc)

    @staticmethod
    def _popen(argv: list[str], kwargs: dict[str, Any]) -> subprocess.Popen[bytes]:
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(argv, preexec_fn=_die_with(os.getpid()), **kwargs)


_spawner = _Spawner()
_live: set[Lab] = set()
_live_lock = threading.Lock()


def close_all() -> None:
    """Stop every lab this process started (atexit and pytest's session end call it)."""
    with _live_lock:
        labs = list(_live)
    for lab in labs:
        lab.close()


atexit.register(close_all)


def _stop(proc: subprocess.Popen[bytes] | None, grace: float = 3.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exited(pid: int) -> bool:
    """The process has exited: its /proc entry is gone, or it is a zombie (state Z or X) nobody reaped
    yet. For tests that check a kill: the killed process is gone only once the kernel has delivered it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def _reap_stale_runs() -> None:
    """Remove run folders left by harness processes that were killed (their qemu died with them)."""
    for path in RUNTIME.glob("run-*"):
        try:
            pid = int(path.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
    # Another harness (the other xdist lane, another person's run) may trim at the same moment: a log
    # gone between the listing and its stat is simply not ours to count.
    dated: list[tuple[float, Path]] = []
    for log in LOGS.glob("*.console.log"):
        with contextlib.suppress(FileNotFoundError):
            dated.append((log.stat().st_mtime, log))
    for _, old in sorted(dated)[:-KEEP_LOGS]:
        old.unlink(missing_ok=True)


# A read-only view of a folder for virtiofsd: a recursive bind mount in a private mount namespace, every
# mount in it remounted read-only, then virtiofsd serves (and chroots into) that view.
_RO_VIEW = r"""
set -e
mount --make-rprivate /
mount --rbind "$1" "$2"
# The host's own pseudo filesystems are not the guest's business (it mounts its own).
for pseudo in proc sys dev run; do
    umount -R -l "$2/$pseudo" 2>/dev/null || true
done
findmnt -R -n -r -o TARGET "$2" | while read -r m; do
    mount -o remount,bind,ro "$(printf '%b' "$m")" 2>/dev/null || true
done
shift 2
exec "$@"
"""


@dataclass
class _Pending:
    event: threading.Event
    reply: dict[str, Any] | None = None
    error: str | None = None


class Lab:
    """One lab guest: booted on first use, rebooted on next use after it died. Thread-safe."""

    def __init__(
        self,
        init: Init = "plain",
        *,
        kernel: LabKernel | None = None,
        repo: Path = REPO,
        cpus: int = 2,
        memory_mb: int = 2048,
        numa_nodes: int = 1,
        max_cpus: int | None = None,
        tcg_thread: str | None = None,
        boot_timeout: float | None = None,
        console_keep: int = 256 * 1024,
        append: Sequence[str] = (),
        arch: Arch = "x86_64",
        capacities: Sequence[int] | None = None,
    ) -> None:
        if init not in ("plain", "systemd"):
            raise ValueError(f"init must be 'plain' or 'systemd', not {init!r}")
        self.init: Init = init
        if arch not in ("x86_64", "aarch64"):
            raise ValueError(f"arch must be 'x86_64' or 'aarch64', not {arch!r}")
        self.arch: Arch = arch
        if capacities is not None and (arch != "aarch64" or len(capacities) != cpus):
            raise ValueError("capacities: one per CPU, on the aarch64 guest only (a device tree property)")
        self.capacities = list(capacities) if capacities is not None else None
        self.kernel = kernel or obtain(arch="arm64" if arch == "aarch64" else "amd64")
        # The x86 guest runs this machine's own userland; the arm64 one a Debian root of its own.
        self.root = obtain_rootfs() if arch == "aarch64" else Path("/")
        self.repo = repo.resolve()
        if cpus < 1 or numa_nodes < 1 or cpus % numa_nodes or (max_cpus is not None and max_cpus < cpus):
            raise ValueError(f"bad shape: {cpus} CPUs over {numa_nodes} NUMA nodes, max {max_cpus}")
        if memory_mb % numa_nodes:
            raise ValueError(f"{memory_mb} MB does not split over {numa_nodes} NUMA nodes")
        self.cpus = cpus
        self.memory_mb = memory_mb
        self.numa_nodes = numa_nodes
        self.max_cpus = max_cpus or cpus
        self.tcg_thread = tcg_thread or os.environ.get("GTHULHU_LAB_TCG_THREAD", TCG_THREAD)
        if self.tcg_thread not in ("single", "multi"):
            raise ValueError(f"tcg_thread must be 'single' or 'multi', not {self.tcg_thread!r}")
        default_timeout = (420.0 if init == "systemd" else 180.0) * (3 if arch == "aarch64" else 1)
        self.boot_timeout = boot_timeout or float(os.environ.get("GTHULHU_LAB_BOOT_TIMEOUT", default_timeout))
        self.console_keep = console_keep
        self.append = list(append)
        self.reply_grace = REPLY_GRACE
        self.ping_timeout = 15.0
        self.boots = 0
        self.boot_id: str | None = None
        self.boot_seconds: float | None = None
        self.systemd_state: str | None = None
        self.run_dir: Path | None = None
        self.console_log: Path | None = None
        self._qemu: subprocess.Popen[bytes] | None = None
        self._fsds: list[subprocess.Popen[bytes]] = []
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._boot_lock = threading.RLock()
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._hello: dict[str, Any] | None = None
        self._hello_event = threading.Event()
        self._dead: str | None = None
        self._console = bytearray()
        self._console_lock = threading.Lock()
        for path in (self.repo, RUNTIME, self.kernel.root):
            if any(c.isspace() for c in str(path)):
                raise LabError(f"lab paths cannot contain whitespace (kernel command line): {path}")

    # --- public API -------------------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def scratch_host(self) -> Path:
        """This boot's read-write shared folder as the host sees it (boots the guest if needed)."""
        self.start()
        assert self.run_dir is not None
        return self.run_dir / "scratch"

    @property
    def scratch_guest(self) -> Path:
        """The same folder as the guest sees it: the same path."""
        return self.scratch_host

    @property
    def venv_python(self) -> str:
        return str(self.repo / ".venv/bin/python")

    def start(self, wait: bool = True) -> None:
        """Boot the guest unless it is up; wait=False returns once qemu runs (without waiting for the
        agent). Raises LabBootError with the console if the guest does not come up."""
        with self._boot_lock:
            if self._running():
                if wait and self._hello is None:
                    self._await_agent()
                return
            self._teardown()
            self._launch()
            if wait:
                self._await_agent()

    def run(
        self,
        cmd: str | Sequence[str],
        timeout: float = 60,
        input: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> RunResult:
        """Run a command as root in the guest (a str goes to `bash -c`), cwd = the repo by default.
        Raises LabDied (with the console tail) if the guest died or hung meanwhile."""
        self.start()
        request: dict[str, Any] = {
            "op": "run",
            "timeout": timeout,
            "cwd": str(cwd if cwd is not None else self.repo),
            "env": env,
            "input": input,
        }
        if isinstance(cmd, str):
            request["shell"] = cmd
        else:
            request["argv"] = [str(a) for a in cmd]
        reply = self._request(request, timeout + self.reply_grace)
        if reply is None:
            if not self.ping():
                self._die(f"guest hung: no reply to {cmd!r} within {timeout:g}+{self.reply_grace:g} s "
                          "and no answer to a ping")
                raise LabDied(self._dead or "guest hung", self.console_tail())
            raise LabError(f"the agent did not answer {cmd!r} in time although the guest answers pings")
        if "error" in reply:
            raise LabError(f"lab agent: {reply['error']}")
        return RunResult(
            returncode=int(reply["returncode"]),
            stdout=reply["stdout"],
            stderr=reply["stderr"],
            timed_out=bool(reply["timed_out"]),
            duration=float(reply["duration"]),
        )

    def python(
        self,
        *args: str,
        timeout: float = 60,
        input: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> RunResult:
        """Run the repository's .venv python with args, e.g. lab.python("tests/vm/x.py", "--n", "3")."""
        return self.run([self.venv_python, *args], timeout=timeout, input=input, env=env, cwd=cwd)

    def ping(self, timeout: float | None = None) -> bool:
        """True if the running guest's agent answers (and is the agent of this boot)."""
        if not self._running() or self._hello is None:
            return False
        try:
            reply = self._request({"op": "ping"}, timeout or self.ping_timeout)
        except LabDied:
            return False
        return reply is not None and reply.get("boot_id") == self.boot_id

    def alive(self) -> bool:
        return self.ping()

    def ensure_alive(self) -> None:
        """Boot a fresh guest if this one died or stopped answering (the fixtures call it per test)."""
        with self._boot_lock:
            if self._running() and self._hello is not None and self.ping():
                return
            if self._running():
                self._die("guest stopped answering pings")
            self.start()

    def kill(self) -> None:
        """SIGKILL qemu now, as a crash would; the harness notices like any other death."""
        if self._qemu is not None and self._qemu.poll() is None:
            self._qemu.kill()

    def close(self) -> None:
        """Stop the guest and its daemons and remove this boot's folder (the console log stays)."""
        with self._boot_lock:
            self._die("lab closed")
            self._teardown()

    def pids(self) -> list[int]:
        """qemu's and the virtiofs daemons' pids (while they run)."""
        procs = [p for p in (self._qemu, *self._fsds) if p is not None and p.poll() is None]
        return [p.pid for p in procs]

    def console_tail(self, size: int = 64 * 1024) -> str:
        """The last `size` bytes of the kernel console (boot messages, oopses, sched_ext's reasons)."""
        with self._console_lock:
            return bytes(self._console[-size:]).decode(errors="replace")

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    # --- boot ---------------------------------------------------------------------------------------

    def _running(self) -> bool:
        return self._qemu is not None and self._qemu.poll() is None and self._dead is None

    def _launch(self) -> None:
        run_dir = self._new_run_dir()
        self._dead = None
        self._hello = None
        self._hello_event.clear()
        with self._console_lock:
            self._console.clear()
        self.boots += 1
        stamp = time.strftime("%Y%m%d-%H%M%S")
        # The xdist worker (gw0, gw1) names the lane a log came from; both lanes run guests at once.
        lane = os.environ.get("PYTEST_XDIST_WORKER", "")
        who = f"{os.getpid()}-{lane}" if lane else str(os.getpid())
        self.console_log = LOGS / f"{stamp}-{who}-{self.init}-{self.boots}.console.log"
        self._started_at = time.monotonic()

        self._start_shares(run_dir)
        mode = "systemd" if self.init == "systemd" else "agent"
        self._qemu = _spawner.popen(
            self._qemu_argv(run_dir, self._cmdline(run_dir, mode)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        with _live_lock:
            _live.add(self)
        threading.Thread(target=self._read_console, args=(self._qemu, self.boots), daemon=True).start()
        self._connect(run_dir / "serial.sock")

    def _new_run_dir(self) -> Path:
        RUNTIME.mkdir(parents=True, exist_ok=True)
        LOGS.mkdir(parents=True, exist_ok=True)
        _reap_stale_runs()
        # The guest mounts the kernel's own modules folder (build/source links to the headers) here.
        with contextlib.suppress(OSError):
            Path("/usr/lib/modules").mkdir(exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=RUNTIME))
        (run_dir / "scratch").mkdir()
        self.run_dir = run_dir
        return run_dir

    def _start_shares(self, run_dir: Path) -> None:
        """virtiofsd for the root (read-only), the repository (read-only) and the scratch folder.

        Caching decides the guest's speed: with cache=none every exec and import re-reads its files
        through virtiofsd (measured: 2 s for `bash -c true`, a 2-minute boot). The root is the machine's
        system, which does not change during a boot: cache=always. The repository may be edited while
        a lab runs: cache=auto (attributes rechecked after 1 s, file data re-read at open). The scratch
        folder is written from both sides: cache=none."""
        scratch = run_dir / "scratch"
        if self.root != Path("/"):
            for where in (self.repo, scratch):
                mountpoint_for(self.root, where)
        shares = [
            ("rootfs", self.root, True, "always"),
            ("repo", self.repo, True, "auto"),
            ("scratch", scratch, False, "none"),
        ]
        for tag, source, readonly, cache in shares:
            self._fsds.append(self._virtiofsd(run_dir, tag, source, readonly, cache))
        for tag, *_ in shares:
            self._wait_for_socket(run_dir / f"{tag}.sock")

    def _virtiofsd(
        self, run_dir: Path, tag: str, source: Path, readonly: bool, cache: str
    ) -> subprocess.Popen[bytes]:
        sock = run_dir / f"{tag}.sock"
        argv = [VIRTIOFSD, f"--socket-path={sock}", "-o", f"cache={cache}", "-o", "sandbox=chroot"]
        if readonly:
            view = run_dir / f"{tag}.view"
            view.mkdir()
            argv = ["unshare", "--mount", "--propagation", "private", "/bin/bash", "-c", _RO_VIEW,
                    "lab-ro-view", str(source), str(view), *argv, "-o", f"source={view}"]
        else:
            argv += ["-o", f"source={source}"]
        log = open(run_dir / f"virtiofsd-{tag}.log", "wb")  # noqa: SIM115 (the child keeps it)
        try:
            return _spawner.popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def _wait_for_socket(self, path: Path, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            dead = [p for p in self._fsds if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "".join(p.read_text(errors="replace") for p in path.parent.glob("virtiofsd-*.log"))
                self._teardown()
                raise LabBootError(f"virtiofsd did not create {path}", logs)
            time.sleep(0.02)

    def _cmdline(self, run_dir: Path, mode: str) -> str:
        console = "ttyAMA0" if self.arch == "aarch64" else "ttyS0"
        init = self.repo / GUEST_INIT
        if self.root != Path("/"):
            init = install_init(self.root, init)
        words = [
            f"console={console}", "rootfstype=virtiofs", "root=rootfs", "ro", f"init={init}",
            "panic=-1", "quiet", f"lab.mode={mode}", f"lab.repo={self.repo}",
            f"lab.scratch={run_dir / 'scratch'}", f"lab.console={console}",
        ]
        if self.arch == "aarch64":
            # No host kernel tree in that root (nothing there runs BCC); the repository's x86 venv is
            # replaced in the guest by one on the guest's own python (tests/vm/guest_init.py).
            words.append("lab.python=/usr/bin/python3")
        else:
            words.append(f"lab.kroot={self.kernel.root}")
        if mode == "systemd":
            words += ["systemd.unit=multi-user.target", "fstab=no", "systemd.getty_auto=0",
                      "systemd.show_status=error"]
        return " ".join(words + self.append)

    def _qemu_argv(self, run_dir: Path, cmdline: str, *, serial: str = "stdio") -> list[str]:
        mem = f"{self.memory_mb}M"
        smp = str(self.cpus) if self.max_cpus == self.cpus else f"{self.cpus},maxcpus={self.max_cpus}"
        qemu = AARCH64_QEMU if self.arch == "aarch64" else QEMU
        machine = AARCH64_MACHINE if self.arch == "aarch64" else ["-cpu", "max"]
        # A qemu unpacked elsewhere (…/usr/bin/qemu-system-x86_64) brings its firmware in …/usr/share/qemu.
        firmware = Path(qemu).resolve().parents[1] / "share" / "qemu" if "/" in qemu else None
        argv = [
            qemu, *(["-L", str(firmware)] if firmware and firmware.is_dir() else []),
            "-accel", f"tcg,thread={self.tcg_thread}", *machine, "-smp", smp, "-m", mem,
            "-nodefaults", "-nographic", "-no-reboot", "-serial", serial,
            "-kernel", str(self.kernel.vmlinuz), "-append", cmdline,
        ]
        # One memfd backend per NUMA node (vhost-user needs shared memory), CPUs split evenly.
        per_node, node_mem = self.max_cpus // self.numa_nodes, self.memory_mb // self.numa_nodes
        for node in range(self.numa_nodes):
            first = node * per_node
            last = self.max_cpus - 1 if node == self.numa_nodes - 1 else first + per_node - 1
            argv += ["-object", f"memory-backend-memfd,id=mem{node},size={node_mem}M,share=on",
                     "-numa", f"node,nodeid={node},memdev=mem{node},cpus={first}-{last}"]
        argv += [
            "-device", "virtio-serial",
            "-chardev", f"socket,id=lab,path={run_dir / 'serial.sock'},server=on,wait=off",
            "-device", "virtserialport,chardev=lab,name=lab",
        ]
        if serial == "stdio":
            argv += ["-monitor", "none"]
        for i, tag in enumerate(("rootfs", "repo", "scratch")):
            argv += ["-chardev", f"socket,id=fs{i},path={run_dir / (tag + '.sock')}",
                     "-device", f"vhost-user-fs-pci,chardev=fs{i},tag={tag}"]
        if self.capacities is not None:
            argv += ["-dtb", str(devicetree.with_capacities(argv, self.capacities, run_dir))]
        return argv

    def _connect(self, path: Path, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(path))
                break
            except OSError as exc:
                sock.close()
                if (self._qemu is not None and self._qemu.poll() is not None) or time.monotonic() > deadline:
                    reason = f"cannot connect to the guest's serial port {path}: {exc}"
                    self._die(reason)
                    raise LabBootError(reason, self._wait_console()) from exc
                time.sleep(0.02)
        self._sock = sock
        assert self._qemu is not None
        threading.Thread(target=self._read_serial, args=(sock, self._qemu, self.boots), daemon=True).start()

    def _await_agent(self) -> None:
        deadline = self._started_at + self.boot_timeout
        while not self._hello_event.wait(0.5):
            if self._dead is not None:
                raise LabBootError(f"guest died while booting: {self._dead}", self._wait_console())
            if time.monotonic() > deadline:
                self._die(f"guest did not start its agent within {self.boot_timeout:.0f} s")
                raise LabBootError(self._dead or "boot timeout", self.console_tail())
        hello = self._hello
        if hello is None:
            raise LabBootError(f"guest died while booting: {self._dead}", self._wait_console())
        self.boot_id = str(hello.get("boot_id"))
        if self.init == "systemd":
            left = max(10.0, deadline - time.monotonic())
            r = self.run(["systemctl", "is-system-running", "--wait"], timeout=left)
            self.systemd_state = r.stdout.strip()
        self.boot_seconds = time.monotonic() - self._started_at

    def _wait_console(self, qemu: subprocess.Popen[bytes] | None = None, timeout: float = 5) -> str:
        """The console once qemu has exited (so the panic text is complete)."""
        qemu = qemu or self._qemu
        if qemu is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                qemu.wait(timeout)
        time.sleep(0.1)
        return self.console_tail()

    # --- I/O threads --------------------------------------------------------------------------------

    def _read_console(self, qemu: subprocess.Popen[bytes], boot: int) -> None:
        assert qemu.stdout is not None
        fd = qemu.stdout.fileno()
        log = open(self.console_log, "ab") if self.console_log else None  # noqa: SIM115
        panic_seen = False
        try:
            while True:
                try:
                    chunk = os.read(fd, 1 << 16)
                except OSError:  # closed by _teardown
                    chunk = b""
                if not chunk:
                    break
                if log is not None:
                    log.write(chunk)
                    log.flush()
                with self._console_lock:
                    self._console += chunk
                    if len(self._console) > self.console_keep:
                        del self._console[: len(self._console) - self.console_keep]
                    tail = bytes(self._console[-4096:])
                if not panic_seen and b"Kernel panic - not syncing" in tail:
                    panic_seen = True
                    # panic=-1 with -no-reboot makes qemu exit by itself; make sure it does.
                    threading.Timer(10, qemu.kill).start()
        finally:
            if log is not None:
                log.close()
        status = qemu.wait()
        self._die(f"qemu exited (status {status}){' after a kernel panic' if panic_seen else ''}", boot)

    def _read_serial(self, sock: socket.socket, qemu: subprocess.Popen[bytes], boot: int) -> None:
        buf = bytearray()  # appended in small chunks: bytes concatenation would be quadratic for MBs
        while True:
            try:
                chunk = sock.recv(1 << 20)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            for body in take_frames(buf):
                self._dispatch(json.loads(body))
        if boot == self.boots:
            self._wait_console(qemu)
            status = qemu.poll()
            exited = f" (qemu exited, status {status})" if status is not None else ""
            self._die(f"the guest's serial port closed{exited}", boot)

    def _dispatch(self, message: dict[str, Any]) -> None:
        if message.get("event") == "hello":
            self._hello = message
            self._hello_event.set()
            return
        with self._lock:
            pending = self._pending.pop(int(message.get("id") or 0), None)
        if pending is not None:
            pending.reply = message
            pending.event.set()

    def _request(self, message: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """Send a request; its reply, or None if none came within timeout. LabDied if the guest died."""
        pending = _Pending(threading.Event())
        with self._lock:
            if self._dead is not None or self._sock is None:
                raise LabDied(self._dead or "lab not started", self.console_tail())
            ident = next(self._ids)
            self._pending[ident] = pending
            sock = self._sock
        body = json.dumps({**message, "id": ident}).encode()
        try:
            with self._send_lock:
                sock.sendall(HEADER.pack(len(body)) + body)
        except OSError as exc:
            self._die(f"cannot write to the guest's serial port: {exc}")
        if not pending.event.wait(timeout):
            with self._lock:
                self._pending.pop(ident, None)
            return None
        if pending.error is not None:
            raise LabDied(pending.error, self.console_tail())
        return pending.reply

    # --- death and cleanup --------------------------------------------------------------------------

    def _die(self, reason: str, boot: int | None = None) -> None:
        """Mark the guest dead (first reason wins), fail every waiting request, and kill the processes.
        The I/O threads pass their boot number: a thread of an earlier boot must not kill a newer one."""
        with self._lock:
            if boot is not None and boot != self.boots:
                return
            if self._dead is None:
                self._dead = reason
            pending, self._pending = self._pending, {}
            dead = self._dead
        for p in pending.values():
            p.error = dead
            p.event.set()
        self._hello_event.set()
        if self._qemu is not None and self._qemu.poll() is None:
            self._qemu.kill()

    def _teardown(self) -> None:
        qemu, self._qemu = self._qemu, None
        _stop(qemu)
        if qemu is not None and qemu.stdout is not None:
            with contextlib.suppress(OSError):
                qemu.stdout.close()
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        fsds, self._fsds = self._fsds, []
        for p in fsds:
            _stop(p)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None
        with _live_lock:
            _live.discard(self)

    # --- people -----------------------------------------------------------------------------------------

    def interactive_shell(self) -> int:
        """Boot a guest whose console (this terminal) runs a root shell; returns when it powers off.
        Ctrl-A X quits qemu at any time."""
        with self._boot_lock:
            self.close()
            run_dir = self._new_run_dir()
            try:
                self._start_shares(run_dir)
                size = shutil.get_terminal_size()
                term = os.environ.get("TERM", "linux")
                cmdline = f"{self._cmdline(run_dir, 'shell')} lab.rows={size.lines} lab.cols={size.columns}"
                cmdline += f" lab.term={term}"
                argv = self._qemu_argv(run_dir, cmdline, serial="mon:stdio")
                qemu = subprocess.Popen(argv, preexec_fn=_die_with(os.getpid()))
                self._qemu = qemu
                return qemu.wait()
            finally:
                self._teardown()


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.vm.lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sh = sub.add_parser("shell", help="an interactive root shell in the lab (exit or Ctrl-A X to leave)")
    sh.set_defaults(init="plain")
    rn = sub.add_parser("run", help="run one command in the lab: run -- CMD [ARGS...]; one word = bash -c")
    rn.add_argument("--systemd", action="store_const", const="systemd", default="plain", dest="init",
                    help="boot with systemd as PID 1")
    rn.add_argument("--timeout", type=float, default=600)
    rn.add_argument("--console", action="store_true", help="print the kernel console afterwards (stderr)")
    rn.add_argument("cmd", nargs=argparse.REMAINDER)
    for p in (sh, rn):
        p.add_argument("--arch", choices=["x86_64", "aarch64"], default="x86_64",
                       help="aarch64: the arm64 guest (its own Debian root, tests/vm/rootfs.py)")
    args = parser.parse_args(argv)
    if args.what == "shell":
        return Lab(arch=args.arch).interactive_shell()
    cmd: list[str] = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("run needs a command: run -- CMD [ARGS...]")
    with Lab(args.init, arch=args.arch) as lab:
        try:
            result = lab.run(cmd[0] if len(cmd) == 1 else cmd, timeout=args.timeout)
        except LabDied as exc:
            print(exc, file=sys.stderr)
            return 125
        finally:
            if args.console:
                sys.stderr.write(lab.console_tail())
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
        if result.timed_out:
            print(f"lab: timed out after {args.timeout:g} s", file=sys.stderr)
            return 124
        return result.returncode if result.returncode >= 0 else 128 - result.returncode


if __name__ == "__main__":
    sys.exit(_main())
