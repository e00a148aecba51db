"""Every documented budget form, and malformed ones."""

import math

import pytest

import autosac
from autosac.core.budget import parse_budget
from autosac.models import build_model

PEAK = 10 * 2**30


@pytest.mark.parametrize(
    "text,expected",
    [
        ("8GiB", 8 * 2**30),
        ("8 GiB", 8 * 2**30),
        ("8gib", 8 * 2**30),
        (" 1.5 GiB ", int(1.5 * 2**30)),
        ("500MB", 500 * 10**6),
        ("500mb", 500 * 10**6),
        ("512MiB", 512 * 2**20),
        ("2TB", 2 * 10**12),
        ("60%", int(PEAK * 0.6)),
        ("12.5 %", int(PEAK * 0.125)),
        ("4096", 4096),
        ("100%", PEAK),
        (4096, 4096),
        (2.0, 2 * 2**30),
        (0.5, 2**29),
    ],
)
def test_accepted_forms(text, expected):
    assert parse_budget(text, PEAK) == expected


@pytest.mark.parametrize(
    "bad",
    ["0", "-1GiB", "abc", "", "8 GiBs", "GiB", "8 G i B", "1e9", "0%", "150%", "--8GB",
     float("nan"), float("inf"), -1.0, 0, -5, True, False, None, [8], "8GiB 2GiB"],
)
def test_malformed_forms_name_the_accepted_ones(bad):
    with pytest.raises(ValueError) as info:
        parse_budget(bad, PEAK)
    msg = str(info.value)
    assert "8GiB" in msg or "over 100%" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("bad", ["-5%", "-1GiB", " -2MB", "-4096"])
def test_a_negative_budget_says_so(bad):  # a new user's "-5%" was "cannot parse"
    with pytest.raises(ValueError, match="is not positive"):
        parse_budget(bad, PEAK)


def test_a_fractional_number_without_a_unit_asks_for_one():
    with pytest.raises(ValueError, match=r"budget '0.5' has no unit \(a bare number is bytes\): write '0.5GiB'"):
        parse_budget("0.5", PEAK)


def test_a_small_whole_number_without_a_unit_is_taken_for_a_missing_percent_sign():
    """"60" would be 60 bytes, which no step fits in: the user meant 60 % (or GiB)."""
    for bad in ("60", "100", "1"):
        with pytest.raises(ValueError, match=rf"budget '{bad}' has no unit and would be {bad} bytes: write '{bad}%'"):
            parse_budget(bad, PEAK)
    assert parse_budget("4096", PEAK) == 4096  # a larger bare number stays bytes, as documented


def test_float_gib_matches_sac_milp_convention():
    assert parse_budget(1.75, PEAK) == math.floor(1.75 * 2**30)


def test_least_is_the_least_feasible_budget_from_stats_the_model_and_the_cli(capsys):
    """``"least"`` plans at the least peak any plan reaches: the budget an
    infeasible request names, with no second profile."""
    import autosac
    from autosac.cli import main
    from autosac.models import build_model

    model, idx = build_model("gpt-tiny", batch=2, seq=64, device="meta")
    stats = autosac.profile(model, idx, target="cpu")
    with pytest.raises(autosac.InfeasibleBudgetError) as e:
        autosac.solve(stats, "1KiB")
    plan = autosac.solve(stats, "least")
    assert plan.budget_bytes == plan.predicted_peak_bytes == e.value.min_feasible_bytes
    assert autosac.solve(stats, " LEAST ").decisions == plan.decisions
    assert autosac.solve(model, "least", example_inputs=idx, target="cpu").budget_bytes == plan.budget_bytes
    with pytest.raises(ValueError, match="a reserve needs a budget in bytes or percent"):
        autosac.solve(stats, "least", reserve="1MiB")
    with pytest.raises(ValueError, match="'least' is found by solving"):
        parse_budget("least", PEAK)
    with pytest.raises(ValueError, match="under torch.compile give the budget as a size"):
        autosac.solve(model, "least", example_inputs=idx, target="cpu", compile="aot_eager")
    assert main(["plan", "--model", "gpt-tiny", "--batch", "2", "--seq", "64", "--target", "cpu",
                 "--budget", "least", "--quiet"]) == 0
    assert "planned peak" in capsys.readouterr().out


def test_reserve_errors_name_the_reserve():
    model, idx = build_model("gpt-tiny", device="cpu", batch=2)
    stats = autosac.profile(model, idx)
    with pytest.raises(ValueError, match="cannot parse reserve 'lots'"):
        autosac.solve(stats, "90%", reserve="lots")
    with pytest.raises(ValueError, match="time_limit_s must be a positive number"):
        autosac.solve(stats, "90%", time_limit_s=-1)


def test_infeasible_message_tells_sizes_that_round_alike_apart():
    from autosac.solver import least_peak
    from autosac.solver.problem import build_problem

    model, idx = build_model("gpt-tiny", device="cpu", batch=2)
    stats = autosac.profile(model, idx)
    least, _ = least_peak(build_problem(stats))
    with pytest.raises(autosac.InfeasibleBudgetError, match=r"bytes\) is below the least reachable peak .* bytes\)"):
        autosac.solve(stats, least - 1)


def test_a_float_up_to_one_over_the_whole_step_warns_that_it_is_gib():
    """0.6 meant as 60 %: read as 0.6 GiB it is above a small step's whole
    peak and the plan would checkpoint nothing without a word."""
    import warnings

    with pytest.warns(UserWarning, match=r"read as 0.6 GiB .* write '60%'"):
        assert parse_budget(0.6, 100 << 20) == int(0.6 * 2**30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_budget(0.6, 2 << 30) == int(0.6 * 2**30)  # a real 0.6 GiB cut of a 2 GiB step
        assert parse_budget(2.0, 100 << 20) == 2 << 30  # 2 GiB is no fraction
        assert parse_budget("60%", 100 << 20) == 60 << 20
        assert parse_budget(0.5, 100 << 20, what="reserve") == 2**29  # headroom, not a budget
