"""Self-tests of the lab VM harness (tests/vm/lab.py): what every other VM test relies on."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.bench import benchlab
from tests.vm.lab import REPO, Lab, LabDied, exited

pytestmark = pytest.mark.vm


def test_guest_runs_the_lab_kernel_with_sched_ext_disabled(lab: Lab) -> None:
    r = lab.run("uname -r; cat /sys/kernel/sched_ext/state; hostname").check()
    assert r.stdout.split() == [lab.kernel.version, "disabled", "gthulhu-lab"]


def test_exit_code_and_separate_streams_come_back(lab: Lab) -> None:
    r = lab.run("echo to-out; echo to-err >&2; exit 7")
    assert (r.returncode, r.stdout, r.stderr, r.timed_out) == (7, "to-out\n", "to-err\n", False)


def test_argv_input_env_and_cwd(lab: Lab) -> None:
    assert lab.run(["cat"], input="fed on stdin\n").stdout == "fed on stdin\n"
    assert lab.run(["printenv", "LAB_X"], env={"LAB_X": "a b"}).stdout == "a b\n"
    assert lab.run("pwd").stdout.strip() == str(REPO)
    assert lab.run("pwd", cwd="/tmp").stdout.strip() == "/tmp"
    missing = lab.run(["/no/such/program"])
    assert missing.returncode == 127 and "no/such/program" in missing.stderr


def test_hanging_command_is_cut_at_its_timeout_and_the_guest_serves_on(lab: Lab) -> None:
    r = lab.run("echo before; exec sleep 1000", timeout=20)
    assert r.timed_out and r.returncode == -signal.SIGKILL and r.stdout == "before\n"
    # the whole process group went: no sleep 1000 is left
    assert lab.run("pgrep -x -f 'sleep 1000'").returncode == 1
    assert lab.run("echo next").stdout == "next\n"


def test_background_children_do_not_hold_the_reply(lab: Lab) -> None:
    # The backgrounded sleep inherits the command's stdout/stderr pipes.
    r = lab.run("sleep 120 & echo started", timeout=60)
    assert (r.returncode, r.stdout, r.timed_out) == (0, "started\n", False)
    assert lab.run("pkill -x sleep").returncode == 0


def test_megabytes_of_output(lab: Lab) -> None:
    r = lab.run("head -c 4000000 /dev/zero | tr '\\0' x; head -c 1000000 /dev/zero | tr '\\0' y >&2").check()
    assert len(r.stdout) == 4_000_000 and set(r.stdout) == {"x"}
    assert len(r.stderr) == 1_000_000 and set(r.stderr) == {"y"}


def test_concurrent_commands(lab: Lab) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: lab.run(f"sleep 1; echo {i}"), range(4)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]


def test_the_machine_files_cannot_be_written(lab: Lab) -> None:
    etc_probe = Path("/etc/lab-write-test")
    repo_probe = REPO / "lab-write-test"
    r = lab.run(f"touch {etc_probe}; echo $?; touch {repo_probe}; echo $?; echo x >/usr/lab-probe; echo $?")
    assert r.stdout.split() == ["1", "1", "1"], r.stderr
    assert "Read-only file system" in r.stderr
    # Even a guest that remounts its root read-write cannot write: virtiofsd serves a read-only view.
    r = lab.run(
        f"mount -o remount,rw / && mount -o remount,rw {REPO} && "
        f"{{ touch {etc_probe}; echo $?; touch {repo_probe}; echo $?; }}; "
        f"mount -o remount,ro /; mount -o remount,ro {REPO}"
    )
    assert r.stdout.split() == ["1", "1"], r.stderr
    assert not etc_probe.exists() and not repo_probe.exists()
    # while the guest's own tmpfs places are writable
    assert lab.run("touch /tmp/x /run/x /var/tmp/x /var/log/x /var/lib/x /root/x").returncode == 0


def test_scratch_folder_is_shared_read_write(lab: Lab) -> None:
    assert lab.scratch_guest == lab.scratch_host
    lab.run(f"echo from-guest > {lab.scratch_guest}/out.txt").check()
    assert (lab.scratch_host / "out.txt").read_text() == "from-guest\n"
    (lab.scratch_host / "in.txt").write_text("from-host\n")
    assert lab.run(f"cat {lab.scratch_guest}/in.txt").stdout == "from-host\n"


def test_repo_venv_and_kernel_headers_are_visible(lab: Lab) -> None:
    r = lab.python("-c", "import gthulhu_node, sys; print(gthulhu_node.__file__); print(sys.prefix)").check()
    assert r.stdout.split() == [str(REPO / "gthulhu_node/__init__.py"), str(REPO / ".venv")]
    r = lab.run("cd /lib/modules/$(uname -r) && ls build/include source/include/linux/sched.h")
    assert r.returncode == 0, r.stderr


def test_bcc_compiles_against_the_lab_headers(lab: Lab) -> None:
    code = (
        "from bcc import BPF\n"
        "b = BPF(text='int kprobe__do_nanosleep(void *ctx) { return 0; }')\n"
        "print('loaded', b.num_open_kprobes())\n"
    )
    r = lab.run(["/usr/bin/python3", "-c", code], timeout=300)
    assert (r.returncode, r.stdout) == (0, "loaded 1\n"), r.stderr


def test_bpffs_tracefs_debugfs_and_cgroup2_are_mounted(lab: Lab) -> None:
    mounts = {line.split()[1]: line.split()[2] for line in lab.run("cat /proc/mounts").stdout.splitlines()}
    assert mounts["/sys/fs/bpf"] == "bpf"
    assert mounts["/sys/kernel/tracing"] == "tracefs"
    assert mounts["/sys/kernel/debug"] == "debugfs"
    assert mounts["/sys/fs/cgroup"] == "cgroup2"


def test_kernel_info_messages_reach_the_kept_console(lab: Lab) -> None:
    # sched_ext reports enabling and ejecting a scheduler at info/error level: people need those lines.
    lab.run("echo '<6>lab-console-marker' > /dev/kmsg").check()
    deadline = time.monotonic() + 30  # the console is a slow emulated UART: wait for the line, no speed claim
    while "lab-console-marker" not in lab.console_tail() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "lab-console-marker" in lab.console_tail()
    assert lab.console_log is not None and "lab-console-marker" in lab.console_log.read_text(errors="replace")


def test_a_crashed_guest_is_noticed_and_replaced(lab: Lab) -> None:
    before = lab.boot_id
    with pytest.raises(LabDied) as died:
        lab.run("echo c > /proc/sysrq-trigger", timeout=60)
    assert "sysrq" in died.value.console.lower()  # the kernel's own words come with the error
    assert lab.run("cat /proc/sys/kernel/random/boot_id").stdout.strip() not in ("", before)
    assert lab.boot_id != before


def test_a_benchmark_resumes_in_a_fresh_guest_after_its_guest_dies(lab: Lab) -> None:
    """The scheduling benchmarks run under multi-threaded TCG, whose int3 hazard can kill a guest mid-run
    (docs/lab.md): the runs finished before the death are kept and a fresh guest runs the rest, so the
    result has every run once and says that the guest died."""
    first_boot = lab.boot_id
    progress = lab.scratch_host / "resume_progress.jsonl"

    def crash_after_the_first_run() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if progress.exists() and progress.read_text().count("\n") >= 1:
                with contextlib.suppress(LabDied):
                    lab.run("echo c > /proc/sysrq-trigger", timeout=60)
                return
            time.sleep(0.2)

    crasher = threading.Thread(target=crash_after_the_first_run)
    crasher.start()
    data = benchlab.run_interleaved(lab, "tests/vm/engine_step_bench.py", progress.name, 900,
                                    "--cases", "no contention", seconds=1.0, rounds=3)
    crasher.join()
    assert len(data["guest_deaths"]) == 1, data["guest_deaths"]
    assert lab.boot_id != first_boot
    assert [len(v) for v in data["runs"].values()] == [3], data["runs"]
    assert all(run["steps_per_s"] > 0 for run in data["runs"]["no contention"])


def test_a_hung_guest_is_noticed_and_replaced(lab: Lab) -> None:
    before = lab.boot_id
    qemu = lab.pids()[0]  # qemu is listed first
    grace, ping = lab.reply_grace, lab.ping_timeout
    lab.reply_grace, lab.ping_timeout = 2.0, 3.0
    try:
        os.kill(qemu, signal.SIGSTOP)  # the whole guest freezes, as a wedged kernel would
        with pytest.raises(LabDied, match="hung"):
            lab.run("true", timeout=2)
    finally:
        lab.reply_grace, lab.ping_timeout = grace, ping
    assert lab.run("echo fresh").stdout == "fresh\n"
    assert lab.boot_id != before


_HARNESS = """
import json, sys, time
from tests.vm.lab import Lab
lab = Lab()
lab.start(wait=False)
print(json.dumps({"pids": lab.pids(), "run_dir": str(lab.run_dir)}), flush=True)
time.sleep(600)
"""


def test_no_qemu_or_virtiofsd_outlives_a_killed_harness() -> None:
    harness = subprocess.Popen([sys.executable, "-c", _HARNESS], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert harness.stdout is not None
        info = json.loads(harness.stdout.readline())
    finally:
        harness.kill()
        harness.wait()
    pids = info["pids"]
    assert len(pids) == 4  # qemu and three virtiofs daemons
    deadline = time.monotonic() + 30  # a liveness wait, not a speed requirement
    while not all(exited(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in pids if not exited(p)]
    assert survivors == []
    stray = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if info["run_dir"].encode() in cmdline and not exited(int(entry.name)):
                stray.append(int(entry.name))
    assert stray == []


def test_systemd_boots_and_answers_systemctl_and_journalctl(lab_systemd: Lab) -> None:
    failed = lab_systemd.run("systemctl --failed --no-legend").stdout
    assert lab_systemd.systemd_state == "running", failed
    assert lab_systemd.run("systemctl is-system-running").stdout.strip() == "running"
    assert lab_systemd.run("cat /proc/1/comm").stdout.strip() == "systemd"
    status = lab_systemd.run("systemctl status gthulhu-lab-agent.service")
    assert status.returncode == 0 and "active (running)" in status.stdout
    unit = "lab-selftest.service"
    lab_systemd.run(
        "printf '[Service]\\nType=oneshot\\nExecStart=/bin/echo lab-selftest-ran\\n'"
        f" > /etc/systemd/system/{unit} && systemctl daemon-reload && systemctl start {unit}"
    ).check()
    journal = lab_systemd.run(f"journalctl -u {unit} --no-pager -o cat").check()
    assert "lab-selftest-ran" in journal.stdout
    assert not Path(f"/etc/systemd/system/{unit}").exists()
