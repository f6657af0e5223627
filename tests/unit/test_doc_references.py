"""Every document the repository cites is in the repository: a reader who follows a citation of design
or lab notes kept elsewhere finds nothing, and the fact behind the citation is lost with it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED = re.compile(r"(?<![\w/.:-])((?:\.\./|[\w-]+/)*[\w-]+\.md)\b")
TEXT = (".py", ".md", ".c", ".h", ".sh", ".yaml", ".yml", ".toml", ".service", ".conf", "Makefile")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / n for n in names.split() if n.endswith(TEXT) and "/gen/" not in n]


def resolves(cited: str, where: Path) -> bool:
    for base in (where.parent, ROOT, ROOT / "docs"):
        target = (base / cited).resolve()
        if target.is_relative_to(ROOT) and target.is_file():
            return True
    return False


def test_every_cited_document_is_in_the_repository() -> None:
    missing = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for cited in CITED.findall(line):
                if "://" in line and f"/{cited}" in line:
                    continue  # a link to another project's page
                if not resolves(cited, path):
                    missing.append(f"{path.relative_to(ROOT)}:{number}: {cited}")
    assert not missing, "documents cited but not in the repository:\n" + "\n".join(missing)
