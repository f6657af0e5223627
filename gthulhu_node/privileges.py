"""The agent gives up CAP_SYS_ADMIN when it starts, after the one step that needs it.

What needs what (docs/service.md, measured; kernel/bpf/syscall.c): loading the struct_ops scheduler and
writing its maps needs CAP_BPF (map creation, program load) and CAP_PERFMON (a struct_ops program is a
tracing-class program); sched_ext itself checks no capability when the ops register. Only taking over a
scheduler that an agent killed with SIGKILL left attached needs CAP_SYS_ADMIN: its map is found by id
(BPF_MAP_GET_NEXT_ID, BPF_MAP_GET_FD_BY_ID), which the kernel allows to CAP_SYS_ADMIN alone. The EEVDF backend
needs CAP_SYS_NICE, the dry run nothing.

So `release` takes over a stale scheduler first, then drops CAP_SYS_ADMIN. It runs before the service
starts its first thread, because capabilities are per thread (gthulhu_node/capabilities.py): every thread
started later inherits the reduced sets. A reload after the kernel ejected the scheduler works without it:
the engine detaches the ejected instance through the map descriptor it holds and loads a fresh one, which
needs CAP_BPF and CAP_PERFMON only. What is lost: a stale scheduler that appears while the agent runs
(another agent's, killed) cannot be taken over until the agent restarts; the load then fails and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from gthulhu_node import capabilities
from gthulhu_node.config import AgentConfig

log = structlog.get_logger(__name__)

DROPPED_AT_START = (capabilities.CAP_SYS_ADMIN,)
HELD_NAMES_SHOWN = 8


@dataclass(frozen=True, slots=True)
class Released:
    """What `release` did, for the log and `gthulhu-node status`."""

    dropped: tuple[str, ...]
    bounding: bool
    effective: tuple[str, ...]
    stale_detached: int = 0
    error: str = ""

    def describe(self) -> str:
        """One line: what was dropped, from which sets, and what the agent still holds."""
        wanted = " ".join(capabilities.names(capabilities.mask(DROPPED_AT_START)))
        if self.error:
            return f"{wanted} not dropped: {self.error}"
        if not self.dropped:
            return f"{wanted} was not held"
        sets = ("every set" if self.bounding
                else "effective/permitted/inheritable; bounding set kept: no CAP_SETPCAP")
        held = (" ".join(self.effective) if len(self.effective) <= HELD_NAMES_SHOWN
                else f"{len(self.effective)} capabilities")
        return f"{' '.join(self.dropped)} dropped at start, in every thread ({sets}); holds {held or 'none'}"


def take_over_stale(config: AgentConfig) -> int:
    """Detach a scheduler of ours that a killed agent left attached, while CAP_SYS_ADMIN is still held.
    Only for the backends that load it (auto, sched_ext); a failure is logged and left to the load, which
    reports it as the start's error."""
    if config.backend.kind not in ("auto", "sched_ext"):
        return 0
    try:
        from gthulhu_node.scheduler import loader

        return loader.take_over_stale()
    except Exception as exc:
        log.warning("scheduler_takeover_failed", error=str(exc))
        return 0


def release(config: AgentConfig) -> Released:
    """Take over a stale scheduler, then drop CAP_SYS_ADMIN from the process. Call it before any other
    thread exists; a drop that cannot be made is logged as an error and the agent runs on (it then still
    holds CAP_SYS_ADMIN, which status shows)."""
    stale = take_over_stale(config)
    try:
        done = capabilities.drop(DROPPED_AT_START)
    except (capabilities.DropRefused, OSError) as exc:
        log.error("capabilities_not_dropped", capabilities=" ".join(capabilities.names(
            capabilities.mask(DROPPED_AT_START))), error=str(exc))
        return Released((), False, (), stale, error=str(exc))
    released = Released(
        dropped=capabilities.names(done.dropped),
        bounding=bool(done.bounding),
        effective=capabilities.names(done.after.effective),
        stale_detached=stale,
    )
    log.info("capabilities_dropped", dropped=" ".join(released.dropped) or "none",
             bounding=" ".join(capabilities.names(done.bounding)) or "none",
             effective=" ".join(released.effective) or "none",
             why="only taking over a stale scheduler needs CAP_SYS_ADMIN; reloads need CAP_BPF CAP_PERFMON")
    return released
