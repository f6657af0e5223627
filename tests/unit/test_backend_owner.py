"""One owner of the backend (docs/design.md, "Who owns what"): only the supervisor
(gthulhu_node/backends/supervisor.py) ever changes which backend runs. Others may hold one for life (set
once in their `__init__`); none reassigns it. Before, the Agent reassigned its backend at a fall-back and a
give-up and the Engine swapped the reconciler's for a reload stand-in and back: three owners of one
object, found by reading."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gthulhu_node"
SUPERVISOR = PACKAGE / "backends" / "supervisor.py"
NAMES = frozenset({"backend", "_backend"})
# file -> function that assigns an attribute of that name which is no Backend, and what it is instead
NOT_A_BACKEND = {
    ("config.py", "_moved_settings"): "the configuration's `backend:` section (a pydantic model)",
}


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        found = [node.target]
    else:
        return []
    out: list[ast.expr] = []
    while found:
        t = found.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            found.extend(t.elts)
        else:
            out.append(t)
    return out


def reassignments(path: Path) -> list[str]:
    """`x.backend = ...` (or `_backend`, in a tuple too, or through setattr) outside an `__init__`."""
    found: list[str] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            for t in _targets(child):
                if (isinstance(t, ast.Attribute) and t.attr in NAMES and function != "__init__"
                        and (path.name, function) not in NOT_A_BACKEND):
                    found.append(f"{path.name}:{child.lineno} in {function or '<module>'}")
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                    and child.func.id == "setattr" and len(child.args) > 1
                    and isinstance(child.args[1], ast.Constant) and child.args[1].value in NAMES):
                found.append(f"{path.name}:{child.lineno} setattr in {function or '<module>'}")
            visit(child, inner)

    visit(ast.parse(path.read_text()), "")
    return found


def test_only_the_supervisor_assigns_a_backend() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != SUPERVISOR and "gen" not in path.relative_to(PACKAGE).parts:
            offenders.extend(reassignments(path))
    assert offenders == []


def test_the_supervisor_is_where_it_happens() -> None:
    assert reassignments(SUPERVISOR)  # start, fall back, give up


def test_the_check_sees_each_spelling(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        "class A:\n"
        "    def __init__(self, b):\n        self.backend = b\n"  # held for life: allowed
        "    def swap(self, b):\n        self.backend = b\n"
        "    def pair(self, b):\n        self._backend, self.reason = b, ''\n"
        "def engine(r, b):\n    r.backend = b\n    setattr(r, 'backend', b)\n"
    )
    assert len(reassignments(f)) == 4
