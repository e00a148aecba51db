"""Parse a memory budget: "8GiB", "500MB", "60%", an int of bytes, a float of
GiB -- or "least", the least peak any plan reaches, which the solver finds."""

from __future__ import annotations

import math
import re
import warnings

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*|%)\s*$", re.IGNORECASE)
_FORMS = '"8GiB", "500MB", "60%" (of the unconstrained peak), "least" (the least feasible),'
ACCEPTED = f"a string like {_FORMS} an int of bytes, or a float of GiB"
# what a string may say (the command line's --budget is one): whole bytes, no float of GiB
ACCEPTED_TEXT = f'{_FORMS} or whole bytes such as "100000000"'
LEAST = "least"


def is_least(budget) -> bool:
    """Whether ``budget`` asks for the least feasible peak (``"least"``, any case)."""
    return isinstance(budget, str) and budget.strip().lower() == LEAST


def parse_budget(budget: str | int | float, baseline_peak_bytes: int, what: str = "budget") -> int:
    """Return the budget in bytes.

    Args:
        budget: ``"8GiB"``/``"8 gib"``/``"500MB"`` (binary and decimal units; a
            bare whole number, ``"4096"``, is bytes),
            ``"60%"`` of ``baseline_peak_bytes``, an ``int`` of bytes, or a
            ``float`` of GiB (as PyTorch's ``sac_milp`` takes it).
        baseline_peak_bytes: the unconstrained peak, for percentages.
        what: the name used in error messages (``"reserve"`` for headroom).

    Raises:
        ValueError: anything else, or a budget that is not positive, naming the accepted forms.

    Example::

        >>> parse_budget("1.5GiB", 0)
        1610612736
        >>> parse_budget("50%", 1000)
        500
    """
    if isinstance(budget, bool):
        raise ValueError(f"{what} {budget!r} is a bool: use {ACCEPTED}")
    if is_least(budget):
        raise ValueError(f"{what} 'least' is found by solving (autosac.solve(model_or_stats, 'least')): "
                         "here give a size like '2GiB'")
    if isinstance(budget, int):
        value = budget
    elif isinstance(budget, float):
        if not math.isfinite(budget):
            raise ValueError(f"{what} {budget!r} is not finite: use {ACCEPTED}")
        value = int(budget * 2**30)
    elif isinstance(budget, str):
        if budget.strip().startswith("-") and _PATTERN.match(budget.strip()[1:]):  # "-5%": the pattern takes no sign
            raise ValueError(f"{what} {budget!r} is not positive: use {ACCEPTED}")
        m = _PATTERN.match(budget)
        if not m or m.group(2).lower() not in (*_UNITS, "%"):
            accepted = ACCEPTED_TEXT if what == "budget" else ACCEPTED_TEXT.replace(' "least" (the least feasible),', "")
            raise ValueError(f"cannot parse {what} {budget!r}: use {accepted}")
        number, unit = float(m.group(1)), m.group(2).lower()
        if unit == "" and not number.is_integer():  # a string without a unit is bytes: whole ones
            raise ValueError(f"{what} {budget!r} has no unit (a bare number is bytes): write '{m.group(1)}GiB', "
                             f"'{m.group(1)}MB' or '{m.group(1)}%'")
        if unit == "" and 0 < number <= 100:  # "60" meant as 60 %, not 60 bytes: no step fits in 100 bytes
            raise ValueError(f"{what} {budget!r} has no unit and would be {int(number)} bytes: write "
                             f"'{m.group(1)}%' of the unconstrained peak, or a size such as '{m.group(1)}GiB'")
        if unit == "%":
            if number > 100:
                raise ValueError(f"{what} {budget!r} is over 100% of the unconstrained peak: nothing to plan")
            value = int(baseline_peak_bytes * number / 100)
        else:
            value = int(number * _UNITS[unit])
    else:
        raise ValueError(f"{what} of type {type(budget).__name__} is not understood: use {ACCEPTED}")
    if value <= 0:
        raise ValueError(f"{what} {budget!r} is not positive: use {ACCEPTED}")
    if what == "budget" and isinstance(budget, float) and budget <= 1 and 0 < baseline_peak_bytes <= value:
        # 0.6 meant as 60 %: as GiB it is above the whole step, and the plan would silently checkpoint nothing
        warnings.warn(f"autosac: {what} {budget!r} is read as {budget!r} GiB (a float is GiB), above this step's "
                      f"unconstrained peak ({format_bytes(baseline_peak_bytes)}): nothing needs checkpointing -- "
                      f"for a share of the peak write '{budget * 100:g}%'", stacklevel=2)
    return value


def format_bytes(n: float, exact: bool = False) -> str:
    """``1.50 GiB``-style rendering for tables and messages; ``exact`` adds the byte count."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            text = f"{n / size:.2f} {unit}"
            return f"{text} ({int(n):,} bytes)" if exact else text
    return f"{int(n)} B"
