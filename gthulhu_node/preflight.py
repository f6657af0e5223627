"""Checks of the whole configuration that need more than its schema: files it names, addresses.

Why before anything starts: a configuration error must exit 2 (the unit's RestartPreventExitStatus, so
systemd waits for a person) with one line naming the setting, before a socket is opened or a scheduler
loaded. Found only while starting, the same error used to exit 1 with a traceback, after the gRPC socket
was already open, and systemd restarted it ten times.
"""

from __future__ import annotations

from gthulhu_node.config import AgentConfig, ConfigError


def check(config: AgentConfig) -> None:
    """Raise ConfigError naming the first setting that cannot work."""
    from gthulhu_node.api.server import ApiConfigError, read_tls_files
    from gthulhu_node.metrics import parse_listen as parse_metrics_listen

    try:
        parse_metrics_listen(config.metrics.listen) if config.metrics.listen else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config.api.tcp_listen:
        host, sep, port = config.api.tcp_listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"api.tcp_listen {config.api.tcp_listen!r}: expected host:port")
        try:
            read_tls_files(config.api)
        except ApiConfigError as exc:
            raise ConfigError(str(exc)) from None
    if config.rest.enabled:
        # Imported only when enabled, as the agent does: aiohttp and the token machinery are not needed
        # otherwise.
        from gthulhu_node.rest.server import RestConfigError, parse_listen, prepare

        try:
            parse_listen(config.rest.listen)
            prepare(config.rest)
        except RestConfigError as exc:
            raise ConfigError(str(exc)) from None
