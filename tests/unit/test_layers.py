"""The import layers of docs/design.md ("Layers"): lower parts never reach up into the parts that compose
them. An upward import is how a backend starts to know intents, or a preview to need the engine: checked
here on every import statement, lazy ones inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gthulhu_node"


def _modules(*names: str) -> tuple[str, ...]:
    return tuple(f"gthulhu_node.{n}" for n in names)


# the composition layer, and the sources and edges above the engine
COMPOSITION = _modules("config", "agent", "service", "metrics", "preview", "cli", "commands")
EDGES = _modules("api", "rest", "probe")
# package prefix -> what it must never import
RULES: dict[str, tuple[str, ...]] = {
    "gthulhu_node.tasks": COMPOSITION + EDGES + _modules(
        "backends", "scheduler", "intents", "matching", "reconciler", "outbox", "feed", "engine"),
    "gthulhu_node.errors": COMPOSITION + EDGES + _modules(
        "tasks", "backends", "scheduler", "intents", "matching", "reconciler", "outbox", "feed", "engine",
        "limits"),
    "gthulhu_node.lifecycle": COMPOSITION + EDGES + _modules(
        "tasks", "backends", "scheduler", "intents", "matching", "reconciler", "outbox", "feed", "engine",
        "limits", "errors"),
    "gthulhu_node.peers": COMPOSITION + EDGES + _modules(
        "tasks", "backends", "scheduler", "intents", "matching", "reconciler", "outbox", "feed", "engine",
        "limits", "errors", "lifecycle"),
    "gthulhu_node.limits": COMPOSITION + EDGES + _modules(
        "tasks", "backends", "scheduler", "intents", "matching", "reconciler", "outbox", "feed", "engine"),
    "gthulhu_node.backends": COMPOSITION + EDGES + _modules(
        "intents", "matching", "reconciler", "outbox", "feed", "engine"),
    "gthulhu_node.scheduler": COMPOSITION + EDGES + _modules(
        "intents", "matching", "reconciler", "outbox", "feed", "engine"),
    "gthulhu_node.intents": COMPOSITION + EDGES + _modules(
        "backends", "scheduler", "reconciler", "outbox", "feed", "engine", "tasks"),
    "gthulhu_node.matching": COMPOSITION + EDGES + _modules(
        "backends", "scheduler", "reconciler", "outbox", "feed", "engine"),
    "gthulhu_node.outbox": COMPOSITION + EDGES + _modules(
        "intents", "matching", "reconciler", "feed", "engine"),
    "gthulhu_node.reconciler": COMPOSITION + EDGES + _modules("feed", "engine"),
    "gthulhu_node.feed": COMPOSITION + EDGES + _modules("engine"),
    "gthulhu_node.engine": COMPOSITION + EDGES,
}
# composition inside a lower package: choosing a backend reads the configuration's kind
EXEMPT = {"gthulhu_node.backends.select": ("gthulhu_node.config",)}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def imports_of(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "gthulhu_node":  # `from gthulhu_node import config`: the module is the alias
                out.update(f"gthulhu_node.{alias.name}" for alias in node.names)
            else:
                out.add(node.module)
    return out


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "gen" in path.relative_to(PACKAGE).parts:
            continue
        module = module_name(path)
        for layer, forbidden in RULES.items():
            if not under(module, layer):
                continue
            for imported in sorted(imports_of(path)):
                bad = next((f for f in forbidden if under(imported, f)), None)
                if bad and not any(under(imported, e) for e in EXEMPT.get(module, ())):
                    found.append(f"{module} imports {imported}")
    return sorted(set(found))


def test_no_module_imports_a_layer_above_its_own() -> None:
    assert violations() == []


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from gthulhu_node.config import AgentConfig\n")
    assert "gthulhu_node.config" in imports_of(f)
