"""Run-queue wait of the threads intents match, measured in the kernel with a BCC tracing program.

`measure()` is the entry point for tools; `gthulhu-node probe` is the one for people; the agent runs it
continuously (probe.continuous) when `probe.enabled` is set. docs/probe.md has the method and its cost.
"""

from gthulhu_node.probe.histogram import WaitHistogram
from gthulhu_node.probe.preflight import ProbeUnavailable
from gthulhu_node.probe.session import ProbeResult, measure

__all__ = ["ProbeResult", "ProbeUnavailable", "WaitHistogram", "measure"]
