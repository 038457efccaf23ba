"""The first-call bench's pieces that need no timing: the table's split of the first iteration,
the warm/cold planning goal per memfit loop, and the goal on ``memfit.plan``'s added CPU."""

from bench import first_call


def measured(first_s=10.0, planning_s=None, made=None, cached=None):
    return {"launch_s": first_s + 5, "first_s": first_s, "trace_s": 2.0, "backend_s": 6.0,
            "planning_s": planning_s, "analysis_s": None if planning_s is None else 1.0,
            "plans_made": made, "plans_cached": cached, "steady_s": 0.25}


def cells(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()[2:]]


def test_the_table_shows_what_the_backend_and_trace_leave_and_the_plans():
    text = first_call.loop_table([("memfit aot_eager", "cold", measured(planning_s=1.5, made=1,
                                                                         cached=0)),
                                  ("torch.compile inductor", "warm", measured())])
    assert cells(text) == [
        ["memfit aot_eager", "cold", "15.00 s", "10.00 s", "2.00 s", "6.00 s", "1.50 s",
         "1.00 s", "2.00 s", "1 / 0", "250 ms"],
        ["torch.compile inductor", "warm", "15.00 s", "10.00 s", "2.00 s", "6.00 s", "-", "-",
         "2.00 s", "-", "250 ms"]]


def test_the_warm_goal_is_judged_per_memfit_loop_from_its_planning_seconds():
    rows = [("memfit aot_eager", "cold", measured(planning_s=2.0)),
            ("memfit aot_eager", "warm", measured(planning_s=0.1)),
            ("memfit inductor", "cold", measured(planning_s=1.0)),
            ("memfit inductor", "warm", measured(planning_s=0.2)),
            ("torch.compile aot_eager", "cold", measured())]
    met, not_met = first_call.warm_goal_lines(rows)
    assert met.startswith("Goal (memfit aot_eager") and "5.0%: **met**" in met
    assert not_met.startswith("Goal (memfit inductor") and "20.0%: **not met**" in not_met


def test_the_plan_goal_is_autos_cpu_beyond_keeps():
    rows = {"keep": {"cpu_s": 60.0, "wall_s": 90.0, "solver": "keep"},
            "auto": {"cpu_s": 69.5, "wall_s": 99.0, "solver": "checkpoint"}}
    assert "9.5 s: **met**" in first_call.plan_lines(rows)[-1]
    rows["auto"]["cpu_s"] = 71.0
    assert "11.0 s: **not met**" in first_call.plan_lines(rows)[-1]
