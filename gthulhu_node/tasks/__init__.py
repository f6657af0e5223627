"""Finding Linux tasks: full /proc snapshots (the ground truth) and proc connector events (the fast path)."""
