"""The REST listener's counters, kept by the routes and the listener and read by metrics.py's collector."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RestStats:
    """Counters for metrics (metrics.py names them)."""

    insecure: bool = False
    requests: dict[str, int] = field(default_factory=dict)  # per status code
    tokens_issued: int = 0
    tokens_refused: int = 0
    auth_refused: int = 0
    pushes_accepted: int = 0
    pushes_refused: int = 0
    deletes: int = 0
    # the listener's (rest/listener.py), copied in by RestServer.stats()
    connections_refused: int = 0
    connections_evicted: int = 0
    connections_held: int = 0
    handshakes_failed: int = 0
    accept_errors: int = 0
    plain_http_refused: int = 0  # plain HTTP requests answered with a 400 on the TLS port
    node_name_mismatches: int = 0  # held Manager entries whose nodeID is not this node's name (now)
    entries_failed: int = 0  # pushed entries accepted but not honoured (failed), per changed push
    node_policies_expired: int = 0  # held node policies dropped (IntentRoutes._pod_contact)
    pod_intents_forgotten: int = 0  # pod intents of a state file without their pushed entries
