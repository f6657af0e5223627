"""`gthulhu-node compare`'s method without a kernel: the window order flips every pair, a window's waits
are the difference of cumulative histograms, CPU time counts only threads alive at both ends, and the
summary and table put both sides and their spread side by side. (The probe itself needs kernel headers:
its part is the lab VM's; docs/probe.md.)"""

from __future__ import annotations

from pathlib import Path

from gthulhu_node.commands.compare import pattern
from gthulhu_node.intents.parse import parse_intent
from gthulhu_node.probe import compare
from gthulhu_node.probe.histogram import WaitHistogram


def test_order_flips_every_pair() -> None:
    assert compare.order(3) == [True, False, False, True, True, False]


def test_difference_of_cumulative_histograms() -> None:
    before = WaitHistogram.from_values([1_000, 2_000, 50_000])
    after = WaitHistogram.from_values([1_000, 2_000, 50_000, 3_000, 60_000, 60_000])
    diff = compare.difference(after, before)
    expected = WaitHistogram.from_values([3_000, 60_000, 60_000])
    expected.max_ns = 0  # a maximum cannot be differenced
    assert diff == expected


def test_cpu_counts_threads_alive_at_both_ends() -> None:
    assert compare.cpu_delta_ns({1: 500, 2: 900, 3: 10}, {1: 100, 2: 800, 4: 7}) == 500


def test_read_cpu_ns(tmp_path: Path) -> None:
    (tmp_path / "11").mkdir()
    (tmp_path / "11" / "schedstat").write_text("123456 789 10\n")
    assert compare.read_cpu_ns([11, 12], proc=tmp_path) == {11: 123456}


class FakeHost:
    """Threads that wait 2 ms per wake with the intents off and 0.1 ms with them on, and use 0.5 and 0.9
    of a CPU: what the windows must show, each on its side."""

    def __init__(self) -> None:
        self.on = False
        self.now = 0.0
        self.waits = WaitHistogram()
        self.cpu = 0
        self.switches: list[bool] = []

    def switch(self, on: bool) -> None:
        self.on = on
        self.switches.append(on)

    def sleep(self, seconds: float) -> None:
        wait = 100_000 if self.on else 2_000_000
        self.waits.merge(WaitHistogram.from_values([wait] * int(seconds * 100)))
        self.cpu += int(seconds * (0.9 if self.on else 0.5) * 1e9)
        self.now += seconds

    def sample_waits(self) -> WaitHistogram:
        return WaitHistogram(counts=dict(self.waits.counts), sum_ns=self.waits.sum_ns, count=self.waits.count)

    def sample_cpu(self) -> dict[int, int]:
        return {42: self.cpu}


def test_windows_measure_each_side() -> None:
    host = FakeHost()
    windows = compare.run_windows(2, 10.0, host.switch, host.sample_waits, host.sample_cpu, settle_s=1.0,
                                  sleep=host.sleep, clock=lambda: host.now)
    assert host.switches == [True, False, False, True]
    assert [w.on for w in windows] == [True, False, False, True]
    assert all(w.seconds == 10.0 and w.waits.count == 1000 for w in windows)
    summary = compare.summarize(windows)
    on, off = summary["on"], summary["off"]
    assert on["windows"] == off["windows"] == 2 and on["waits"] == 2000
    assert on["cpu_cores"] == 0.9 and off["cpu_cores"] == 0.5
    assert 65 <= on["p50_us"] <= 131 and 1048 <= off["p50_us"] <= 2097  # within the power-of-two bucket
    assert on["spread"]["p99_us"]["min"] == on["spread"]["p99_us"]["max"]
    text = compare.table(summary, windows)
    assert text.splitlines()[1].startswith("intents on") and text.splitlines()[2].startswith("intents off")
    assert "each window" in text and len(text.splitlines()) == 3 + 2 + 1 + 4


def test_pattern_covers_every_intent() -> None:
    intents = [parse_intent({"id": "a", "commandRegex": "^EngineCore_DP[0-9]+$", "priority": 5}),
               parse_intent({"id": "b", "commandRegex": "^llama-server$", "executionTime": 1_000_000})]
    assert pattern(intents) == "(?:^EngineCore_DP[0-9]+$)|(?:^llama-server$)"
