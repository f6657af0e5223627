"""Choosing the backend: `auto` takes the best one this kernel can run, or the configured kind is forced.

auto, in order:
  1. sched_ext, when the kernel has it (/sys/kernel/sched_ext exists); if the kernel then refuses our
     scheduler (an unknown kernel, a verifier change, a missing kfunc), the agent falls back to 2 or 3
     (`fallback_after_refusal`) and says so loudly;
  2. kernels without sched_ext: the EEVDF backend (sched_setattr), when a probe shows slice requests work
     (6.12+) and we may lower nice values;
  3. the dry run, which changes nothing and says so.
The reason string says which one was chosen and why; status, logs and metrics show it.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from gthulhu_node.backends.base import Backend, BackendUnavailable
from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.config import AgentConfig, BackendKind

log = structlog.get_logger(__name__)

SCHED_EXT_SYSFS = Path("/sys/kernel/sched_ext")


def kernel_has_sched_ext(sysfs: Path = SCHED_EXT_SYSFS) -> bool:
    return sysfs.is_dir()


def _sched_ext(config: AgentConfig) -> Backend:
    # Imported lazily: the scheduler package needs libbpf and the built BPF object, which hosts without
    # sched_ext do not need.
    from gthulhu_node.scheduler.backend import SchedExtBackend

    backend: Backend = SchedExtBackend(config.scheduler, proc=config.watch.proc_root)
    return backend


def _dry_run(config: AgentConfig) -> Backend:
    """The dry run holds as many entries as the scheduler's maps would (scheduler.map_capacity), so what
    it reports (map use against capacity, map-full failures) is what the real scheduler would report."""
    return DryRunBackend(record=config.backend.dry_run_record, capacity=config.scheduler.map_capacity)


def _auto_without_sched_ext(config: AgentConfig, why: str) -> tuple[Backend, str]:
    """The EEVDF backend when a probe on a throwaway thread of our own shows the kernel honours slice
    requests and nice changes (6.12+, root); else the dry run, with the probe's answer in the reason.
    `why` says why sched_ext is out."""
    from gthulhu_node.backends import eevdf, sched_attr

    found = sched_attr.probe()
    if found.ok:
        backend: Backend = eevdf.EevdfBackend(
            proc_root=config.watch.proc_root,
            probed=found,
            journal=config.state.directory / eevdf.JOURNAL_NAME,
            engine_slice_ns=eevdf.ENGINE_SLICE_NS,
        )
        return backend, f"auto: {why}; eevdf: {found.reason}"
    log.info("eevdf_unavailable", reason=found.reason)
    return (
        _dry_run(config),
        f"auto: {why} and eevdf is unavailable ({found.reason}); dry run, scheduling is not changed",
    )


def fallback_after_ejections(config: AgentConfig, why: str) -> tuple[Backend, str]:
    """What runs once the kernel ejected our scheduler too often (scheduler.ejection_limit): the next best
    backend, whatever backend.kind asked for, since reloading again would only be ejected again."""
    return _auto_without_sched_ext(config, f"the sched_ext scheduler was given up: {why}")


def fallback_after_refusal(config: AgentConfig, refusal: str) -> tuple[Backend, str]:
    """What `auto` runs when the kernel refused our sched_ext scheduler: the next best backend, with the
    refusal in the reason (status, logs and the backend info metric show it)."""
    return _auto_without_sched_ext(config, f"the kernel refused the sched_ext scheduler ({refusal})")


def select_backend(config: AgentConfig, sysfs: Path = SCHED_EXT_SYSFS) -> tuple[Backend, str]:
    """Return (backend, reason) for an AgentConfig. The backend is not started yet.

    Raises BackendUnavailable when a forced kind cannot be built here.
    """
    kind: BackendKind = config.backend.kind  # validated by the config: no other value reaches here
    if kind == "dry-run":
        return _dry_run(config), "dry run forced by configuration (backend.kind: dry-run)"
    if kind == "sched_ext":
        if not kernel_has_sched_ext(sysfs):
            raise BackendUnavailable(f"backend.kind is sched_ext but this kernel has no {sysfs}")
        return _sched_ext(config), "sched_ext forced by configuration"
    if kind == "eevdf":
        from gthulhu_node.backends import eevdf  # pure Python: nothing it imports is optional

        backend: Backend = eevdf.EevdfBackend(
            proc_root=config.watch.proc_root,
            journal=config.state.directory / eevdf.JOURNAL_NAME,
            engine_slice_ns=eevdf.ENGINE_SLICE_NS,
        )
        return backend, "eevdf forced by configuration"
    if kernel_has_sched_ext(sysfs):
        return _sched_ext(config), f"auto: the kernel has sched_ext ({sysfs} exists)"
    return _auto_without_sched_ext(config, f"the kernel has no sched_ext ({sysfs} is missing)")
