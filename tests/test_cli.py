"""The command line: plan prints the expected rows, show round-trips, bad arguments are clear,
and the demo's core reports identical gradients within the budget at a tiny size."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys

import pytest

from memfit.cli import build_parser, main, terminal_width
from memfit.data.plan import Plan
from memfit.data.tables import fit_table
from memfit.data.timeline import Timeline
from memfit.data.units import parse_budget

MLP = ["--model", "mlp", "--model-arg", "depth=8", "--model-arg", "width=32", "--batch", "512"]


def test_plan_prints_the_expected_rows(capsys, tmp_path):
    saved = tmp_path / "plan.json"
    assert main(["plan", *MLP, "--budget", "0.6", "--hardware", "h100-pcie", "--strategy",
                 "swap", "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "mlp, batch 512:" in out and "hardware h100-pcie" in out
    assert "| unplanned" in out and "| swap (predicted)" in out
    assert "swapped (" in out and "re-runs:" in out and "by module" in out
    assert "what if the budget were" in out
    plan = Plan.load(saved)
    assert plan.strategy == "swap" and plan.swapped


def test_plan_with_a_budget_defaults_to_auto(capsys, tmp_path):
    saved = tmp_path / "plan.json"
    assert main(["plan", *MLP, "--budget", "0.6", "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(saved)
    assert plan.strategy == "auto" and plan.params["solver"] in plan.params["candidates"]
    assert "| auto (predicted)" in out and "candidates={" in out
    assert plan.explanation is not None and plan.explanation.peak_bytes <= plan.budget_bytes


def test_plan_keep_without_budget_swaps_nothing(capsys):
    assert main(["plan", *MLP]) == 0
    out = capsys.readouterr().out
    assert "strategy 'keep'" in out and "swapped:" not in out


def test_plan_below_the_minimum_is_a_clear_error(capsys):
    assert main(["plan", *MLP, "--budget", "0.01"]) == 2
    assert "cannot fit" in capsys.readouterr().err


def test_plan_unknown_parameter_is_a_clear_error(capsys):
    assert main(["plan", *MLP, "--budget", "0.6", "--param", "nonsense=1"]) == 2
    assert "unknown parameter" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "vgg"], "invalid choice: 'vgg'"),
    (["plan", "--model", "mlp", "--autocast", "fp8"], "invalid choice: 'fp8'"),
    (["plan"], "the following arguments are required: --model"),
    (["plan", "--model", "mlp", "--param", "lb"], "expected key=value"),
    (["demo", "--steps", "0"], "must be a positive integer"),
    ([], "the following arguments are required: COMMAND"),
])
def test_bad_arguments_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_show_round_trip(capsys, tmp_path):
    timeline = Timeline("simulated", peak_bytes=5 * 2**20, step_time_s=0.25,
                        memory_labels=("a", "b", "c"), memory_bytes=(2**20, 5 * 2**20, 2**20),
                        peak_label="b", meta={"graph": "toy", "strategy": "swap"})
    timeline.save(tmp_path / "t.json")
    png = tmp_path / "t.png"
    assert main(["show", str(tmp_path / "t.json"), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "simulated timeline of toy, strategy 'swap'" in out
    assert "peak 5.00 MiB at b" in out and "3 actions" in out
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("content, message", [
    (json.dumps({"hello": 1}), "is neither a memfit Timeline JSON .* nor a Plan JSON"),
    (json.dumps([1, 2]), "is neither a memfit Timeline JSON .* nor a Plan JSON"),
    ("not json", "cannot read .*x.json: Expecting value"),
    (json.dumps({"format": "memfit.plan", "version": 1, "strategy": "keep", "decisions": {}}),
     r"lacks the field\(s\) \['graph_hash'\]"),
])
def test_show_rejects_a_file_that_is_neither_a_timeline_nor_a_plan(capsys, tmp_path, content,
                                                                   message):
    (tmp_path / "x.json").write_text(content)
    assert main(["show", str(tmp_path / "x.json")]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_show_explains_a_saved_plan(capsys, tmp_path):
    saved = tmp_path / "plan.json"
    assert main(["plan", *MLP, "--budget", "0.8", "--strategy", "checkpoint", "--hardware", "cpu",
                 "--save", str(saved)]) == 0
    capsys.readouterr()
    assert main(["show", str(saved), "--rows", "0"]) == 0
    out = capsys.readouterr().out
    plan = Plan.load(saved)
    assert out.startswith(f"plan of strategy 'checkpoint' for graph {plan.graph_hash}, "
                          f"hardware cpu: {len(plan.decisions)} decisions (0 Swap, "
                          f"{len(plan.recomputed)} Recompute")
    assert plan.explain(width=terminal_width(), rows=None) in out
    assert plan.explanation.rows and all(f"| {row.tensor} " in out for row in plan.explanation.rows)
    assert main(["show", str(saved), "--png", str(tmp_path / "p.png")]) == 2
    assert "is a plan, which holds no memory curve" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_wide_tables_turn_on_their_side():
    headers, rows = ("run", "a long column name", "another long one"), [("keep", 1, 2)]
    assert fit_table(headers, rows, 200).splitlines()[0].startswith("| run")
    turned = fit_table(headers, rows, 30)
    assert turned.splitlines()[0].split("|")[2].strip() == "keep"
    assert "a long column name" in turned


@pytest.mark.slow
def test_demo_core_is_sound_at_a_tiny_size(tmp_path):
    from memfit.demo import DemoConfig, demo_report, run_demo, write_outputs

    config = DemoConfig.quick(layers=2, width=32, heads=2, vocab=64, sequence=128, batch_size=2,
                              steps=2)
    result = run_demo(config)
    assert result.gradients_identical and result.losses_identical and result.weights_identical
    assert result.planned.peak_bytes <= result.budget_bytes < result.unplanned.peak_bytes
    assert result.ok
    report = demo_report(result, width=200)
    assert "gradients identical after step 1 (torch.equal, every parameter): yes" in report
    paths = write_outputs(result, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths)
    assert Timeline.load(tmp_path / "swap.json").meta["measured_peak_bytes"] \
        == result.planned.peak_bytes
    unplanned = Timeline.load(tmp_path / "unplanned-predicted.json")  # the plot's unplanned curve
    assert unplanned.source == "simulated" and unplanned.memory_bytes
    assert unplanned.peak_bytes > Timeline.load(tmp_path / "swap.json").peak_bytes
    assert "nominal figures not measured on this machine" in report  # why times differ


@pytest.mark.parametrize("python, typed", [(1, "1"), (1.0, "1.0"), (0.5, "0.5"), (4096, "4096"),
                                           (3 * 2**30, "3GiB"), (2, "2")])
def test_python_and_the_command_line_read_a_budget_alike(python, typed):
    """``budget=1`` in Python and ``--budget 1`` on the command line both mean the whole peak."""
    args = build_parser().parse_args(["plan", "--model", "mlp", "--budget", typed])
    assert parse_budget(args.budget) == parse_budget(python)
    assert parse_budget(1).to_bytes(10**9) == 10**9  # 100% of the peak, not one byte


def test_plan_reads_a_saved_hardware_profile(capsys, tmp_path):
    """A profile saved as JSON (one measured on the target) plans as a built-in one does; a
    bad file is refused with the field it breaks."""
    from memfit.data.hardware import PROFILES

    profile = tmp_path / "measured.json"
    PROFILES["a100"].with_(name="measured-a100").save(profile)
    assert main(["plan", *MLP, "--budget", "0.6", "--hardware", str(profile)]) == 0
    assert "hardware measured-a100" in capsys.readouterr().out
    profile.write_text(json.dumps({**PROFILES["a100"].to_json(), "duplex": "yes"}))
    with pytest.raises(SystemExit):
        main(["plan", *MLP, "--hardware", str(profile)])
    assert "field 'duplex' must be a boolean" in capsys.readouterr().err


def test_host_bytes_on_the_command_line_limits_the_swaps(tmp_path, capsys):
    """``--host-bytes 0``: the plan that swapped with the profile's host recomputes instead;
    ``none`` lifts the limit; a bad size fails as an argument."""
    from memfit.data.plan import Plan

    saved = tmp_path / "plan.json"
    argv = ["plan", *MLP, "--budget", "0.6", "--hardware", "h100-pcie", "--save", str(saved)]
    assert main([*argv, "--host-bytes", "none"]) == 0
    assert Plan.load(saved).swapped
    assert main([*argv, "--host-bytes", "0"]) == 0
    limited = Plan.load(saved)
    assert not limited.swapped and (limited.recomputed or limited.reruns)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv, "--host-bytes", "lots"])
    assert "--host-bytes" in capsys.readouterr().err


def test_max_batch_size_prints_the_frontier(capsys):
    argv = ["max-batch-size", "--model", "mlp", "--model-arg", "depth=2", "--model-arg",
            "width=8", "--budget", "1GiB", "--hardware", "cpu", "--max-batch", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fastest batch: 16 under 1.00 GiB" in out and "max_batch=16 fits" in out
    assert re.search(r"\| batch +\| peak +\| step +\| samples/s", out)
    assert main([*argv, "--objective", "largest"]) == 0
    assert "largest batch: 16" in capsys.readouterr().out


@pytest.mark.slow
def test_autocast_plans_the_targets_graph(capsys, tmp_path):
    """--autocast bf16 plans another graph than float32 (CUDA's autocast policy), for plan and
    for max-batch-size."""
    gpt2 = ["--model", "gpt2", "--model-arg", "layers=1", "--model-arg", "width=32",
            "--model-arg", "sequence=32", "--hardware", "h100-sxm"]
    hashes = []
    for extra in ([], ["--autocast", "bf16"]):
        saved = tmp_path / f"plan{len(hashes)}.json"
        assert main(["plan", *gpt2, "--save", str(saved), *extra]) == 0
        hashes.append(Plan.load(saved).graph_hash)
    assert hashes[0] != hashes[1]
    argv = ["max-batch-size", *gpt2, "--budget", "1GiB", "--max-batch", "4", "--autocast",
            "fp16"]
    assert main(argv) == 0
    assert "fastest batch: 4 under 1.00 GiB" in capsys.readouterr().out


# ---- bad arguments fail before torch is imported -------------------------------------------------

FAST_ERRORS = [  # (arguments, what the error says), each answered with torch blocked
    (["plan", "--model", "mlp", "--hardware", "nope"], r"unknown hardware profile 'nope': use one "
                                                       r"of \['a100', 'cpu'"),
    (["plan", "--model", "mlp", "--budget", "1.5"], "above 1 a budget is bytes, given as an int"),
    (["plan", "--model", "mlp", "--budget", "lots"], "cannot use 'lots' as a budget"),
    (["max-batch-size", "--model", "mlp", "--budget", "0.5"], "--budget must be bytes"),
    (["max-batch-size", "--model", "mlp", "--budget", "1GiB", "--objective", "most"],
     "invalid choice: 'most'"),
    (["plan", "--model", "vgg"], "invalid choice: 'vgg'"),
    (["plan", "--model", "mlp", "--strategy", "nope"], "unknown strategy 'nope': use one of"),
    (["plan", "--model", "mlp", "--budget", "0.5", "--param", "nonsense=1"], "unknown parameter"),
    (["plan", "--model", "gpt2", "--model-arg", "depth=3"], "unknown --model-arg 'depth' for "
                                                            "gpt2: valid keys .* are layers=4,"),
    (["plan", "--model", "mlp", "--model-arg", "width=wide"], "width='wide' for mlp: expected "
                                                              "a value of type int, like "
                                                              "width=256"),
]

BLOCKED = """
import sys
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, _Blocker())
import contextlib, io, json
from memfit.cli import main
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exited:
            code = exited.code
    print(json.dumps([code, err.getvalue()]))
