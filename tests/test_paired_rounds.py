"""``benchmarks/paired_rounds.py``: the interval predict_suite puts around
each measured overhead covers the median as often as it says, and the
verdict reads it right.  Exact, from the binomial -- no timings."""

from __future__ import annotations

import random
import sys
from math import comb
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from paired_rounds import median_interval, paired, ratios, verdict, within  # noqa: E402


def _coverage(n: int, j: int) -> float:
    """P(the j-th least <= the median <= the j-th greatest) of n draws, any continuous distribution."""
    return 1 - 2 * sum(comb(n, i) for i in range(j + 1)) / 2 ** n


@pytest.mark.parametrize("n", [5, 6, 8, 12, 16, 24, 48, 96])
def test_the_interval_is_the_narrowest_order_statistics_covering_the_median_at_its_level(n):
    lo, hi = median_interval([float(i) for i in range(n)], level=0.9)
    j = int(lo)
    assert hi == n - 1 - j
    assert _coverage(n, j) >= 0.9 > _coverage(n, j + 1)  # at the level, and one cut further would not be


def test_the_interval_covers_the_median_as_often_as_it_says():
    rng = random.Random(0)
    hits = sum(lo <= 0.0 <= hi for lo, hi in (median_interval([rng.gauss(0, 1) for _ in range(16)])
                                               for _ in range(3000)))
    assert 0.90 <= hits / 3000 <= 0.95  # 0.923 exactly, for 16 rounds


def test_too_few_rounds_give_their_least_and_greatest_and_none_an_error():
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])


def test_ratios_pair_rounds_and_the_estimate_is_their_median():
    rounds = {"plan": [11.0, 24.0, 13.0], "ref": [10.0, 20.0, 10.0]}
    assert ratios(rounds, "plan", "ref") == pytest.approx([0.1, 0.2, 0.3])
    assert paired(rounds, "plan", "ref") == pytest.approx(0.2)
    assert paired(rounds, "plan", "ref", ratio=False) == pytest.approx(3.0)


def test_the_verdict_says_within_outside_or_that_the_measurement_cannot_tell():
    assert within(0.12, 0.10) and within(0.30, 0.25) and not within(0.31, 0.25)  # 3 points, or 20 %
    assert verdict(0.10, 0.08, 0.12) == "in"
    assert verdict(0.20, 0.08, 0.12) == "out"
    assert verdict(0.142, 0.09, 0.13) == "noise"  # within of +13 %, not of +9 %
    # 20 % relative: +60 % is within target of +50 to +75 %, so of every overhead in +52 to +70
    assert verdict(0.60, 0.52, 0.70) == "in" and verdict(0.60, 0.45, 0.70) == "noise"
    assert verdict(0.0, -0.02, 0.02) == "in" and verdict(0.0, 0.035, 0.05) == "out"


def test_the_report_counts_rows_within_target_and_names_the_worst_against_its_tolerance():
    """predict_suite's table (benchmarks/predict_report.py): the worst row is
    the one furthest out against its own tolerance (3 points, or 20 % of a
    large overhead), not the largest error in points; a failed row counts in
    neither."""
    from predict_report import Row, table

    rows = [Row("a", "compute", "mid", predicted=0.10, measured=0.08, measured_lo=0.07, measured_hi=0.09, kept=True,
                bitwise=True),
            # 8 points high on a +80 % overhead: within its 16-point tolerance, half of it
            Row("b", "dispatch", "least", predicted=0.88, measured=0.80, kept=True, bitwise=True),
            # 3.5 points high on +5 %: outside its 3 points, the worst
            Row("c", "compute", "least", predicted=0.085, measured=0.05, measured_lo=0.045, measured_hi=0.052,
                kept=True, bitwise=False),
            Row("d", "compute", "-", note="failed: RuntimeError")]
    text = table(rows)
    assert "2 of 3 rows within target; worst (against its tolerance): c, compute, least" in text
    assert "(+3.5 points)" in text and "every step bitwise: NO" in text and "Every plan kept its budget: yes" in text
    assert "1 of 2 predictions within target of every overhead in it, 1 of none (c compute least)" in text


def test_a_runs_table_and_host_figures_read_back_as_printed(tmp_path):
    """reprice_suite reads a predict_suite result file: its rows' predicted and
    measured overheads, and the HostCosts printed at its foot, figure for figure."""
    from predict_report import Row, table
    from reprice_suite import parse_figures, read_run

    from autosac.core.host import HostCosts

    figures = HostCosts(op_us=11.86, checkpoint_call_us=165.49, call_gap_us=14.63, state_item_us=0.2574,
                        backward_op_us=None, checkpoint_us_per_mib=150.252)
    rows = [Row("mlp", "dispatch", "mid", 0.162, 0.205, measured_lo=0.189, measured_hi=0.223, kept=True, bitwise=True),
            Row("hf-opt", "compute", "least", 0.131, 0.133, kept=True, bitwise=True)]
    path = tmp_path / "run.md"
    path.write_text(table(rows) + "\n\n(2 models)\n\nhost figures: " + str(figures) + "\n")
    got, at_foot = read_run(path)
    assert got == {("mlp", "dispatch", "mid"): (0.162, 0.205), ("hf-opt", "compute", "least"): (0.131, 0.133)}
    assert parse_figures(at_foot) == figures
    with pytest.raises(ValueError, match="not HostCosts"):
        parse_figures("op_us=1.0")
