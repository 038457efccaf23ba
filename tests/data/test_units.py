"""parse_bytes, format_bytes and budgets: every accepted form and every rejected one."""

from __future__ import annotations

import pytest

from memfit.data.units import Budget, format_bytes, parse_budget, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        (1024, 1024),
        (0, 0),
        ("0", 0),
        ("7", 7),
        (" 7 ", 7),
        ("12B", 12),
        ("2KB", 2_000),
        ("500MB", 500_000_000),
        ("3GB", 3_000_000_000),
        ("1TB", 10**12),
        ("2KiB", 2048),
        ("3MiB", 3 * 2**20),
        ("3GiB", 3 * 2**30),
        ("1TiB", 2**40),
        ("1.5 gib", 3 * 2**29),
        ("0.5KiB", 512),
        ("1e3", 1000),
        ("1e3 kb", 10**6),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text", ["abc", "", "3 GiBs", "GiB", "-1GB", "1.2.3", "3 Gi B", "nan", "inf", "0x10"]
)
def test_parse_bytes_rejects_text_and_names_the_units(text):
    with pytest.raises(ValueError, match=r"cannot read .* KiB, MiB, GiB, TiB .* e.g. '3GiB'"):
        parse_bytes(text)


def test_parse_bytes_rejects_negative_and_bool():
    with pytest.raises(ValueError, match="cannot be negative, got -1"):
        parse_bytes(-1)
    for flag in (True, False):
        with pytest.raises(ValueError, match="not True|not False"):
            parse_bytes(flag)


@pytest.mark.parametrize(
    "size, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (3 * 2**20, "3.00 MiB"),
        (3 * 2**30, "3.00 GiB"),
        (2**40, "1.00 TiB"),
        (2**50, "1024.00 TiB"),
        (-2048, "-2.00 KiB"),
        (12.7, "13 B"),
    ],
)
def test_format_bytes(size, text):
    assert format_bytes(size) == text


@pytest.mark.parametrize(
    "budget, expected",
    [
        (None, None),
        (100, Budget(bytes=100)),
        ("3GiB", Budget(bytes=3 * 2**30)),
        (" 500MB ", Budget(bytes=500_000_000)),
        ("1", Budget(fraction=1.0)),
        (1, Budget(fraction=1.0)),
        (2, Budget(bytes=2)),
        ("2", Budget(bytes=2)),
        ("1e9", Budget(bytes=10**9)),
        ("3_000_000_000", Budget(bytes=3 * 10**9)),
        ("4096", Budget(bytes=4096)),
        (0.5, Budget(fraction=0.5)),
        (1.0, Budget(fraction=1.0)),
        ("0.5", Budget(fraction=0.5)),
        ("1.0", Budget(fraction=1.0)),
        (Budget(bytes=7), Budget(bytes=7)),
    ],
)
def test_parse_budget(budget, expected):
    assert parse_budget(budget) == expected


@pytest.mark.parametrize(
    "budget",
    [-1, 0, 0.0, -0.5, "0", "0.0", "-1", "0GiB", "-3GiB", "abc", "", True, False,
     [1], float("nan"), "nan", float("inf"), "inf"],
)  # fmt: skip
def test_parse_budget_rejects_and_names_the_accepted_forms(budget):
    with pytest.raises(
        ValueError, match=r"cannot use .* as a budget: give bytes .* fraction in \(0, 1\]"
    ):
        parse_budget(budget)


def test_budget_needs_exactly_one_positive_form():
    with pytest.raises(ValueError, match="exactly one of bytes= and fraction="):
        Budget()
    with pytest.raises(ValueError, match="exactly one of bytes= and fraction="):
        Budget(bytes=1, fraction=0.5)
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 0.0"):
        Budget(fraction=0.0)
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 2"):
        Budget(fraction=2)
    with pytest.raises(ValueError, match="must be positive, got 0 bytes"):
        Budget(bytes=0)


def test_budget_to_bytes_and_text():
    assert Budget(bytes=123).to_bytes(10**9) == 123
    assert Budget(fraction=0.5).to_bytes(1001) == 500
    assert str(Budget(bytes=3 * 2**30)) == "3.00 GiB"
    assert str(Budget(fraction=0.25)) == "0.25 of the unplanned peak"


@pytest.mark.parametrize("budget, whole", [(1.5, "3_000_000_000"), ("2.5", "3_000_000_000"),
                                           (2.0, "2"), (3e9, "3_000_000_000")])
def test_a_float_above_one_is_refused_saying_to_use_an_int_or_units(budget, whole):
    with pytest.raises(ValueError, match=rf"above 1 a budget is bytes, given as an int \({whole}\) "
                                         r"or a size with units \('3GiB'\)"):
        parse_budget(budget)

