"""The Agent: composes backend, reconciler (inside the engine), intent store, local policy files, status
and the gRPC API into one thing a service can start, reload and stop.

Order matters, and it is why this class exists:
1. the backend is selected and started (the scheduler loaded),
2. the last accepted intents are loaded from the state directory and the local policy files are read,
   and the resulting policy is handed to the reconciler and applied,
3. only then are the gRPC API (and, through `store`, the REST push) open to traffic, and the agent is
   ready: the service sends READY=1 after `start()` returns.

Other parts feed intents through `agent.store` (`IntentStore.apply(source, generation, intents,
allow_reserved=True)` for the `manager` source): the agent listens to the store and hands every change to
the reconciler, then recomputes per-intent status.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import structlog

from gthulhu_node.config import AgentConfig
from gthulhu_node.intents.status import MatchRow, StatusBoard, StatusSnapshot
from gthulhu_node.intents.store import IntentStore, StoreStats

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class AgentStats:
    """What metrics read at scrape time (plain values; metrics.py owns the Prometheus names)."""

    ready: bool = False
    store: StoreStats = field(default_factory=StoreStats)
    # per state ("pending", "applied", ...) -> number of intents
    intents_by_state: dict[str, int] = field(default_factory=dict)
    matched_tasks: int = 0
    local_files: int = 0
    local_file_errors: int = 0
    local_reloads: int = 0
    api_requests: dict[str, int] = field(default_factory=dict)  # per method
    api_errors: dict[str, int] = field(default_factory=dict)  # per gRPC status code name
    watch_streams: int = 0


class Agent:
    """One gthulhu-node agent. Not started by the constructor; see the module docstring for the order."""

    def __init__(self, config: AgentConfig, *, backend: Any = None) -> None:
        """`backend` overrides the configured selection (tests); otherwise select_backend(config)."""
        self.config = config
        self.store = IntentStore(
            config.state.directory,
            max_intents_per_source=config.api.max_intents_per_source,
            max_sources=config.api.max_sources,
        )
        self.board = StatusBoard()
        self._backend_override = backend
        self._ready = threading.Event()
        self._stopped = threading.Event()

    @property
    def ready(self) -> bool:
        """True between the end of start() and the beginning of stop()."""
        return self._ready.is_set()

    def start(self) -> None:
        """Start backend, engine, saved intents, local files, API (in that order). Raises on failure,
        after undoing what was started."""
        raise NotImplementedError  # filled in with the reconciler/engine (issue 4)

    def stop(self) -> None:
        """Stop the API (ending watch streams), the file watcher, the engine, then the backend."""
        self._ready.clear()
        self._stopped.set()
        self.board.close()

    def reload(self) -> None:
        """SIGHUP: re-read the local policy files now (the config itself is not reloaded)."""

    def summary(self) -> str:
        """One line for systemd's STATUS=: readiness, backend, intents applied and tasks matched."""
        return "starting" if not self.ready else "ready"

    def status(self, source: str = "") -> StatusSnapshot:
        """Per-intent status (of one source, or all) and the agent summary."""
        raise NotImplementedError

    def matches(self, intent: str = "") -> list[MatchRow]:
        """The tasks intents govern right now (of one `source/id`, or all)."""
        raise NotImplementedError

    def stats(self) -> AgentStats:
        """Counters for metrics."""
        return AgentStats(ready=self.ready, store=self.store.stats())

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)
