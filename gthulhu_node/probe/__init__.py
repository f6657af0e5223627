"""Run-queue wait of the threads intents match, measured in the kernel with a BCC tracing program.

Entry points: `measure()` for tools, or `BackgroundProbe` beside a workload; `gthulhu-node probe` for
people; and the agent runs it continuously (probe.continuous) when `probe.enabled` is set.
docs/probe.md has the method and its cost.
"""

from gthulhu_node.probe.histogram import WaitHistogram
from gthulhu_node.probe.preflight import ProbeUnavailable
from gthulhu_node.probe.session import BackgroundProbe, ProbeResult, measure

__all__ = ["BackgroundProbe", "ProbeResult", "ProbeUnavailable", "WaitHistogram", "measure"]
