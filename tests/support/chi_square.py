"""Chi-square goodness-of-fit for sampling tests, without scipy (not a test dependency).

`p_value` is the chi-square distribution's survival function: the regularised upper incomplete
gamma function Q(df / 2, statistic / 2), by its series below a + 1 and its continued fraction
above (Numerical Recipes' gser and gcf), to about 1e-14: far finer than any alpha a test uses.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

_EPS = 1e-15
_TINY = 1e-300


def p_value(statistic: float, df: int) -> float:
    """P(X >= statistic) for X chi-square distributed with `df` degrees of freedom."""
    a, x = df / 2, statistic / 2
    if x <= 0:
        return 1.0
    scale = math.exp(-x + a * math.log(x) - math.lgamma(a))
    if x < a + 1:  # the series for the lower function P converges fast here
        term = total = 1 / a
        n = a
        while abs(term) > abs(total) * _EPS:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1 - total * scale)
    # Lentz's method for the continued fraction of Q.
    b = x + 1 - a
    c, d = 1 / _TINY, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = d if abs(d) > _TINY else _TINY
        c = b + an / c
        c = c if abs(c) > _TINY else _TINY
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < _EPS:
            break
    return h * scale


def statistic(groups: Iterable[tuple[Sequence[int], Sequence[float]]]) -> tuple[float, int]:
    """The chi-square statistic and degrees of freedom of independent groups, each `(counts,
    probs)`: a token's observed count and its expected probability, over the vocabulary.

    Cells of probability 0 are left out of the statistic, but a count there fails at once:
    a token the distribution cannot give was given.
    """
    total, df = 0.0, 0
    for counts, probs in groups:
        n = sum(counts)
        impossible = [t for t, (c, p) in enumerate(zip(counts, probs)) if c and p <= 0]
        assert not impossible, f"tokens {impossible} have probability 0 but were drawn"
        cells = [(c, n * p) for c, p in zip(counts, probs) if p > 0]
        total += sum((c - e) ** 2 / e for c, e in cells)
        df += len(cells) - 1
    return total, df
