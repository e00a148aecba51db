"""The exact tradeoff curve is the fractional-knapsack optimum; compression only over-estimates."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from autosac.core.curves import compress_curve, curve_ms, exact_curve

items_st = st.lists(st.tuples(st.integers(1, 10_000), st.floats(0, 10, allow_nan=False)), min_size=1, max_size=9)


@settings(max_examples=200, deadline=None)
@given(items_st)
def test_exact_curve_is_convex_and_least_time_at_its_breakpoints(items):
    pts = exact_curve(items)
    slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in zip(pts, pts[1:])]
    assert all(a <= b + 1e-9 for a, b in zip(slopes, slopes[1:]))
    assert pts[-1][0] == sum(b for b, _ in items)
    # at each breakpoint no subset of ops frees as many bytes for less time
    for x, y in pts:
        best = min(
            (sum(items[i][1] for i in combo) for r in range(len(items) + 1)
             for combo in itertools.combinations(range(len(items)), r)
             if sum(items[i][0] for i in combo) >= x),
        )
        assert y <= best + 1e-9


@settings(max_examples=200, deadline=None)
@given(items_st, st.integers(2, 5))
def test_compressed_curve_never_promises_less_time(items, k):
    pts = exact_curve(items)
    small = compress_curve(pts, k)
    assert len(small) <= max(k, 2) and small[0] == pts[0] and small[-1] == pts[-1]
    for x, y in pts:
        assert curve_ms(small, x) >= y - 1e-9


def test_exact_curve_example():
    assert exact_curve([(100, 2.0), (100, 1.0), (0, 5.0)]) == [[0, 0.0], [100, 1.0], [200, 3.0]]
