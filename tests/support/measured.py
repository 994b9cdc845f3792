"""What a benchmark's smoke test may say of its timings: that each was measured, never how long.

Wall-clock numbers are the benchmark's claim, printed in its table. A test asserting one, even
only that it is positive, fails on a loaded machine: some are differences of two timed runs (a
decode step as generating S + n tokens less generating S), which another process's load turns
negative.
"""

from __future__ import annotations

import math
from typing import Iterable


def assert_measured(values: Iterable[float]) -> None:
    """Each of `values` (at least one) is a finite number: the benchmark timed something."""
    values = list(values)
    assert values, "the benchmark reported no timing"
    wrong = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))
             or not math.isfinite(v)]
    assert not wrong, f"timings that are not finite numbers: {wrong}"
