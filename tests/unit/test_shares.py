"""The lab's share comparisons (tests/vm/shares.py), with figures the lab measured."""

from __future__ import annotations

from tests.vm.shares import leaves_off_eevdf


def test_ours_on_the_weights_is_not_failed_by_eevdfs_noise() -> None:
    """The comparison with EEVDF as CI of 504e2c2 measured it (ours, EEVDF scaled, by the weights): ours on
    the weights passes wherever EEVDF strays; ours off both EEVDF and the weights where EEVDF is near them
    fails."""
    by_weights = {"a.service": 0.182, "b.service": 0.182, "pod-guaranteed": 0.19}
    eevdf = {"a.service": 0.135, "b.service": 0.149, "pod-guaranteed": 0.19}
    assert leaves_off_eevdf({"a.service": 0.182, "b.service": 0.183, "pod-guaranteed": 0.19},
                            eevdf, by_weights) == []
    assert leaves_off_eevdf({"a.service": 0.182, "b.service": 0.183, "pod-guaranteed": 0.14},
                            eevdf, by_weights) == ["pod-guaranteed"]
