#!/usr/bin/python3 -S
"""PID 1 of the lab guest (kernel command line: init=<this file>); stdlib only, run by /usr/bin/python3.

The root filesystem is the host's / over virtiofs, mounted read-only: every place the guest must write
gets a tmpfs here, so nothing the guest does reaches the host's files. It is Python, not a shell script,
because under TCG every exec costs ~0.5 s (each binary and library is opened through virtiofsd): the ~40
`mount`/`mkdir`/`ln` processes of a shell version took 19 s of a 28 s boot; syscalls through ctypes take
none, and the agent then runs in a forked child without a second interpreter start.

The harness (tests/vm/lab.py) passes its settings as lab.* words on the kernel command line:
  lab.mode=agent|shell|systemd  what runs once the mounts are up
  lab.repo=PATH      the repository, shared again (read-only, tag "repo") and mounted at its own path,
                     because it may live under a folder that gets a tmpfs here (/tmp, /var/tmp)
  lab.scratch=PATH   this boot's scratch folder, shared read-write (tag "scratch"), same path as on the host
  lab.kroot=PATH     the unpacked lab kernel in the host's cache, kept visible across the /var/cache tmpfs;
                     /lib/modules/$(uname -r)/{build,source} link to its header trees (for BCC)
  lab.rows=N lab.cols=N lab.term=T   the terminal of `python -m tests.vm.lab shell`
  lab.console=DEV    that terminal's device (ttyS0 on x86, ttyAMA0 on arm64)
  lab.python=PATH    the arm64 guest: the repository's .venv is this machine's (x86) and cannot run there,
                     so a tmpfs over it holds a venv on the guest's own python instead (guest_venv)
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys
import termios
import time
import traceback

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE = 32, 4096, 8192
SIOCSIFFLAGS, IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x8914, 0x1, 0x8, 0x40
AGENT_UNIT = "gthulhu-lab-agent.service"
# Units that fail in the lab (no network, no udev, no modules, read-only /etc and /var content) or only
# slow the boot down. The guest has no login prompt: people use `python -m tests.vm.lab shell`.
MASKED = [
    "getty@tty1.service", "serial-getty@ttyS0.service", "console-getty.service", "getty-static.service",
    "systemd-logind.service", "systemd-user-sessions.service",
    "systemd-timesyncd.service", "systemd-pstore.service", "systemd-networkd.service",
    "systemd-networkd-wait-online.service", "systemd-resolved.service", "networking.service",
    "systemd-remount-fs.service", "systemd-fsck-root.service", "e2scrub_reap.service", "e2scrub_all.service",
    "postgresql.service", "ssh.service", "cron.service", "rsyslog.service",
    "apt-daily.timer", "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "e2scrub_all.timer", "fstrim.timer",
    "man-db.timer", "logrotate.timer", "systemd-tmpfiles-clean.timer",
    "systemd-update-utmp.service", "systemd-update-utmp-runlevel.service",
    "systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount", "sys-fs-fuse-connections.mount",
    "systemd-firstboot.service", "systemd-hwdb-update.service", "ldconfig.service",
    "systemd-sysusers.service",
    "systemd-journal-catalog-update.service", "systemd-update-done.service", "systemd-repart.service",
    "systemd-random-seed.service", "systemd-machine-id-commit.service", "systemd-pcrphase.service",
    "systemd-pcrphase-sysinit.service", "systemd-modules-load.service", "kmod-static-nodes.service",
    "modprobe@.service", "systemd-ask-password-console.path", "systemd-ask-password-wall.path",
    "systemd-journald-audit.socket", "systemd-initctl.socket", "systemd-journal-flush.service",
    "sys-kernel-config.mount", "dev-hugepages.mount", "dev-mqueue.mount", "remote-fs.target",
]

_libc = ctypes.CDLL(None, use_errno=True)


def say(message: str) -> None:
    print(f"lab-init: {message}", flush=True)


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                   data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or source} on {target}: {os.strerror(err)}")


def try_mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> bool:
    try:
        os.makedirs(target, exist_ok=True)
        mount(source, target, fstype, flags, data)
    except OSError as exc:
        say(str(exc))
        return False
    return True


def mounted(target: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


def cmdline() -> dict[str, str]:
    with open("/proc/cmdline") as f:
        words = f.read().split()
    return {k[4:]: v for k, _, v in (w.partition("=") for w in words) if k.startswith("lab.")}


def setup(conf: dict[str, str]) -> None:
    """Everything the guest's tools need, with the host's files out of reach."""
    nosuid_nodev = MS_NOSUID | MS_NODEV
    try_mount("devpts", "/dev/pts", "devpts", 0, "gid=5,mode=620,ptmxmode=666")
    try_mount("tmpfs", "/dev/shm", "tmpfs", nosuid_nodev, "mode=1777")
    try_mount("mqueue", "/dev/mqueue", "mqueue")
    for link, target in (("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"),
                         ("/dev/stdout", "/proc/self/fd/1"), ("/dev/stderr", "/proc/self/fd/2")):
        if not os.path.lexists(link):
            os.symlink(target, link)

    mount("tmpfs", "/run", "tmpfs", nosuid_nodev, "mode=0755")
    os.makedirs("/run/lab", exist_ok=True)
    os.makedirs("/run/lock", mode=0o1777, exist_ok=True)
    # The kernel tree lives in the host's cache, under /var/cache which gets a tmpfs below: park it in
    # /run and move it back to its own path afterwards.
    kroot = conf.get("kroot", "")
    parked = bool(kroot) and os.path.isdir(kroot) and try_mount(kroot, "/run/lab/kroot", None, MS_BIND)

    for path in ("/tmp", "/var/tmp"):
        mount("tmpfs", path, "tmpfs", nosuid_nodev, "mode=1777")
    for path in ("/var/log", "/var/cache", "/var/lib", "/root"):
        mount("tmpfs", path, "tmpfs", 0, "mode=0755")
    for path in ("/var/lib/systemd", "/var/lib/dbus", "/var/lib/misc"):
        os.makedirs(path, exist_ok=True)

    try_mount("bpf", "/sys/fs/bpf", "bpf", 0, "mode=0700")
    try_mount("tracefs", "/sys/kernel/tracing", "tracefs")
    try_mount("debugfs", "/sys/kernel/debug", "debugfs")
    try_mount("cgroup2", "/sys/fs/cgroup", "cgroup2", 0, "nsdelegate")
    if os.path.isdir("/sys/kernel/config"):
        try_mount("configfs", "/sys/kernel/config", "configfs")

    if parked:
        os.makedirs(kroot, exist_ok=True)
        mount("/run/lab/kroot", kroot, None, MS_MOVE)
        mount("none", kroot, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        if os.path.isdir("/usr/lib/modules"):
            # The package's own links are relative to its unpack folder: resolve them there.
            release = os.uname().release
            mount("tmpfs", "/usr/lib/modules", "tmpfs", 0, "mode=0755")
            os.makedirs(f"/usr/lib/modules/{release}")
            for link in ("build", "source"):
                target = os.path.realpath(f"{kroot}/usr/lib/modules/{release}/{link}")
                if os.path.isdir(target):
                    os.symlink(target, f"/usr/lib/modules/{release}/{link}")

    # Without the repository the guest agent cannot start: the harness then reports the boot failed, with
    # this console's mount error in its message.
    repo_mounted = bool(conf.get("repo")) and try_mount("repo", conf["repo"], "virtiofs", MS_RDONLY)
    if repo_mounted and conf.get("python"):
        guest_venv(conf["repo"], conf["python"])
    if conf.get("scratch"):
        try_mount("scratch", conf["scratch"], "virtiofs")

    socket.sethostname("gthulhu-lab")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING))
    # Info-level kernel messages on the console (the boot itself ran `quiet`): sched_ext says there why
    # it ejected a scheduler, and the harness keeps the console.
    with open("/proc/sys/kernel/printk", "w") as f:
        f.write("7")  # console_loglevel 7: levels 0-6 (KERN_INFO included) reach the console


def guest_venv(repo: str, python: str) -> None:
    """`{repo}/.venv` as the x86 guest has it, on the guest's own interpreter: bin/python (what every lab
    script and the zygote run), the console script, and a .pth making the repository importable as the
    editable install does. The agent's dependencies are in the root's system site-packages."""
    venv = f"{repo}/.venv"
    if not os.path.isdir(venv):  # a mount point is needed, and the share is read-only
        raise RuntimeError(f"{venv} is missing: run `make build` in the repository first")
    mount("tmpfs", venv, "tmpfs", 0, "mode=0755")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    site = f"{venv}/lib/python{version}/site-packages"
    os.makedirs(f"{venv}/bin")
    os.makedirs(site)
    with open(f"{venv}/pyvenv.cfg", "w") as f:
        f.write(f"home = {os.path.dirname(python)}\ninclude-system-site-packages = true\n"
                f"version = {version}\n")
    os.symlink(python, f"{venv}/bin/python")
    os.symlink("python", f"{venv}/bin/python3")
    with open(f"{site}/gthulhu-node-repo.pth", "w") as f:
        f.write(repo + "\n")
    script = f"{venv}/bin/gthulhu-node"
    with open(script, "w") as f:
        f.write(f"#!{venv}/bin/python\nimport sys\nfrom gthulhu_node.cli import main\nsys.exit(main())\n")
    os.chmod(script, 0o755)


def prepare_systemd(repo: str) -> None:
    """A writable /etc/systemd/system (a tmpfs holding a copy of the host's: overlayfs is a module this
    kernel lacks), the agent's unit, and masks for what fails or only slows the boot here."""
    units = "/etc/systemd/system"
    os.makedirs("/run/lab/units")
    mount("tmpfs", "/run/lab/units", "tmpfs", 0, "mode=0755")
    _copy_tree(units, "/run/lab/units")
    mount("/run/lab/units", units, None, MS_MOVE)
    with open(f"{units}/{AGENT_UNIT}", "w") as f:
        f.write(
            "[Unit]\n"
            "Description=gthulhu lab guest agent (runs the harness's commands)\n"
            "DefaultDependencies=no\n"
            "[Service]\n"
            f"ExecStart=/usr/bin/python3 -S {repo}/tests/vm/guest_agent.py\n"
            "Restart=always\nRestartSec=1\nKillMode=process\n"
            "StandardOutput=journal+console\nStandardError=journal+console\n"
            "[Install]\nWantedBy=sysinit.target\n"
        )
    os.makedirs(f"{units}/sysinit.target.wants", exist_ok=True)
    os.symlink(f"{units}/{AGENT_UNIT}", f"{units}/sysinit.target.wants/{AGENT_UNIT}")
    for unit in MASKED:
        path = f"{units}/{unit}"
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink("/dev/null", path)
    # Generators (fstab, getty, sysv, cryptsetup, ...) have nothing to find here, and each costs an exec:
    # mask them in /run's generator folder, which systemd searches first.
    generators = "/run/systemd/system-generators"
    os.makedirs(generators, exist_ok=True)
    for folder in ("/usr/lib/systemd/system-generators", "/usr/local/lib/systemd/system-generators"):
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            if name != "systemd-debug-generator" and not os.path.lexists(f"{generators}/{name}"):
                os.symlink("/dev/null", f"{generators}/{name}")


