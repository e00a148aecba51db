"""The recompute tradeoff curve of one module: recompute ms vs bytes discarded.

Discarding the op outputs with the lowest ms/byte first gives, for every amount
of memory, the least recompute time (a fractional knapsack), so the curve is
convex and piecewise linear with one breakpoint per op.  Long curves may be
compressed to fewer breakpoints; compression keeps a subset of the exact
breakpoints and joins them with chords, which for a convex curve lie on or above
it: the compressed curve never promises less recompute than the exact one.
"""

from __future__ import annotations


def exact_curve(items: list[tuple[int, float]]) -> list[list[float]]:
    """Points ``[bytes, ms]`` from ``[0, 0]``, one per item, cheapest ms/byte first.

    ``items`` are ``(bytes, ms)``; items with no bytes free nothing and are dropped.

    Example::

        >>> exact_curve([(100, 2.0), (100, 1.0)])
        [[0, 0.0], [100, 1.0], [200, 3.0]]
    """
    useful = sorted((it for it in items if it[0] > 0), key=lambda it: it[1] / it[0])
    points = [[0, 0.0]]
    b, t = 0, 0.0
    for nbytes, ms in useful:
        b += nbytes
        t += ms
        points.append([b, t])
    return _merge_collinear(points)


def _merge_collinear(points: list[list[float]]) -> list[list[float]]:
    out = [points[0]]
    for p in points[1:]:
        if len(out) >= 2:
            (x0, y0), (x1, y1) = out[-2], out[-1]
            # same slope as the previous segment: extend it instead of adding a point
            if abs((y1 - y0) * (p[0] - x1) - (p[1] - y1) * (x1 - x0)) <= 1e-12 * max(1.0, p[1]) * max(1, p[0]):
                out[-1] = p
                continue
        out.append(p)
    return out


def compress_curve(points: list[list[float]], max_points: int) -> list[list[float]]:
    """Keep at most ``max_points`` of the exact breakpoints (ends always kept),
    choosing greedily the one farthest above the current chords.

    The result upper-bounds the exact convex curve everywhere.

    Example::

        >>> pts = exact_curve([(1, i) for i in range(1, 50)])
        >>> len(compress_curve(pts, 8)) <= 8
        True
    """
    if len(points) <= max_points:
        return [list(p) for p in points]
    keep = {0, len(points) - 1}
    while len(keep) < max_points:
        ordered = sorted(keep)
        best, best_gap = None, 0.0
        for a, b in zip(ordered, ordered[1:]):
            (xa, ya), (xb, yb) = points[a], points[b]
            for i in range(a + 1, b):
                x, y = points[i]
                chord = ya + (yb - ya) * (x - xa) / (xb - xa)
                if chord - y > best_gap:
                    best, best_gap = i, chord - y
        if best is None:
            break
        keep.add(best)
    return [list(points[i]) for i in sorted(keep)]


def curve_ms(points: list[list[float]], nbytes: float) -> float:
    """Recompute ms to discard ``nbytes`` on a piecewise-linear curve (clamped to its ends)."""
    if nbytes <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if nbytes <= x1:
            return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)
    return points[-1][1]
