"""A vLLM-like workload driven line by line on stdin, for tests that watch its threads from outside.

Commands (one per line); each answers one line on stdout once done:
  spawn NAME        start a thread that names itself NAME with prctl(PR_SET_NAME) -> "tid NAME <tid>"
  rename NAME NEW   that thread renames itself                                     -> "ok"
  end NAME          that thread returns                                             -> "ok"
  quit              every thread ends, the process exits                           -> "bye"
The process itself keeps its own comm (python3...), like vLLM's `python3.12` engine process.
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading

PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def set_name(name: str) -> None:
    _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


class Worker:
    def __init__(self, name: str) -> None:
        self.inbox: queue.Queue[tuple[str, str]] = queue.Queue()
        self.done: queue.Queue[int] = queue.Queue()
        self.thread = threading.Thread(target=self._run, args=(name,), daemon=True)
        self.thread.start()
        self.tid = self.done.get()

    def _run(self, name: str) -> None:
        set_name(name)
        self.done.put(threading.get_native_id())
        while True:
            op, arg = self.inbox.get()
            if op == "rename":
                set_name(arg)
                self.done.put(0)
            else:
                return

    def ask(self, op: str, arg: str = "") -> None:
        self.inbox.put((op, arg))
        if op == "rename":
            self.done.get()
        else:
            self.thread.join()


def main() -> int:
    workers: dict[str, Worker] = {}
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        cmd = parts[0]
        if cmd == "spawn":
            w = workers[parts[1]] = Worker(parts[1])
            print(f"tid {parts[1]} {w.tid}", flush=True)
        elif cmd == "rename":
            w = workers.pop(parts[1])
            w.ask("rename", parts[2])
            workers[parts[2]] = w
            print("ok", flush=True)
        elif cmd == "end":
            workers.pop(parts[1]).ask("end")
            print("ok", flush=True)
        elif cmd == "quit":
            for w in workers.values():
                w.ask("end")
            print("bye", flush=True)
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
