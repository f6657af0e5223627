"""A real kill -9 of an agent process in the middle of its writes: the next one restores every thread.

The threads belong to this test process (they must outlive the killed one); a child process runs the EEVDF
backend with a journal and boosts, re-tunes and releases them as fast as it can until it is killed at a
random moment. The successor, started on the journal it left, must give every thread its own settings.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from gthulhu_node.backends.eevdf import JOURNAL_NAME, EevdfBackend
from gthulhu_node.backends.eevdf_journal import read_journal
from tests.host.eevdf_threads import SYS, Worker

REPO = Path(__file__).resolve().parents[2]
# The agent's life in the child: argv = journal, then pid, then (tid, start time) pairs.
CHURN = """
import sys
from pathlib import Path
import structlog, logging
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
from gthulhu_node.backends.base import Entry, EntryKey, KeyKind
from gthulhu_node.backends.eevdf import EevdfBackend
journal, args = Path(sys.argv[1]), [int(a) for a in sys.argv[2:]]
threads = list(zip(args[0::2], args[1::2]))
backend = EevdfBackend(cover_interval_s=0, journal=journal)
backend.start()
print("started", flush=True)
n = 0
while True:
    n += 1
    ups = {EntryKey(KeyKind.TID, t): Entry(1 + (n + i) % 20, 200_000 * (1 + n % 3), s)
           for i, (t, s) in enumerate(threads) if (n + i) % 3}
    dels = [EntryKey(KeyKind.TID, t) for i, (t, s) in enumerate(threads) if not (n + i) % 3]
    backend.apply(ups, dels)
"""


def test_a_successor_restores_every_thread_after_kill_9_at_random_moments(tmp_path: Path) -> None:
    workers = [Worker() for _ in range(4)]
    try:
        os.setpriority(os.PRIO_PROCESS, workers[1].tid, 4)
        before = {w.tid: SYS.get(w.tid) for w in workers}
        journal = tmp_path / JOURNAL_NAME
        rng = random.Random(21)
        boosted_at_kill = 0
        for _ in range(8):
            args = [str(journal)] + [str(v) for w in workers for v in (w.tid, w.start_time)]
            child = subprocess.Popen(
                [sys.executable, "-c", CHURN, *args], cwd=REPO, stdout=subprocess.PIPE, text=True
            )
            assert child.stdout is not None and child.stdout.readline().strip() == "started"
            time.sleep(rng.uniform(0.005, 0.2))
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            boosted_at_kill += any(SYS.get(w.tid).nice < before[w.tid].nice for w in workers)
            successor = EevdfBackend(cover_interval_s=0, journal=journal)
            successor.start()
            assert {w.tid: SYS.get(w.tid) for w in workers} == before
            assert read_journal(journal) == []
            successor.stop()
        assert boosted_at_kill >= 4  # the kills did land while threads carried our writes
    finally:
        for w in workers:
            w.stop()
