"""The planning-time section measures every shape at every budget and judges the goal."""

from bench import planning


def test_planning_section_on_small_graphs():
    lines = []
    section = planning.planning_section(lines.append, forward_ops=80)
    assert section.startswith(planning.PLANNING_TITLE)
    rows = [line for line in section.splitlines() if line.startswith("| ") and "graph" not in line]
    assert len(rows) == len(planning.shapes(80)) * len(planning.FRACTIONS)
    verdicts = [row.strip("| ").split("|")[-1].strip() for row in rows]
    assert verdicts == ["met"] * len(rows)  # 160-op graphs plan in milliseconds
    assert "met on every row." in section
    assert len(lines) == len(rows)


def test_shapes_have_the_size_asked():
    for build in planning.shapes(5000).values():
        graph = build()
        assert 9500 <= len(graph.ops) <= 10500
