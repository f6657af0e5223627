"""The agent's configuration: one YAML file (default /etc/gthulhu-node/config.yaml), one section per part.

Every setting has a sane default, so an empty file (or none) gives a working agent that listens only on a
root-only unix socket and serves metrics on loopback. Unknown keys are refused: a typo must not silently
fall back to a default.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gthulhu_node.errors import InvalidInput

DEFAULT_PATH = Path("/etc/gthulhu-node/config.yaml")
# The configuration's format version. Why it is written into the file: a package upgrade keeps an
# operator's edited config.yaml (a conffile), so a later agent must know which format it reads, and an
# older agent (a downgrade) must refuse a file written for a newer format instead of misreading it. Raise
# it only for a change an older agent would misunderstand, and keep reading every older version.
CONFIG_VERSION = 1
NODE_NAME_ENV = "NODE_NAME"
POD_IP_VARIABLE = "${POD_IP}"  # in rest.listen: the pod's own IP (RestConfig._pod_ip)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NodeConfig(_Section):
    """Who this node is, for intents' nodeNames / nodeSelectors. The name comes from the environment's
    NODE_NAME first (what Kubernetes' downward API sets, and where upstream's Decision Maker looks
    first), then this setting, then the host name."""

    name: str = Field(default_factory=socket.gethostname)
    labels: dict[str, str] = {}

    @model_validator(mode="after")
    def _name_from_environment(self) -> NodeConfig:
        if os.environ.get(NODE_NAME_ENV):
            self.name = os.environ[NODE_NAME_ENV]
        return self


BackendKind = Literal["auto", "sched_ext", "eevdf", "dry-run"]


class BackendConfig(_Section):
    """Which backend turns strategies into scheduling. `auto`: sched_ext when the kernel has it,
    else sched_setattr on EEVDF (6.12+), else the dry run."""

    kind: BackendKind = "auto"
    # dry run only: where to mirror what it holds, for tools and benchmarks that read it from outside
    dry_run_record: Path | None = None
    # A backend that stopped working (an ejected scheduler, a dead eevdf refresher) is restarted after
    # this wait, doubled after each failed restart up to the max. Every backend, hence here.
    reload_backoff_initial_s: float = Field(default=1.0, gt=0)
    reload_backoff_max_s: float = Field(default=60.0, gt=0)


WATCHDOG_MAX_MS = 30_000  # the kernel's SCX_WATCHDOG_MAX_TIMEOUT (30 s): a longer timeout is refused at load


class SchedulerConfig(_Section):
    """Settings of the sched_ext scheduler, fixed before it is loaded. Values the scheduler or the kernel
    cannot honour are refused here, with the valid range, instead of at load (docs/scheduler.md)."""

    bpf_object: Path | None = None  # default: the object built into the package
    default_slice_ns: int = Field(default=5_000_000, ge=50_000, le=1_000_000_000)
    # at most 95: the rest of each window is the unboosted tasks' reserve on every CPU, and must exist
    boost_share_percent: int = Field(default=75, ge=1, le=95)
    boost_window_ns: int = Field(default=100_000_000, ge=1_000_000, le=10_000_000_000)
    map_capacity: int = Field(default=65_536, ge=1, le=4_194_304)
    watchdog_timeout_ms: int = Field(default=0, ge=0, le=WATCHDOG_MAX_MS)  # 0: the kernel's default (30 s)
    # unboosted tasks queue per NUMA node (each CPU takes from its node's queue first), or in one queue
    fair_queues: Literal["per_node", "single"] = "per_node"
    # Deprecated: backend.reload_backoff_initial_s / _max_s. Still read, so configs written before the
    # move keep working; AgentConfig moves them to `backend` and `deprecations()` says so.
    reload_backoff_initial_s: float | None = Field(default=None, gt=0)
    reload_backoff_max_s: float | None = Field(default=None, gt=0)
    # this many ejections within ejection_window_s: stop reloading, run the eevdf backend instead
    ejection_limit: int = Field(default=3, ge=1, le=1000)
    ejection_window_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _watchdog_above_the_guard(self) -> SchedulerConfig:
        """The watchdog must leave room for the bounded wait: at least ten boost windows and 1 s, so a
        guarded task is never reported stalled while it waits its stated turn."""
        low = max(1000, 10 * self.boost_window_ns // 1_000_000)
        if self.watchdog_timeout_ms and not low <= self.watchdog_timeout_ms <= WATCHDOG_MAX_MS:
            raise ValueError(
                f"watchdog_timeout_ms {self.watchdog_timeout_ms} is outside {low}-{WATCHDOG_MAX_MS} "
                f"(0 for the kernel's default): at least 10 boost windows and 1 s, at most the kernel's 30 s"
            )
        return self


class WatchConfig(_Section):
    """Task watching: proc connector events plus a periodic full /proc scan."""

    rescan_interval_s: float = Field(default=30.0, gt=0)
    proc_root: Path = Path("/proc")
    # the cgroup v2 tree walked for cpu.max limits, which the sched_ext scheduler does not enforce
    cgroup_root: Path = Path("/sys/fs/cgroup")
    cgroup_scan_interval_s: float = Field(default=60.0, gt=0)


class ApiConfig(_Section):
    """The gRPC API. By default only a unix socket that only root can open."""

    socket: Path = Path("/run/gthulhu-node/api.sock")
    tcp_listen: str | None = None  # "host:port"; requires the three TLS files below
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    max_message_bytes: int = Field(default=4 << 20, ge=1024)
    max_intents_per_source: int = Field(default=10_000, ge=1)
    max_sources: int = Field(default=64, ge=1)  # distinct gRPC client sources (local, manager not counted)
    # intents of all gRPC client sources together: ~4 KB each in memory, so the default bounds them to ~200 MB
    # (the unit's MemoryHigh is 512M; docs/security.md)
    max_client_intents: int = Field(default=50_000, ge=1)
    workers: int = Field(default=8, ge=1, le=256)  # gRPC handler threads (each watch stream holds one)
    # TCP listener only (the unix socket is root's): connections open at once, TLS handshake time,
    # and how long an idle connection is kept (docs/security.md)
    tcp_max_connections: int = Field(default=64, ge=1, le=4096)
    tcp_handshake_timeout_s: float = Field(default=10.0, gt=0, le=300)
    tcp_idle_timeout_s: float = Field(default=300.0, gt=0)


class PoliciesConfig(_Section):
    """Local policy files, the source `local`."""

    directory: Path = Path("/etc/gthulhu-node/policies.d")
    # how often the directory is checked for changes; 0: only at start and on SIGHUP
    poll_interval_s: float = Field(default=1.0, ge=0)


class StateConfig(_Section):
    """Where accepted intents are persisted."""

    directory: Path = Path("/var/lib/gthulhu-node")


class MetricsConfig(_Section):
    """Prometheus endpoint. Loopback by default; empty listen disables it."""

    listen: str = "127.0.0.1:9812"


class LogConfig(_Section):
    """`auto`: journald fields under systemd, console on a terminal, JSON lines otherwise."""

    format: Literal["auto", "journald", "json", "console"] = "auto"
    level: Literal["debug", "info", "warning", "error"] = "info"
    # per event name (task_matched, ...): more records than this in one second are counted, not written,
    # and one `<event>_suppressed count=N` record says so; 0 disables the limit
    rate_limit_per_s: int = Field(default=20, ge=0)


class RestConfig(_Section):
    """The upstream Decision Maker REST API (for an existing Gthulhu Manager). Off by default.
    Needs mutual TLS (the three tls_* files) and the RSA key pair tokens are signed with (docs/rest.md)."""

    enabled: bool = False
    listen: str = "0.0.0.0:8080"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    jwt_private_key: Path | None = None
    jwt_public_key: Path | None = None  # optional: checked to be the private key's public half
    token_ttl_s: int = Field(default=3600, ge=60)
    insecure_allow_plain_http: bool = False
    insecure_warning_interval_s: float = Field(default=600.0, gt=0)
    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    # Bounds (docs/security.md): connections open at once, a quarter of them per peer (past either, a new
    # one evicts the slowest unfinished one, or is closed when none is), the time from the connect to the
    # end of the TLS handshake and of the first request head, and how long an idle keep-alive one stays.
    max_connections: int = Field(default=64, ge=1, le=4096)
    handshake_timeout_s: float = Field(default=10.0, gt=0, le=300)
    keepalive_timeout_s: float = Field(default=15.0, gt=0, le=3600)
    # Newer Managers sign a client assertion with their own RSA key instead of showing ours: set its public
    # key here and tokens are issued only against such assertions (optionally only for this client id).
    trusted_client_public_key: Path | None = None
    expected_client_id: str = ""
    # Node policies held from the Manager are dropped when it keeps checking pod intents for this long
    # without once looking at node policies: it then holds no node intent anywhere (docs/rest.md,
    # "After a restart"). 2.5 of its 30 s reconcile cycles; 0 keeps them until it says otherwise.
    node_policy_silence_s: float = Field(default=75.0, ge=0)
    # runtime-config fields the Manager may set on this node (gthulhu_node/rest/runtime_config.py);
    # none by default
    runtime_config_allow: list[Literal["sliceNsDefault"]] = []

    @field_validator("listen")
    @classmethod
    def _pod_ip(cls, v: str) -> str:
        """`${POD_IP}` in `listen` is the environment's POD_IP (Kubernetes' downward API status.podIP):
        how a pod in the plain-HTTP mode listens on its own IP only (docs/kubernetes.md)."""
        if POD_IP_VARIABLE not in v:
            return v
        pod_ip = os.environ.get("POD_IP", "")
        if not pod_ip:
            raise ValueError("rest.listen names ${POD_IP} but the environment has no POD_IP "
                             "(set it from the downward API: status.podIP)")
        return v.replace(POD_IP_VARIABLE, f"[{pod_ip}]" if ":" in pod_ip else pod_ip)


class ProbeConfig(_Section):
    """The continuous BCC run-queue latency probe. Off by default (it costs CPU: docs/probe.md)."""

    enabled: bool = False
    # how often the in-kernel thread filter follows the agent's matches
    poll_interval_s: float = Field(default=1.0, ge=0.1, le=60.0)


class SecurityConfig(_Section):
    """Who may be boosted (docs/security.md).

    `unprivileged_tasks`: what tasks of users other than root may get.
    - `allowed` (default): any intent whose pattern matches. Any local user can then take a name-only
      intent's boost by naming a thread to match; kept as the default because the common case (vLLM run
      as an ordinary user, the README's example) needs it and an upgrade must not silently drop boosts.
    - `named_only`: only intents that name their user (`users`) or their cgroup (`cgroupRegex`, `podUID`).
    """

    unprivileged_tasks: Literal["allowed", "named_only"] = "allowed"


# settings that moved from `scheduler` to `backend` (the old key is still accepted, with a warning)
MOVED_TO_BACKEND = ("reload_backoff_initial_s", "reload_backoff_max_s")


class AgentConfig(_Section):
    version: int = Field(default=CONFIG_VERSION, ge=1)  # absent: the first format (CONFIG_VERSION 1)
    node: NodeConfig = Field(default_factory=NodeConfig)  # built per config: NODE_NAME is read then
    backend: BackendConfig = BackendConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    watch: WatchConfig = WatchConfig()
    api: ApiConfig = ApiConfig()
    policies: PoliciesConfig = PoliciesConfig()
    state: StateConfig = StateConfig()
    metrics: MetricsConfig = MetricsConfig()
    log: LogConfig = LogConfig()
    rest: RestConfig = RestConfig()
    probe: ProbeConfig = ProbeConfig()
    security: SecurityConfig = SecurityConfig()

    @model_validator(mode="after")
    def _known_version(self) -> AgentConfig:
        if self.version > CONFIG_VERSION:
            raise ValueError(f"version {self.version}: written for a newer gthulhu-node (this one reads "
                             f"configuration versions up to {CONFIG_VERSION})")
        return self

    @model_validator(mode="after")
    def _moved_settings(self) -> AgentConfig:
        """Settings that moved to another section: the old place still works unless the new one is set."""
        for name in MOVED_TO_BACKEND:
            old = getattr(self.scheduler, name)
            if old is not None and name not in self.backend.model_fields_set:
                self.backend = self.backend.model_copy(update={name: old})
        return self

    def deprecations(self) -> list[str]:
        """One sentence per deprecated setting in use, for the log at start."""
        out = []
        for name in MOVED_TO_BACKEND:
            if getattr(self.scheduler, name) is None:
                continue
            if getattr(self.backend, name) == getattr(self.scheduler, name):
                out.append(f"scheduler.{name} is deprecated: it applies to every backend, write "
                           f"backend.{name} instead")
            else:
                out.append(f"scheduler.{name} is deprecated and ignored: backend.{name} is set too")
        return out


class ConfigError(InvalidInput):
    """The configuration file is unreadable or invalid; the message names the file and the field."""


def load(path: Path | None = None) -> AgentConfig:
    """Load the configuration; a missing default file means all defaults, a missing named file is an error."""
    target = path or DEFAULT_PATH
    if not target.exists():
        if path is not None:
            raise ConfigError(f"{target}: no such file")
        return AgentConfig()
    try:
        data = yaml.safe_load(target.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{target}: {exc}") from None
    except (ValueError, RecursionError) as exc:  # a 5,000-digit integer (Python's int-digit limit), ...
        raise ConfigError(f"{target}: not valid YAML: {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{target}: expected a mapping at the top level")
    try:
        return AgentConfig.model_validate(data)
    except ValueError as exc:
        raise ConfigError(f"{target}: {exc}") from None
