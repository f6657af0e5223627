"""The scheduling benchmarks' lab guest: multi-threaded TCG unless asked otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.bench.benchlab import BENCH_TCG_THREAD
from tests.vm import matrix
from tests.vm.lab import Lab


@pytest.fixture
def bench_lab(request: pytest.FixtureRequest) -> Iterator[Lab]:
    """A guest of its own for a scheduling benchmark (default spec 7.3/2cpu), under BENCH_TCG_THREAD."""
    spec = getattr(request, "param", matrix.DEFAULT)
    with matrix.make_lab("plain", spec, tcg_thread=BENCH_TCG_THREAD) as lab:
        yield lab
