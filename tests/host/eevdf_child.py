"""A process for TGID tests, driven line by line over stdin: `pid`, `spawn`, `end TID`, `comm NAME` (renames
the main thread); EOF ends it."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

PR_SET_NAME = 15


def main() -> None:
    stops: dict[int, tuple[threading.Event, threading.Thread]] = {}
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "pid":
            reply = str(os.getpid())
        elif command == "spawn":
            stop = threading.Event()
            started = threading.Event()
            box: list[int] = []

            def run(
                stop: threading.Event = stop, started: threading.Event = started, box: list[int] = box
            ) -> None:
                box.append(threading.get_native_id())
                started.set()
                stop.wait()

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            started.wait()
            stops[box[0]] = (stop, thread)
            reply = str(box[0])
        elif command == "comm":
            ctypes.CDLL(None).prctl(PR_SET_NAME, arg.encode()[:15], 0, 0, 0)
            reply = "ok"
        elif command == "end":
            stop, thread = stops.pop(int(arg))
            stop.set()
            thread.join()
            reply = "ok"
        else:
            reply = f"unknown command {command!r}"
        sys.stdout.write(reply + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