def _copy_tree(src: str, dst: str) -> None:
    """cp -a for a folder of unit files and symlinks."""
    for entry in os.scandir(src):
        target = os.path.join(dst, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir():
            os.makedirs(target, exist_ok=True)
            _copy_tree(entry.path, target)
        else:
            with open(entry.path, "rb") as a, open(target, "wb") as b:
                b.write(a.read())


def run_agent(repo: str) -> None:
    sys.path.insert(0, f"{repo}/tests/vm")
    import guest_agent  # type: ignore[import-not-found]

    os._exit(guest_agent.main())


def run_shell(conf: dict[str, str]) -> None:
    os.setsid()
    # the session's first tty becomes its controlling terminal
    fd = os.open(f"/dev/{conf.get('console', 'ttyS0')}", os.O_RDWR)
    fcntl.ioctl(fd, termios.TIOCSCTTY, 0)
    if conf.get("rows") and conf.get("cols"):
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", int(conf["rows"]), int(conf["cols"]), 0, 0))
    for std in (0, 1, 2):
        os.dup2(fd, std)
    os.chdir(conf.get("repo") or "/")
    with open("/sys/kernel/sched_ext/state") as f:
        state = f.read().strip()
    print(f"gthulhu lab: kernel {os.uname().release}, sched_ext {state}. The root is the host's / "
          "(read-only); /tmp, /root and /var/* are tmpfs. Leave with `exit` (or Ctrl-A X).", flush=True)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
           "TERM": conf.get("term", "linux"), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    os.execve("/bin/bash", ["-bash"], env)


def supervise(child: int) -> int:
    """Reap every orphan (PID 1's duty) until the given child exits; return its status."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        if pid == child:
            return os.waitstatus_to_exitcode(status)


def poweroff() -> None:
    os.sync()
    with open("/proc/sysrq-trigger", "w") as f:
        f.write("o")
    time.sleep(60)


def main() -> None:
    os.environ.update(PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", LANG="C.UTF-8")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if not mounted("/dev"):
        mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755")
    console = os.open("/dev/console", os.O_RDWR | os.O_NOCTTY)
    for std in (0, 1, 2):
        os.dup2(console, std)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    try:
        conf = cmdline()
        mode = conf.get("mode", "agent")
        setup(conf)
        with open("/proc/uptime") as f:
            say(f"mounts ready at uptime {f.read().split()[0]} s, mode={mode}")
        if mode == "systemd":
            prepare_systemd(conf.get("repo", ""))
            # An empty $container tells systemd this is a VM, although the host's / has a /.dockerenv.
            os.execve("/lib/systemd/systemd", ["/lib/systemd/systemd"], {"container": ""})
        child = os.fork()
        if child == 0:
            try:
                if mode == "shell":
                    run_shell(conf)
                else:
                    run_agent(conf.get("repo", ""))
            finally:
                os._exit(127)
        say(f"{mode} exited with status {supervise(child)}")
    except BaseException:
        traceback.print_exc()
    poweroff()


if __name__ == "__main__":
    main()