assert "torch" not in sys.modules
"""


def test_bad_arguments_fail_before_torch_is_imported():
    result = subprocess.run([sys.executable, "-c", BLOCKED, json.dumps([a for a, _ in FAST_ERRORS])],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(answers) == len(FAST_ERRORS)
    for (argv, message), (code, err) in zip(FAST_ERRORS, answers, strict=True):
        assert code == 2 and re.search(message, err), (argv, err)


def test_the_model_args_read_from_source_are_the_builders_signatures():
    from memfit.cli import example_arguments
    from memfit.examples import EXAMPLES

    assert example_arguments() == {
        name: {key: p.default for key, p in inspect.signature(builder).parameters.items()}
        for name, builder in EXAMPLES.items()}


def test_plan_reads_a_strategy_name_with_underscore_or_hyphen_alike(capsys, tmp_path):
    """``--strategy vdnn-all`` saves the very file ``--strategy vdnn_all`` saves; an unknown
    name lists the registered ones."""
    saved = {name: tmp_path / f"{name}.json" for name in ("vdnn-all", "vdnn_all")}
    for name, path in saved.items():
        assert main(["plan", *MLP, "--budget", "0.6", "--strategy", name, "--save", str(path)]) == 0
    assert "| vdnn_all (predicted)" in capsys.readouterr().out
    assert saved["vdnn-all"].read_bytes() == saved["vdnn_all"].read_bytes()
    assert Plan.load(saved["vdnn-all"]).strategy == "vdnn_all"
    assert main(["plan", *MLP, "--budget", "0.6", "--strategy", "vdnn-al"]) == 2
    assert "unknown strategy 'vdnn-al': use one of [" in capsys.readouterr().err
