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
COMPOSITION = _modules("config", "agent", "service", "metrics", "cli", "commands")
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
    "gthulhu_node.writer": COMPOSITION + EDGES + _modules(
        "intents", "matching", "tasks", "reconciler", "task_table", "status_projection", "feed", "engine"),
    "gthulhu_node.status_projection": COMPOSITION + EDGES + _modules(
        "reconciler", "task_table", "feed", "engine"),
    "gthulhu_node.task_table": COMPOSITION + EDGES + _modules("reconciler", "feed", "engine"),
    "gthulhu_node.feed": COMPOSITION + EDGES + _modules("engine"),
    "gthulhu_node.publication": COMPOSITION + EDGES + _modules("engine"),
    "gthulhu_node.engine": COMPOSITION + EDGES,
}
# composition inside a lower package: choosing a backend reads the configuration's kind
EXEMPT = {"gthulhu_node.backends.select": ("gthulhu_node.config",)}

# Every module's layer (docs/design.md, "Layers"), by package prefix; the longest prefix wins. A module
# imports only from its own layer or below (`test_no_module_imports_a_higher_layer`); RULES above add
# what the numbers cannot say (intents and backends beside each other; layer 1's parts independent).
LAYER_OF: dict[str, int] = {
    "gthulhu_node": 1,  # the package itself: its version
    "gthulhu_node.tasks": 1, "gthulhu_node.limits": 1, "gthulhu_node.errors": 1, "gthulhu_node.peers": 1,
    "gthulhu_node.lifecycle": 1, "gthulhu_node.workers": 1, "gthulhu_node.systemd": 1,
    "gthulhu_node.capabilities": 1,
    "gthulhu_node.backends.base": 2,
    "gthulhu_node.backends": 3, "gthulhu_node.scheduler": 3,
    "gthulhu_node.intents": 4, "gthulhu_node.matching": 4,
    "gthulhu_node.reconciler": 5, "gthulhu_node.task_table": 5, "gthulhu_node.writer": 5,
    "gthulhu_node.status_projection": 5, "gthulhu_node.publication": 5,
    "gthulhu_node.outbox": 5, "gthulhu_node.feed": 5,
    "gthulhu_node.engine": 5,
    "gthulhu_node.intents.store": 6, "gthulhu_node.intents.journal": 6, "gthulhu_node.intents.localfiles": 6,
    "gthulhu_node.intents.state_file": 6, "gthulhu_node.intents.source_set": 6,
    "gthulhu_node.intents.store_errors": 6,
    "gthulhu_node.intents.status": 6, "gthulhu_node.api": 6, "gthulhu_node.rest": 6, "gthulhu_node.probe": 6,
    "gthulhu_node.metrics_server": 6, "gthulhu_node.config": 6,
    # the read side of the running agent, served by api/ and rest/: they run the reconciler's code
    "gthulhu_node.explain": 6, "gthulhu_node.preview": 6,
    "gthulhu_node.backends.select": 7, "gthulhu_node.agent": 7, "gthulhu_node.policy_builder": 7,
    "gthulhu_node.agent_status": 7, "gthulhu_node.status_rows": 7,
    "gthulhu_node.metrics": 7, "gthulhu_node.service": 7, "gthulhu_node.cli": 7, "gthulhu_node.commands": 7,
    "gthulhu_node.__main__": 7, "gthulhu_node.logs": 7, "gthulhu_node.preflight": 7,
    "gthulhu_node.privileges": 7,
}


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


def modules() -> list[tuple[str, Path]]:
    return [(module_name(path), path) for path in sorted(PACKAGE.rglob("*.py"))
            if "gen" not in path.relative_to(PACKAGE).parts]


def layer_of(module: str) -> int | None:
    """The layer of the longest LAYER_OF prefix `module` is under; None for a module of no layer. The
    package root's entry counts only for the root itself, so a new top-level module has none."""
    prefixes = [p for p in LAYER_OF if under(module, p) and (p != "gthulhu_node" or module == p)]
    return LAYER_OF[max(prefixes, key=len)] if prefixes else None


def violations() -> list[str]:
    found = []
    for module, path in modules():
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


def test_every_module_is_in_a_layer() -> None:
    assert [module for module, _ in modules() if layer_of(module) is None] == []


def test_no_module_imports_a_higher_layer() -> None:
    found = []
    for module, path in modules():
        own = layer_of(module)
        assert own is not None
        for imported in sorted(imports_of(path)):
            theirs = layer_of(imported) if under(imported, "gthulhu_node") else None
            if theirs is not None and theirs > own:
                found.append(f"{module} (layer {own}) imports {imported} (layer {theirs})")
    assert found == []


def test_a_new_top_level_module_has_no_layer_until_given_one() -> None:
    assert layer_of("gthulhu_node.newpart") is None
    assert layer_of("gthulhu_node.rest.newpart") == 6


def test_the_check_sees_lazy_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from gthulhu_node.config import AgentConfig\n")
    assert "gthulhu_node.config" in imports_of(f)
