"""Reading a Prometheus exposition the way a scraper does (tests of the metrics endpoint share this)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def parse_samples(text: str) -> Samples:
    """sample name -> {sorted label pairs -> value}"""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def scrape(host: str, port: int) -> Samples:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
        return parse_samples(resp.read().decode())


def sample_lines(samples: Samples, name: str, prefix: bool = False) -> list[str]:
    """The samples of metric `name` (or of every metric whose name starts with it) as `name value` lines,
    labels left out: what a guest script prints for the test to read."""
    return [f"{n} {value!r}" for n, series in samples.items()
            if (n.startswith(name) if prefix else n == name) for value in series.values()]
