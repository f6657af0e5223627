"""Measure which capabilities the unit needs: `python -m tests.vm.measure_caps` boots the systemd lab,
installs the unit and starts it once per capability bounding set (all five, then each one left out, then
narrower sets; `--narrow-only` skips the first two kinds).
The figures are in docs/service.md; the unit's CapabilityBoundingSet= follows from them.
`--show` then runs the service with the vLLM example and prints what a user sees (systemctl, the CLI,
journalctl, a scrape): the README's examples come from it."""

from __future__ import annotations

import sys

from tests.lab_install import install_in_guest
from tests.vm.lab import Lab

DIR = "/run/gthulhu-lab"


def main() -> int:
    with Lab("systemd") as lab:
        install_in_guest(lab)
        narrow = " --narrow-only" if "--narrow-only" in sys.argv[1:] else ""
        r = lab.run(f"bash tests/vm/guest_caps.sh {DIR}{narrow}", timeout=3000)
        print(r.stdout, r.stderr[-2000:], sep="\n", flush=True)
        if "--show" in sys.argv[1:]:
            shown = lab.run(f"bash tests/vm/guest_show.sh {DIR}", timeout=3000)
            print(shown.stdout, shown.stderr[-2000:], sep="\n", flush=True)
        return r.returncode


if __name__ == "__main__":
    sys.exit(main())
