"""The tighten loop: targets lowered by the excess until the exact peak fits, within its rounds."""

from memfit.planning.tighten import by_the_excess, tighten


def overshooting(overshoot_bytes: int, calls: list[int]):
    """A planner whose exact peak is its target plus ``overshoot_bytes``; records its targets."""
    def plan_at(target_bytes: int) -> tuple[str, int] | None:
        calls.append(target_bytes)
        return f"plan@{target_bytes}", target_bytes + overshoot_bytes
    return plan_at


def test_lowers_the_target_by_the_excess_until_it_fits():
    calls: list[int] = []
    assert tighten(100, overshooting(30, calls), rounds=6) == "plan@70"
    assert calls == [100, 70]


def test_gives_up_after_its_rounds_or_when_nothing_is_planned():
    calls: list[int] = []

    def never_drops(target_bytes: int) -> tuple[str, int]:
        calls.append(target_bytes)
        return "plan", 150  # every round over by the same excess
    assert tighten(100, never_drops, rounds=3) is None
    assert calls == [100, 50, 0]
    assert tighten(100, lambda target_bytes: None, rounds=6) is None
    refused: list[int] = []

    def refuses_below_80(target_bytes: int) -> tuple[str, int] | None:
        refused.append(target_bytes)
        return None if target_bytes < 80 else ("plan", target_bytes + 30)
    assert tighten(100, refuses_below_80, rounds=6) is None
    assert refused == [100, 70]


def test_start_and_policy_are_the_callers():
    calls: list[int] = []
    seen: list[tuple[int, int, str, str | None]] = []

    def halve(target_bytes: int, excess_bytes: int, planned: str, previous: str | None) -> int:
        seen.append((target_bytes, excess_bytes, planned, previous))
        return target_bytes // 2

    assert tighten(100, overshooting(70, calls), rounds=6, start_bytes=80,
                   next_target=halve) == "plan@20"
    assert calls == [80, 40, 20]
    assert seen == [(80, 50, "plan@80", None), (40, 10, "plan@40", "plan@80")]
    assert by_the_excess(100, 30, "any", None) == 70
