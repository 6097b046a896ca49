"""The benchmark suite's small helpers: percentiles and the reading of ``-X importtime`` reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

from importtime import ImportTime, parse_importtime  # noqa: E402
from stats import percentile, summary  # noqa: E402


def test_percentile_is_the_nearest_rank():
    samples = [float(n) for n in range(1, 21)]  # 1..20

    assert percentile(samples, 0.95) == 19.0
    assert percentile(samples, 0.5) == 10.0
    assert percentile(samples, 1.0) == 20.0
    assert percentile(samples, 0.0) == 1.0


def test_percentile_of_one_sample_is_that_sample():
    assert percentile([7.5], 0.95) == 7.5


def test_percentile_refuses_no_samples_and_fractions_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 0.5)
    with pytest.raises(ValueError):
        percentile([1.0], 1.5)


def test_summary_gives_median_p95_and_extremes():
    assert summary([3.0, 1.0, 2.0]) == {"p50": 2.0, "p95": 3.0, "min": 1.0, "max": 3.0}


def test_importtime_report_is_read_with_depths_and_other_lines_skipped():
    report = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:       144 |        144 |   _io",
        "import time:       311 |        808 | _frozen_importlib_external",
        "some warning printed by a module",
        "import time:      1200 |      45000 |     ferry.scheduler.filters",
        "import time:        20 |      90000 | app",
    ])

    assert parse_importtime(report) == [
        ImportTime("_io", 144, 144, 1),
        ImportTime("_frozen_importlib_external", 311, 808, 0),
        ImportTime("ferry.scheduler.filters", 1200, 45000, 2),
        ImportTime("app", 20, 90000, 0),
    ]
