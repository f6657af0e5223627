"""The policy builder: the store's intents for this node compiled into a PolicySet on a thread of its own
(`policy-builder`) and handed to the engine, and the policy in effect once the reconciler settled it.

Why a thread: compiling the patterns (tens of milliseconds per thousand, more under load; 70 ms for
10,000 new patterns on a quiet host) is work neither the writer of a change (a REST or gRPC handler, the
policy-file poller: they return once the change is stored) nor the engine thread (it feeds the watchdog
and handles events) may do. Changes that arrive during a build are built once, together (a WorkQueue).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gthulhu_node.config import AgentConfig
from gthulhu_node.engine import Engine
from gthulhu_node.intents.model import Intent, intent_key
from gthulhu_node.intents.source_set import SourceSet
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.matching import PolicySet
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.workers import Flag, WorkerThread, WorkQueue

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Effect:
    """What the reconciler holds: the intents in its policy set, and the error if building failed."""

    intents: dict[str, Intent]
    error: str = ""


class PolicyBuilder:
    """Builds on its own thread, hands over in the order of the store snapshots it read, and keeps the
    policy in effect (`effect`, any thread)."""

    def __init__(self, store: IntentStore, config: Callable[[], AgentConfig],
                 engine: Callable[[], Engine | None], on_effect: Callable[[], None]) -> None:
        self._store = store
        self._config = config
        self._engine = engine
        self._on_effect = on_effect  # the policy in effect changed (status refreshes at once)
        self._effect = Effect({})  # what the reconciler has in effect (settled)
        self._effect_lock = threading.Lock()
        self._submitted = Effect({})  # what was last handed to the engine (the builder's thread only)
        self._builds = WorkQueue()
        self.worker = WorkerThread("policy-builder", self._run)
        self.updates = 0  # policies in effect
        self.errors = 0  # builds that failed

    def effect(self) -> Effect:
        with self._effect_lock:
            return self._effect

    def first(self) -> PolicySet:
        """At start, before the engine's first scan: the policy of everything loaded, in effect at once."""
        effect, policy = self.build()
        self._effect = self._submitted = effect
        return policy

    def start(self) -> None:
        self._builds.open()
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()

    def node_intents(self, sources: dict[str, SourceSet]) -> list[tuple[str, Intent]]:
        node = self._config().node
        return [
            (intent_key(name, i.id), i)
            for name, ss in sorted(sources.items())
            for i in ss.intents
            if i.selects_node(node.name, node.labels)
        ]

    def build(self, wanted: list[tuple[str, Intent]] | None = None) -> tuple[Effect, PolicySet]:
        """The policy of `wanted` (the store's node intents by default), and what it puts in effect."""
        if wanted is None:
            wanted = self.node_intents(self._store.snapshot())
        try:
            named_only = self._config().security.unprivileged_tasks == "named_only"
            return Effect(dict(wanted)), PolicySet.build(wanted, named_only=named_only)
        except ValueError as exc:  # validated intents compile; this is a guard, not a path
            self.errors += 1
            log.error("policy_build_failed", error=str(exc))
            return Effect(dict(wanted), error=str(exc)), PolicySet.empty()

    def store_changed(self, source: str) -> None:
        """Wake the builder: the writer returns once its change is stored, not after compiling the whole
        new policy (the bench's 10,000-policy push went 684 -> 616 ms), and changes that arrive during a
        build are built once, together. `await_handed` waits for the hand-off."""
        engine = self._engine()
        if engine is None or not engine.running:
            return  # during start the policy is built once, after every source is loaded
        self._builds.wake()

    def await_handed(self, timeout: float) -> bool:
        """Wait until every store change made before this call is built and handed to the engine."""
        return self._builds.wait_handled(timeout)

    def _run(self, stop: Flag) -> None:
        self._builds.serve(stop, self._turn)

    def _turn(self) -> None:
        """A turn: build what the store holds now (every change since the last turn, together) and hand
        it over."""
        engine = self._engine()
        try:
            if engine is not None and engine.running:
                self._submit_latest(engine)
        except Exception:  # a failed build must not end the builder: the next change builds again
            self.errors += 1
            log.exception("policy_build_failed")

    def _submit_latest(self, engine: Engine) -> None:
        """Build the store's current policy and hand it to the engine, unless it is what was handed last.
        Only the builder's thread calls this, so the engine receives builds in snapshot order."""
        wanted = self.node_intents(self._store.snapshot())
        if Effect(dict(wanted)) == self._submitted:
            return
        effect, policy = self.build(wanted)
        self._submitted = effect
        engine.submit(lambda r: self._take_policy(r, effect, policy))

    def _take_policy(self, reconciler: Reconciler, effect: Effect, policy: PolicySet) -> None:
        """On the engine thread. Status calls the policy in effect only once the reconciler has rematched
        every task and written (or been refused) every entry, which may take several loop turns."""
        reconciler.set_policy(policy)
        reconciler.when_settled(lambda: self._in_effect(effect))

    def _in_effect(self, effect: Effect) -> None:
        with self._effect_lock:
            self._effect = effect
            self.updates += 1
        self._on_effect()
