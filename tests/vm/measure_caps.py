"""Measure which capabilities the unit needs: `python -m tests.vm.measure_caps` boots the systemd lab,
installs the unit and starts it once per capability bounding set (all five, then each one left out).
The figures are in docs/service.md; the unit's CapabilityBoundingSet= follows from them."""

from __future__ import annotations

import sys

from tests.vm.lab import Lab

DIR = "/run/gthulhu-lab"


def main() -> int:
    with Lab("systemd") as lab:
        lab.run(f".venv/bin/python tests/vm/guest_service.py install {DIR}", timeout=120).check("install")
        r = lab.run(f"bash tests/vm/guest_caps.sh {DIR}", timeout=3000)
        print(r.stdout, r.stderr[-2000:], sep="\n", flush=True)
        return r.returncode


if __name__ == "__main__":
    sys.exit(main())
