"""The upstream Gthulhu Decision Maker REST API, served so an existing Gthulhu Manager can push to this node.

Off by default (`rest.enabled`). Intents pushed here become the `manager` source (node policies) and the
`manager-pods` source (pod intents) of the agent's intent store; see docs/rest.md.
"""

from gthulhu_node.rest.server import RestConfigError, RestServer, RestStats

__all__ = ["RestConfigError", "RestServer", "RestStats"]
