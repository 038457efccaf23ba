"""The compile-budget bench's goal: memfit inductor at torch.compile's measured peak, no slower
and within that peak."""

from bench import compile_budget


def rows(memfit_peak: str, memfit_ratio: str) -> list[tuple]:
    compiled = ("cnn", "0.5", "torch.compile", "10.92 MiB", "36.3 ms", "1.00x", "bitwise")
    planned = ("cnn", "0.5", "memfit", memfit_peak, "35.0 ms", memfit_ratio, "bitwise")
    return [compiled, planned]


def test_the_goal_asks_for_speed_and_the_peak():
    assert "cnn: memfit 35.0 ms at 10.82 MiB" in compile_budget.verdict(rows("10.82 MiB", "0.96x"))
    assert ": met." in compile_budget.verdict(rows("10.82 MiB", "0.96x"))
    assert "over its peak): **not met**" in compile_budget.verdict(rows("10.95 MiB", "0.96x"))
    assert "**not met**" in compile_budget.verdict(rows("10.82 MiB", "1.02x"))
    assert ": met." in compile_budget.verdict(rows("900.00 KiB", "0.90x"))


def test_a_model_memfit_could_not_run_is_not_measured():
    refused = ("cnn", "0.5", "memfit", "-", "-", "-", "does not fit: smallest 10.93 MiB")
    assert "cnn: not measured" in compile_budget.verdict([rows("1 MiB", "1x")[0], refused])
