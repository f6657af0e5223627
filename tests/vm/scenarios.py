"""Running one guest-side scenario script in the lab and reading the JSON object it prints last."""

from __future__ import annotations

import json
from typing import Any


def run(lab: Any, script: str, name: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    result = lab.run([".venv/bin/python", script, name, *args], timeout=timeout)
    assert result.returncode == 0, f"{name} failed:\n{result.stderr[-4000:]}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{name} printed no result:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    data: dict[str, Any] = json.loads(lines[-1])
    return data
