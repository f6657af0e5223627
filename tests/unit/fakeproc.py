"""A small /proc tree on disk for unit tests: the reconciler and scanner read it with their real code."""

from __future__ import annotations

import shutil
from pathlib import Path


class FakeProc:
    """Writes `<root>/<tgid>/task/<tid>/stat` files in the kernel's format."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def stat_line(self, tid: int, comm: str, start_time: int) -> str:
        # 52 fields like the kernel's; field 22 is the start time.
        fields = ["S", "1", *["0"] * 17, str(start_time), *["0"] * 30]
        return f"{tid} ({comm}) {' '.join(fields)}\n"

    def add(self, tgid: int, tid: int, comm: str, start_time: int = 100) -> None:
        d = self.root / str(tgid) / "task" / str(tid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "stat").write_text(self.stat_line(tid, comm, start_time))

    def rename(self, tgid: int, tid: int, comm: str) -> None:
        path = self.root / str(tgid) / "task" / str(tid) / "stat"
        start = int(path.read_text().rsplit(")", 1)[1].split()[19])
        path.write_text(self.stat_line(tid, comm, start))

    def remove(self, tgid: int, tid: int | None = None) -> None:
        if tid is None:
            shutil.rmtree(self.root / str(tgid))
        else:
            shutil.rmtree(self.root / str(tgid) / "task" / str(tid))

    def set_cgroup(self, tgid: int, text: str) -> None:
        (self.root / str(tgid) / "cgroup").write_text(text)

    def set_owner(self, tgid: int, uid: int, exe: str = "", cgroup: str = "0::/\n") -> None:
        """The process's real (and effective) uid in `status`, its `exe` link and its `cgroup`."""
        d = self.root / str(tgid)
        (d / "status").write_text(f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t0\t0\t0\t0\n")
        if exe:
            (d / "exe").symlink_to(exe)
        self.set_cgroup(tgid, cgroup)
