"""`GET /api/v1/pods/pids`: the pods running on this node and their processes, as upstream's answers it.

The Manager's UI shows this list (which processes a pod has, to write a pattern against). Upstream scans
every /proc/<pid>/cgroup for a kubepods path (Gthulhu/Gthulhu@c969a96b,
api/decisionmaker/rest/pod_handler.go, service/service.go FindPodInfoFrom); so do we, with the same pod
UID rule the matcher uses (matching.pod_uid_of), so the UI and the matcher agree on who is in which pod.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from gthulhu_node.matching import pod_uid_of
from gthulhu_node.tasks.procfs import decode_comm

# a container's id in its cgroup leaf: cri-containerd-<64 hex>.scope, docker-<id>.scope, crio-<id>.scope,
# or a bare 64-hex directory (cgroupfs driver)
_CONTAINER = re.compile(r"(?:^|[-/])([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True, slots=True)
class PodProcess:
    pid: int
    command: str
    ppid: int
    container_id: str


@dataclass(slots=True)
class PodInfo:
    pod_uid: str
    processes: list[PodProcess] = field(default_factory=list)


def dashed_uid(normalized: str) -> str:
    """The UID as Kubernetes writes it (8-4-4-4-12), from the matcher's dash-less form."""
    h = normalized
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" if len(h) == 32 else h


def _read(path: Path, limit: int = 8192) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None  # the process exited meanwhile (or is not ours to read): not a pod process then


def _process(proc_root: Path, pid: int, cgroup: str) -> PodProcess | None:
    stat = _read(proc_root / str(pid) / "stat", 1024)
    if stat is None or ")" not in stat:
        return None
    comm_raw = _read(proc_root / str(pid) / "comm", 64)
    command = decode_comm((comm_raw or "").rstrip("\n").encode())
    after = stat[stat.rfind(")") + 2:].split()
    ppid = int(after[1]) if len(after) > 1 and after[1].isdigit() else 0
    leaf = cgroup.strip().splitlines()[-1].rsplit("/", 1)[-1] if cgroup.strip() else ""
    found = _CONTAINER.search(leaf)
    return PodProcess(pid, command, ppid, found.group(1) if found else "")


def pods_on_node(proc_root: Path = Path("/proc")) -> list[PodInfo]:
    """Every pod with at least one process on this node, processes in pid order, pods by UID."""
    pods: dict[str, PodInfo] = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return []
    for name in sorted((n for n in names if n.isdigit()), key=int):
        cgroup = _read(proc_root / name / "cgroup")
        uid = pod_uid_of(cgroup) if cgroup else None
        if uid is None or cgroup is None:
            continue
        process = _process(proc_root, int(name), cgroup)
        if process is not None:
            pods.setdefault(uid, PodInfo(dashed_uid(uid))).processes.append(process)
    return [pods[k] for k in sorted(pods)]
