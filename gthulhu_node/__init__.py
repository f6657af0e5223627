"""gthulhu-node: the node agent of Gthulhu, applying workload-aware CPU scheduling through sched_ext."""

__version__ = "0.2.0"
