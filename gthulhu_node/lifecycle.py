"""One lifecycle for every long-lived part: start, stop, health; and one supervisor that runs them in order.

Why: the start order is what makes the agent correct (the scheduler is loaded before the engine writes to
it, the saved intents are in the reconciler before its first scan, the API opens only then), and the stop
order is its reverse. Written out by hand in two places it drifted; here it is one list of components
(`Service._components`, which takes the agent's part from `Agent.components`), started by one
`Supervisor`. A part that fails to start is named, what was started before it is stopped in reverse, and
the original exception goes on up (with a note naming the part), so callers still see its type.

Imports nothing of ours (layer 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Health:
    """A part's own view of itself: `ok` False with the reason when it runs degraded or not at all."""

    ok: bool
    detail: str = ""


class Component(Protocol):
    """What the supervisor runs. `stop` must be safe to call once after a `start` that raised."""

    @property
    def name(self) -> str: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def health(self) -> Health: ...


C = TypeVar("C", bound=Component)


@dataclass(slots=True)
class Step:
    """A component made of functions: for a part created at start (the engine needs the policy built
    from the intents loaded just before it) or a start that is a step rather than an object."""

    name: str
    on_start: Callable[[], None]
    on_stop: Callable[[], None] = lambda: None
    on_health: Callable[[], Health] = lambda: Health(True)

    def start(self) -> None:
        self.on_start()

    def stop(self) -> None:
        self.on_stop()

    def health(self) -> Health:
        return self.on_health()


class Created(Generic[C]):
    """A component made when its turn to start comes, from what the parts before it made (the API
    serves the agent only once the engine runs); stop and health go to it once it exists."""

    def __init__(self, name: str, create: Callable[[], C]) -> None:
        self.name = name
        self._create = create
        self.part: C | None = None

    def start(self) -> None:
        self.part = self._create()
        self.part.start()

    def stop(self) -> None:
        if self.part is not None:
            self.part.stop()

    def health(self) -> Health:
        return self.part.health() if self.part is not None else Health(False, "not created")


@dataclass(frozen=True, slots=True)
class StopFailure:
    name: str
    error: BaseException


class Supervisor:
    """Starts components in the given order and stops the started ones in reverse. Not thread-safe:
    one thread starts, one thread stops (the service's start worker and its main thread, in turn)."""

    def __init__(self, components: Sequence[Component]) -> None:
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"component names must be unique: {names}")
        self.components = list(components)
        self._started: list[Component] = []
        self.failed = ""  # the name of the component whose start raised, if one did

    @property
    def started(self) -> list[str]:
        return [c.name for c in self._started]

    def start(self) -> None:
        """Each component in order. On a failure: stop the started ones in reverse, re-raise (noted)."""
        for component in self.components:
            log.debug("component_starting", component=component.name)
            try:
                component.start()
            except BaseException as exc:
                self.failed = component.name
                log.error("component_start_failed", component=component.name, error=str(exc))
                exc.add_note(f"while starting {component.name}")
                # a part that raised half-way may hold threads or sockets: it is stopped too
                self._started.append(component)
                self.stop()
                raise
            self._started.append(component)

    def stop(self) -> list[StopFailure]:
        """Every started component in reverse order; one that raises does not keep the rest running."""
        failures: list[StopFailure] = []
        while self._started:
            component = self._started.pop()
            try:
                component.stop()
            except Exception as exc:
                log.error("component_stop_failed", component=component.name, error=str(exc), exc_info=True)
                failures.append(StopFailure(component.name, exc))
        return failures

    def health(self) -> dict[str, Health]:
        """Each started component's health, by name."""
        out: dict[str, Health] = {}
        for component in self._started:
            try:
                out[component.name] = component.health()
            except Exception as exc:
                out[component.name] = Health(False, f"health check failed: {exc}")
        return out
