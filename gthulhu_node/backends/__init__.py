"""Backends: what turns the strategy table into scheduling (sched_ext maps, sched_setattr, or a dry run)."""
