"""One way to run a thread (docs/design.md, "Threads"): `threading.Thread`, `Event` and `Condition` appear
only in gthulhu_node/workers.py. A part that starts its own thread or keeps its own Event brings back what
the worker module replaced: a wake, a stop and a join written once more, and a thread named like another."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gthulhu_node"
PRIMITIVES = frozenset({"Thread", "Event", "Condition"})
WORKER_MODULE = PACKAGE / "workers.py"
# module -> the primitives it may still use, and why they cannot move
ALLOWED: dict[str, frozenset[str]] = {}


def uses(path: Path) -> set[str]:
    """The primitives `path` names: `threading.X` attributes, `from threading import X`, and asyncio's
    or anything else's `X` reached as an attribute of `threading`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in PRIMITIVES:
            if isinstance(node.value, ast.Name) and node.value.id == "threading":
                found.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module == "threading":
            found.update(a.name for a in node.names if a.name in PRIMITIVES)
    return found


def offenders() -> dict[str, set[str]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == WORKER_MODULE or "gen" in path.relative_to(PACKAGE).parts:
            continue
        rel = str(path.relative_to(PACKAGE.parent))
        extra = uses(path) - ALLOWED.get(rel, frozenset())
        if extra:
            out[rel] = extra
    return out


def test_threads_events_and_conditions_only_in_the_worker_module() -> None:
    assert offenders() == {}


def test_the_worker_module_is_where_they_are() -> None:
    assert uses(WORKER_MODULE) == PRIMITIVES


def test_the_check_sees_each_spelling(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import threading\nfrom threading import Condition\n"
                 "def f():\n    threading.Thread(target=f).start()\n    e: threading.Event\n")
    assert uses(f) == PRIMITIVES


STARTERS = {"WorkerThread", "spawn", "run_in_thread"}


def thread_names() -> list[tuple[str, str]]:
    """(module, name) for every thread the package starts: the first argument of each call to the worker
    module's starters, a string literal (a name computed at run time would escape this check)."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == WORKER_MODULE or "gen" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if called in STARTERS:
                    first = node.args[0] if node.args else None
                    assert isinstance(first, ast.Constant) and isinstance(first.value, str), \
                        f"{path}:{node.lineno}: a thread's name is a literal"
                    out.append((str(path.relative_to(PACKAGE.parent)), first.value))
    return out


def test_every_thread_the_package_starts_has_a_name_of_its_own() -> None:
    names = [name for _, name in thread_names()]
    assert len(names) >= 10  # the check finds them: engine, reload, builder, status, files, ...
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
