"""What the REST listener reports about the node itself: pods/pids, the gthulhu_pod_* metrics and the
runtime-config decisions, on a /proc tree written by the test (the formats are the kernel's)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from gthulhu_node.rest.podmetrics import PodTarget, render
from gthulhu_node.rest.pods import pods_on_node
from gthulhu_node.rest.runtime_config import RuntimeConfig, load_applied, parse_body, take_into_effect
from gthulhu_node.rest.translate import BodyError

UID = "20da609e-6973-4463-a1f9-2db9bcc5becc"
CONTAINER = "10ec3c89629f71226b227e6510b2d465168b24005bbdcc5d7940517080830635"
SYSTEMD_CGROUP = (
    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
    f"{UID.replace('-', '_')}.slice/cri-containerd-{CONTAINER}.scope\n"
)


def process(root: Path, pid: int, comm: str, cgroup: str, ppid: int = 1,
            threads: dict[int, tuple[str, str]] | None = None) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 0 0\n")
    (d / "cgroup").write_text(cgroup)
    for tid, (schedstat, status) in (threads or {}).items():
        t = d / "task" / str(tid)
        t.mkdir(parents=True)
        (t / "schedstat").write_text(schedstat)
        (t / "status").write_text(status)


def test_pods_pids_lists_pod_processes_with_their_container(tmp_path: Path) -> None:
    process(tmp_path, 40, "pause", SYSTEMD_CGROUP)
    process(tmp_path, 41, "python3", SYSTEMD_CGROUP, ppid=40)
    process(tmp_path, 50, "sshd", "0::/system.slice/ssh.service\n")
    (tmp_path / "self").mkdir()
    (pod,) = pods_on_node(tmp_path)
    assert pod.pod_uid == UID
    assert [(p.pid, p.command, p.ppid, p.container_id) for p in pod.processes] == [
        (40, "pause", 1, CONTAINER), (41, "python3", 40, CONTAINER)]


@dataclass(frozen=True)
class Row:
    tid: int
    tgid: int
    intent: str


def test_pod_metrics_sum_governed_tasks_and_leave_out_what_is_not_measured(tmp_path: Path) -> None:
    status = "Name:\tw\nvoluntary_ctxt_switches:\t7\nnonvoluntary_ctxt_switches:\t2\n"
    process(tmp_path, 41, "python3", SYSTEMD_CGROUP,
            threads={41: ("1000 300 4\n", status), 42: ("2000 700 6\n", status)})
    pod = PodTarget("vllm-0", UID, "ml", "node-a")
    rows = [Row(41, 41, "manager-pods/a"), Row(42, 41, "manager-pods/a"), Row(99, 99, "manager-pods/a"),
            Row(42, 41, "local/other")]
    text = render({"manager-pods/a": pod}, rows, tmp_path).decode()
    labels = f'namespace="ml",node_name="node-a",pod_name="vllm-0",pod_uid="{UID}"'
    assert f"gthulhu_pod_wait_time_nanoseconds_total{{{labels}}} 1000.0" in text
    assert f"gthulhu_pod_cpu_time_nanoseconds_total{{{labels}}} 3000.0" in text
    assert f"gthulhu_pod_run_count_total{{{labels}}} 10.0" in text
    assert f"gthulhu_pod_voluntary_ctx_switches_total{{{labels}}} 14.0" in text
    assert f"gthulhu_pod_process_count{{{labels}}} 1.0" in text
    assert f"gthulhu_pod_cpu_migrations_total{{{labels}}}" not in text  # no sched file: absent, never 0
    for tid, moved in ((41, 3), (42, 5)):  # the kernel's /proc/<pid>/task/<tid>/sched format
        (tmp_path / "41" / "task" / str(tid) / "sched").write_text(
            f"w ({tid}, #threads: 2)\n{'-' * 20}\nse.exec_start : 1.5\n"
            f"se.nr_migrations                             :                    {moved}\n")
    text = render({"manager-pods/a": pod}, rows, tmp_path).decode()
    assert f"gthulhu_pod_cpu_migrations_total{{{labels}}} 8.0" in text
    assert "smt_migrations" not in text  # not measured
    assert "pod_name" not in render({"manager-pods/a": pod}, [], tmp_path).decode()  # no task: no series


@pytest.mark.parametrize(
    ("body", "field"),
    [([], "expected a JSON object"), ({"mode": 3}, "mode"), ({"sliceNsDefault": -1}, "sliceNsDefault"),
     ({"sliceNsDefault": 1.5}, "sliceNsDefault"), ({"kernelMode": "yes"}, "kernelMode")],
)
def test_runtime_config_wrong_types_name_the_field(body: object, field: str) -> None:
    with pytest.raises(BodyError, match=field):
        parse_body(body)


def test_runtime_config_applies_only_allowed_changed_values(tmp_path: Path) -> None:
    fields = parse_body({"configVersion": "v1", "mode": "scx", "sliceNsDefault": 20_000_000,
                         "schedulerEnabled": True, "newField": 1})
    assert "newField" not in fields  # a newer Manager's field: ignored as Go ignores it
    closed = RuntimeConfig(tmp_path, frozenset()).apply(fields)
    assert closed.applied == {} and "rest.runtime_config_allow" in closed.not_applicable["sliceNsDefault"]
    assert closed.in_effect  # nothing of it applies here, and nothing waits: the agent runs with it
    # kept across a restart: the Manager sees the config it sent, not `configAvailable: false`
    assert RuntimeConfig(tmp_path, frozenset()).state.received == fields
    config = RuntimeConfig(tmp_path, frozenset({"sliceNsDefault"}))
    state = config.apply(fields)
    assert state.applied == {"sliceNsDefault": 20_000_000} and state.pending_reload == ["sliceNsDefault"]
    assert not state.in_effect  # the truth: the scheduler still runs with the old default slice
    assert set(state.not_applicable) == {"mode", "schedulerEnabled"}
    assert json.loads((tmp_path / "runtime-config.json").read_text())["applied"] == state.applied
    stamp = state.applied_at
    assert config.apply(fields).applied_at == stamp  # the same value again: no change
    refused = config.apply({"sliceNsDefault": 10})
    assert "outside" in refused.not_applicable["sliceNsDefault"] and "outside" in refused.last_error
    assert any("lastError" in n for n in refused.notes())
    config.apply(fields)
    assert load_applied(tmp_path, frozenset({"sliceNsDefault"})) == {"sliceNsDefault": 20_000_000}
    assert load_applied(tmp_path, frozenset()) == {}  # taken off the allowlist: no longer applied
    # the agent's next start loads the scheduler with it: in effect, one restart counted
    assert take_into_effect(tmp_path, frozenset({"sliceNsDefault"})) == {"sliceNsDefault": 20_000_000}
    after = RuntimeConfig(tmp_path, frozenset({"sliceNsDefault"})).state
    assert after.in_effect and after.restart_count == 1 and after.last_error == ""
    take_into_effect(tmp_path, frozenset({"sliceNsDefault"}))  # nothing waited: not counted
    assert RuntimeConfig(tmp_path, frozenset({"sliceNsDefault"})).state.restart_count == 1
    # on the eevdf backend no scheduler of ours has a default slice: not applicable, nothing waits
    eevdf = RuntimeConfig(tmp_path, frozenset({"sliceNsDefault"})).apply({"sliceNsDefault": 30_000_000},
                                                                          backend="eevdf")
    assert "eevdf backend" in eevdf.not_applicable["sliceNsDefault"] and eevdf.in_effect
    assert eevdf.applied == {"sliceNsDefault": 20_000_000} and eevdf.pending_reload == []
