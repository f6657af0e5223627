"""docs/design.md is the map a newcomer reads first: every file and module it names must exist, so a
rename or a removal that leaves it behind fails here instead of misleading the next reader."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
# repository paths (`gthulhu_node/engine.py`, docs/eevdf.md) and package-relative ones (`intents/store.py`)
PACKAGES = "|".join(("gthulhu_node", "tests", "docs", "bpf", "systemd", "scripts",  # from the root
                     "tasks", "backends", "scheduler", "intents", "api", "rest", "probe", "commands"))
PATH = re.compile(rf"(?<![\w./-])((?:{PACKAGES})/[\w./-]*[\w/])")
LINK = re.compile(r"\]\(([\w./-]+\.md)\)")


def named_paths(text: str) -> set[str]:
    return {m.rstrip("/.") for m in PATH.findall(text)} | {f"docs/{m}" for m in LINK.findall(text)}


def exists(name: str) -> bool:
    return any((base / name).exists() for base in (ROOT, ROOT / "gthulhu_node"))


def test_every_file_the_design_doc_names_exists() -> None:
    names = named_paths(DESIGN.read_text())
    assert len(names) > 30  # the pattern still finds what the document names
    missing = sorted(n for n in names if not exists(n))
    assert not missing, f"docs/design.md names files that are gone: {missing}"


def test_the_check_notices_a_missing_module() -> None:
    assert not exists("gthulhu_node/no_such_module.py")
    assert "gthulhu_node/no_such_module.py" in named_paths("see `gthulhu_node/no_such_module.py`")
    assert "intents/store.py" in named_paths("`intents/store.py`") and exists("intents/store.py")
