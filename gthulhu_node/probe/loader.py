"""The probe's BPF side through BCC: compile, attach, keep the target map, read the histograms back.

BCC writes compiler diagnostics straight to file descriptor 2 from C++, so the compile runs with fd 2
pointed at a temporary file: success stays quiet (the kernel headers raise dozens of harmless warnings) and
a failure becomes one line: the missing-headers message when that is the cause, else the first error.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import os
import sys
import tempfile
from importlib import resources
from typing import Any

import structlog

from gthulhu_node.probe import preflight
from gthulhu_node.probe.histogram import NSLOTS, WaitHistogram, histograms_from_slots

log = structlog.get_logger(__name__)

MAX_TARGETS = 4096
MAX_INTENTS = 256
_HEADER_ERRORS = ("Unable to find kernel headers", "kconfig.h' file not found")


def program_text() -> str:
    """The C source shipped with the package."""
    return resources.files("gthulhu_node.probe").joinpath("runqwait.bpf.c").read_text()


def _first_error(diagnostics: str) -> str:
    for line in diagnostics.splitlines():
        if "error:" in line:
            return line.strip()
    lines = [line.strip() for line in diagnostics.splitlines() if line.strip()]
    return lines[-1] if lines else "no diagnostics"


class _StderrCapture:
    """Point fd 2 at a temporary file for the duration of a `with` block; `.text` holds what was written."""

    def __enter__(self) -> _StderrCapture:
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        self.text = ""
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode("utf-8", "replace")
        self._file.close()


class RunqueueProbe:
    """The loaded, attached BPF program. Not thread-safe: one owner calls its methods.

    `per_thread`: also keep a histogram and totals per thread (the CLI's per-thread table); the continuous
    agent mode turns it off, since it needs only the per-intent histograms and exited threads would
    otherwise accumulate entries.
    """

    def __init__(self, per_thread: bool = True, max_targets: int = MAX_TARGETS) -> None:
        bcc = preflight.check()
        cflags = [f"-DNSLOTS={NSLOTS}", f"-DMAX_TARGETS={max_targets}", f"-DMAX_INTENTS={MAX_INTENTS}"]
        if per_thread:
            cflags.append("-DTHREAD_HIST")
        self.per_thread = per_thread
        capture = _StderrCapture()
        try:
            with capture:
                self._bpf: Any = bcc.BPF(text=program_text(), cflags=cflags)
        except Exception as exc:
            diagnostics = capture.text
            log.debug("probe_compile_failed", error=str(exc), diagnostics=diagnostics[-4000:])
            if any(marker in diagnostics for marker in _HEADER_ERRORS):
                raise preflight.ProbeUnavailable(preflight.no_headers_message(os.uname().release)) from None
            if "Failed to attach" in str(exc):
                raise preflight.ProbeUnavailable(
                    f"gthulhu-node probe: {exc} (raw tracepoints need CAP_BPF and CAP_PERFMON, and a "
                    "kernel with sched_wakeup/sched_switch raw tracepoints)"
                ) from None
            raise preflight.ProbeUnavailable(
                f"gthulhu-node probe: the BPF program did not compile or load: {_first_error(diagnostics)}"
            ) from None
        self._targets = self._bpf["targets"]
        self.map_full_errors = 0

    def close(self) -> None:
        """Detach and free everything (also done by the kernel when the process exits)."""
        bpf, self._bpf = self._bpf, None
        if bpf is not None:
            bpf.cleanup()

    def __enter__(self) -> RunqueueProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the target map: tid -> intent index -------------------------------------------------------

    def add_target(self, tid: int, intent: int) -> bool:
        """Measure `tid` from now on for intent index `intent`; False when the map is full."""
        try:
            self._targets[ct.c_uint32(tid)] = ct.c_uint32(intent)
        except Exception as exc:  # BCC raises a bare Exception carrying the errno text
            self.map_full_errors += 1
            log.warning("probe_target_map_full", tid=tid, error=str(exc), capacity=self._targets.max_entries)
            return False
        return True

    def remove_target(self, tid: int) -> None:
        """Stop measuring `tid` (it exited or no longer matches); its pending wait is dropped too."""
        for name in ("targets", "wait_start"):
            with contextlib.suppress(KeyError):
                del self._bpf[name][ct.c_uint32(tid)]

    def target_tids(self) -> dict[int, int]:
        """The map as the kernel holds it now (tid -> intent index)."""
        return {k.value: v.value for k, v in self._targets.items()}

    # --- results -------------------------------------------------------------------------------------

    def _totals(self, name: str) -> dict[int, tuple[int, int, int]]:
        return {k.value: (v.sum_ns, v.count, v.max_ns) for k, v in self._bpf[name].items()}

    def intent_histograms(self) -> dict[int, WaitHistogram]:
        rows = ((k.intent, k.slot, v.value) for k, v in self._bpf["intent_hist"].items())
        return histograms_from_slots(rows, self._totals("intent_total"))

    def thread_histograms(self) -> dict[int, WaitHistogram]:
        if not self.per_thread:
            return {}
        rows = ((k.tid, k.slot, v.value) for k, v in self._bpf["thread_hist"].items())
        return histograms_from_slots(rows, self._totals("thread_total"))

    def clear_intent(self, intent: int) -> None:
        """Forget an intent index's histogram before the index is given to another intent."""
        for slot in range(NSLOTS):
            with contextlib.suppress(KeyError):
                del self._bpf["intent_hist"][self._bpf["intent_hist"].Key(intent, slot)]
        with contextlib.suppress(KeyError):
            del self._bpf["intent_total"][ct.c_uint32(intent)]
