"""tests/host/unprivileged.py (how the tests run the agent's code as `nobody`) works wherever the checkout
lives: run from a copy of the package in a 0700 folder, as a clone under root's 0700 home on a fresh
Debian machine is, every module of the package is importable after the drop and the CLI answers."""

from __future__ import annotations

import pkgutil
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import gthulhu_node
from tests.host import unprivileged

pytestmark = pytest.mark.host

AFTER_DROP = """
import importlib, os, sys
assert os.getuid() != 0
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {e!r}")
print("\\n".join(failed))
"""


@pytest.fixture(scope="module")
def private_copy() -> Iterator[Path]:
    """The package copied into a folder only root may enter (mkdtemp makes it 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="gthulhu-0700-"))
    assert folder.stat().st_mode & 0o777 == 0o700
    shutil.copytree(Path(gthulhu_node.__file__).parent, folder / "gthulhu_node",
                    ignore=shutil.ignore_patterns("__pycache__"))
    yield folder
    shutil.rmtree(folder)


def package_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(gthulhu_node.__path__, "gthulhu_node.")
            if m.name != "gthulhu_node.__main__"]


def test_every_module_is_importable_after_the_drop(private_copy: Path) -> None:
    names = package_modules()
    assert "gthulhu_node.commands.compare" in names  # the one a lazy import once left out
    done = unprivileged.run("nobody", "", AFTER_DROP, *names, path=private_copy)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", done.stdout


def test_the_cli_answers_as_nobody_from_the_private_copy(private_copy: Path) -> None:
    """A command that needs root says so (the probe), rather than failing to import its module."""
    done = unprivileged.run("nobody", "gthulhu_node.cli:main", "probe", "--regex", "x", "--duration", "1",
                            path=private_copy)
    assert done.returncode != 0 and "needs root" in done.stderr, done.stderr
    assert "No module named" not in done.stderr and "Traceback" not in done.stderr, done.stderr
