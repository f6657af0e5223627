"""The continuous probe's Prometheus export: log2 histograms become a histogram family with le = powers of
two seconds, per intent, and the probe's own state. The probe object is a stand-in: what is under test is
the conversion and exposition, not BPF."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from gthulhu_node.probe.continuous import METRIC, ProbeStats, RunqueueLatencyCollector
from gthulhu_node.probe.histogram import WaitHistogram
from tests.prom import parse_samples


class _Probe:
    def __init__(self, hists: dict[str, WaitHistogram], up: bool = True) -> None:
        self.hists = hists
        self.up = up

    def histograms(self) -> dict[str, WaitHistogram]:
        return self.hists

    def stats(self) -> ProbeStats:
        return ProbeStats(self.up, "running" if self.up else "unavailable", "", 3, 1, 0, 2)


def _scrape(probe: _Probe) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    registry = CollectorRegistry()
    registry.register(RunqueueLatencyCollector(probe))  # type: ignore[arg-type]
    return parse_samples(generate_latest(registry).decode())


def test_buckets_are_cumulative_powers_of_two_seconds() -> None:
    waits = [3_000] * 10 + [1_500_000] * 5 + [40_000_000]
    got = _scrape(_Probe({"local/vllm": WaitHistogram.from_values(waits)}))
    rows = got[f"{METRIC}_bucket"].items()
    buckets = {dict(k)["le"]: v for k, v in rows if dict(k)["intent"] == "local/vllm"}
    assert buckets["4.096e-06"] == 10  # 3 us < 4.096 us
    assert buckets["0.001048576"] == 10  # 1.5 ms is above 1.048576 ms
    assert buckets["0.002097152"] == 15
    assert buckets["0.033554432"] == 15
    assert buckets["0.067108864"] == 16
    assert buckets["+Inf"] == 16
    assert got[f"{METRIC}_count"][(("intent", "local/vllm"),)] == 16
    assert abs(got[f"{METRIC}_sum"][(("intent", "local/vllm"),)] - sum(waits) / 1e9) < 1e-9
    assert got["gthulhu_node_probe_up"][()] == 1
    assert got["gthulhu_node_probe_tracked_threads"][()] == 3
    assert got["gthulhu_node_probe_target_map_full_total"][()] == 2


def test_one_series_per_intent_and_none_when_down() -> None:
    two = _scrape(_Probe({"a/x": WaitHistogram.from_values([10]), "b/y": WaitHistogram.from_values([20])}))
    assert {dict(k)["intent"] for k in two[f"{METRIC}_count"]} == {"a/x", "b/y"}
    down = _scrape(_Probe({}, up=False))
    assert f"{METRIC}_count" not in down
    assert down["gthulhu_node_probe_up"][()] == 0


def test_metrics_attach_registers_the_probes_collector_with_the_others() -> None:
    """docs/design.md: `Metrics.attach` registers one collector per component, the probe's included;
    the probe registered its own elsewhere before."""
    from gthulhu_node.metrics import collectors

    probe = _Probe({})
    with_probe = collectors(SimpleNamespace(stats=None), probe=probe)  # type: ignore[arg-type]
    assert next(c for c in with_probe if isinstance(c, RunqueueLatencyCollector)).probe is probe
    assert not any(isinstance(c, RunqueueLatencyCollector) for c in collectors(SimpleNamespace(stats=None)))  # type: ignore[arg-type]
