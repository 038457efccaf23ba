"""The ``memfit`` command: one thin subcommand per library function.

    memfit demo   run the main job: GPT-2 unplanned vs swap at half its peak (memfit.demo)
    memfit plan   plan a step for a hardware profile without running it; print plan.explain()
    memfit max-batch-size   the fastest (or largest) batch that fits a budget, and the frontier
    memfit show   re-render a saved Timeline JSON as text or PNG, or explain a saved Plan JSON
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memfit.data.hardware import Hardware
    from memfit.data.units import Budget

EXAMPLES_HELP = """examples:
  memfit demo                          # about a minute on a laptop CPU
  memfit demo --quick --out /tmp/memfit-ci-demo
  memfit plan --model gpt2 --batch 16 --budget 0.5 --hardware h100-pcie
  memfit plan --model resnet50 --budget 200MiB --param lb=3 --param ctrld_strategy=direct_order
  memfit plan --model gpt2 --model-arg layers=24 --model-arg width=1024 --save plan.json
  memfit plan --model llama --hardware h100-sxm --world-size 8 --fsdp   # one rank of FSDP2
  memfit max-batch-size --model gpt2 --budget 80GiB --hardware h100-pcie
  memfit max-batch-size --model mlp --budget 20MB --hardware cpu --objective largest
  memfit show memfit-demo/swap.json --png swap.png
  memfit show plan.json                # a plan saved by memfit plan --save: its explanation
"""


def terminal_width() -> int:
    """Columns of the terminal (80 when not a terminal), so tables can turn on their side."""
    return shutil.get_terminal_size((100, 24)).columns


def _key_value(text: str) -> tuple[str, object]:
    """Parse ``k=v``; ``v`` as a Python literal (3, 0.5, True, ['a', 'b']) or else a string."""
    key, separator, value = text.partition("=")
    if not separator or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r} (e.g. lb=3)")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _hardware(name: str) -> str | Hardware:
    """A built-in hardware profile's name, or a profile saved as JSON (a path ending in
    ``.json``, e.g. one ``measure_hardware()`` made on the target GPU); ``memfit.data.hardware``
    is torch-free: fast."""
    from memfit.data.hardware import Hardware, get_hardware

    try:
        return Hardware.load(name) if name.endswith(".json") else get_hardware(name).name
    except (ValueError, OSError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _host_bytes(text: str) -> int | None:
    """``--host-bytes``: a size (``'512GiB'``) or ``none`` (no limit)."""
    from memfit.data.units import parse_bytes

    if text.strip().lower() == "none":
        return None
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _target(args: argparse.Namespace) -> str | Hardware:
    """``--hardware`` with ``--host-bytes`` applied where given (else the profile's own)."""
    if not hasattr(args, "host_bytes"):
        return args.hardware
    from memfit.data.hardware import get_hardware

    return get_hardware(args.hardware).with_(host_bytes=args.host_bytes)


def _add_sharding(parser: argparse.ArgumentParser) -> None:
    """``--world-size`` and ``--fsdp`` / ``--ddp``: plan one rank of a data-parallel job."""
    parser.add_argument("--world-size", type=_positive_int, default=1,
                        help="ranks of the job; the plan is one rank's (default 1)")
    kinds = parser.add_mutually_exclusive_group()
    kinds.add_argument("--fsdp", dest="sharding", action="store_const", const="fsdp",
                       default="none", help="FSDP2: fully_shard on each block and the root")
    kinds.add_argument("--ddp", dest="sharding", action="store_const", const="ddp",
                       help="DistributedDataParallel: bucketed all-reduce of the gradients")


def _sharding(args: argparse.Namespace) -> dict:
    """The sharding keywords of ``memfit.plan`` / ``max_batch_size`` from the command line."""
    return {"world_size": args.world_size, "sharding": args.sharding}


def _budget(text: str) -> Budget:
    """A budget, read as ``memfit.compile(budget=...)`` reads one (``parse_budget``)."""
    from memfit.data.units import parse_budget

    try:
        parsed = parse_budget(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    assert parsed is not None
    return parsed


def example_arguments() -> dict[str, dict[str, object]]:
    """Each example model's builder arguments and defaults, read from ``memfit/examples.py``.

    Note:
        Read from the source, not imported: importing the examples imports torch (seconds), and
        the command line checks its arguments before that. The builders' signatures are the one
        list of what ``--model-arg`` accepts, so the two cannot drift apart.
    """
    spec = importlib.util.find_spec("memfit.examples")
    assert spec is not None and spec.origin is not None
    module = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    builders = {node.name: node for node in module.body if isinstance(node, ast.FunctionDef)}
    table = next(node.value for node in module.body if isinstance(node, ast.AnnAssign)
                 and isinstance(node.target, ast.Name) and node.target.id == "EXAMPLES")
    assert isinstance(table, ast.Dict)
    found = {}
    for key, value in zip(table.keys, table.values, strict=True):
        assert isinstance(key, ast.Constant) and isinstance(value, ast.Name)
        arguments = builders[value.id].args
        defaults = [ast.literal_eval(d) for d in arguments.defaults]
        names = [a.arg for a in arguments.args][len(arguments.args) - len(defaults):]
        found[str(key.value)] = dict(zip(names, defaults, strict=True))
    return found


def model_size(model: str, model_args: Sequence[tuple[str, object]]) -> str:
    """The example's size as built: its builder's defaults with ``--model-arg`` applied, e.g.
    ``gpt2 (layers=4, width=64, heads=4, vocab=128, sequence=128, batch_size=4, ...)``."""
    arguments = {**example_arguments()[model], **dict(model_args)}
    shown = ", ".join(f"{name}={value!r}" for name, value in arguments.items())
    return f"{model} ({shown})"


def model_help() -> str:
    """``--model``'s help: each example with its default size. The examples are small stand-ins
    (``gpt2`` is GPT-2's architecture at a toy size), sized up with ``--model-arg``."""
    sizes = "; ".join(
        f"{name} ({', '.join(f'{key}={value}' for key, value in defaults.items() if key != 'seed')})"
        for name, defaults in example_arguments().items())
    return (f"a built-in example, small by default (the architecture, not the published size; "
            f"--model-arg sizes it): {sizes}")


def check_model_args(model: str, model_args: Sequence[tuple[str, object]]) -> None:
    """Raise ``ValueError`` for a ``--model-arg`` the example's builder does not take, or one
    whose value is not of its default's type; the message lists the valid keys."""
    accepted = example_arguments()[model]
    valid = ", ".join(f"{name}={default!r}" for name, default in accepted.items())
    for key, value in model_args:
        if key not in accepted:
            raise ValueError(f"unknown --model-arg {key!r} for {model}: valid keys (with their "
                             f"defaults) are {valid}")
        default = accepted[key]
        if not _same_kind(value, default):
            raise ValueError(f"--model-arg {key}={value!r} for {model}: expected a value of "
                             f"type {type(default).__name__}, like {key}={default!r}")


def _same_kind(value: object, default: object) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return type(value) is type(default)
    if isinstance(default, float):
        return isinstance(value, int | float)
    if isinstance(default, tuple):
        return isinstance(value, list | tuple)
    return isinstance(value, type(default))


# ---- demo ----------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    """Train unplanned then under swap; print the comparison; exit 1 if it is not sound."""
    from tqdm import tqdm

    from memfit.data.errors import BudgetError
    from memfit.demo import DemoConfig, demo_report, run_demo, write_outputs

    config = DemoConfig.quick() if args.quick else DemoConfig()
    if args.steps is not None:
        config = replace(config, steps=args.steps)
    started = time.perf_counter()
    with tqdm(total=2 * config.steps, desc="training (unplanned, then swap)",
              unit="step", file=sys.stderr) as bar:
        try:
            result = run_demo(config, tick=bar.update)
        except BudgetError as error:
            print(f"memfit demo: {error}", file=sys.stderr)
            return 2
    paths = write_outputs(result, Path(args.out))
    print(demo_report(result, terminal_width()))
    print("wrote " + ", ".join(str(p) for p in paths))
    print(f"demo took {time.perf_counter() - started:.0f} s")
    if not result.ok:
        print("memfit demo: FAILED (gradients differ or the measured peak exceeds the budget)",
              file=sys.stderr)
        return 1
    return 0


# ---- plan ----------------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan the named example on a hardware profile; print ``plan.explain()``; save it if asked."""
    from memfit.planning.strategies import resolve_budget_and_strategy

    try:  # everything checkable without torch first: the model is built and traced below
        check_model_args(args.model, args.model_arg)
        resolve_budget_and_strategy(args.budget, args.strategy, dict(args.param))
    except ValueError as error:  # unknown model argument, strategy or parameter
        print(f"memfit plan: {error}", file=sys.stderr)
        return 2
    from memfit.data.errors import BudgetError
    from memfit.examples import plan_example
    from memfit.render.summary import plan_summary

    try:
        planned = plan_example(args.model, args.batch, dict(args.model_arg), args.budget,
                               _target(args), args.strategy, dict(args.param), args.autocast,
                               **_sharding(args))
    except BudgetError as error:
        print(f"memfit plan: {error}", file=sys.stderr)
        return 2
    except ValueError as error:  # unknown strategy, parameter, hardware, bad budget
        print(f"memfit plan: {error}", file=sys.stderr)
        return 2
    print(f"model: {model_size(args.model, args.model_arg)}")
    print(plan_summary(planned, terminal_width(), args.depth, args.rows or None))
    if args.save:
        planned.plan.save(args.save)
        print(f"wrote {args.save}")
    return 0


# ---- max-batch-size ------------------------------------------------------------------------------


def cmd_max_batch_size(args: argparse.Namespace) -> int:
    """Search the named example's batch for a hardware profile (``memfit.max_batch_size``, on
    meta inputs, nothing runs); print the chosen batch, the frontier and every batch tried."""
    from memfit.planning.strategies import resolve_budget_and_strategy

    try:  # everything checkable without torch first
        check_model_args(args.model, args.model_arg)
        resolve_budget_and_strategy(args.budget, args.strategy, dict(args.param))
        if args.budget.bytes is None:
            raise ValueError(f"--budget must be bytes ('80GiB'), not the fraction "
                             f"{args.budget.fraction}: a fraction of the peak changes with the "
                             "batch")
    except ValueError as error:
        print(f"memfit max-batch-size: {error}", file=sys.stderr)
        return 2
    from memfit import examples
    from memfit.data.errors import BudgetError
    from memfit.examples import autocast_dtype
    from memfit.search import max_batch_size

    example = examples.EXAMPLES[args.model](**dict(args.model_arg))
    try:
        found = max_batch_size(example.model, example.loss_fn, example.make_inputs, args.budget,
                               _target(args), args.strategy, objective=args.objective,
                               max_batch=args.max_batch, verify=False,
                               autocast=autocast_dtype(args.autocast),
                               symbolic=not args.trace_each_batch, **_sharding(args),
                               **dict(args.param))
    except (BudgetError, ValueError) as error:  # nothing fits; a fractional budget
        print(f"memfit max-batch-size: {error}", file=sys.stderr)
        return 2
    print(f"model: {model_size(args.model, args.model_arg)}")
    print(found)
    return 0


# ---- show ----------------------------------------------------------------------------------------


def cmd_show(args: argparse.Namespace) -> int:
    """Print a saved timeline's summary (and draw it as a PNG when asked), or a saved plan's
    explanation: the file says which it is."""
    from memfit.data.timeline import Timeline
    from memfit.render.summary import timeline_summary

    try:
        data = json.loads(Path(args.file).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        print(f"memfit show: cannot read {args.file}: {error}", file=sys.stderr)
        return 2
    if isinstance(data, dict) and (data.get("format") == "memfit.plan" or "decisions" in data):
        return _show_plan(args, data)
    try:
        timeline = Timeline.from_json(data)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        print(f"memfit show: {args.file} is neither a memfit Timeline JSON (memfit demo writes "
              "them; Timeline.save) nor a Plan JSON (memfit plan --save; Plan.save): "
              f"{type(error).__name__} {error}", file=sys.stderr)
        return 2
    print(timeline_summary(timeline, terminal_width()))
    if args.png:
        from memfit.render.plot import memory_plot

        name = str(timeline.meta.get("run") or Path(args.file).stem)
        memory_plot({name: timeline}, args.png, budget_bytes=args.budget_bytes,
                    title=f"{Path(args.file).name}: device memory over one step", x_axis=args.x)
        print(f"wrote {args.png}")
    return 0


def _show_plan(args: argparse.Namespace, data: dict) -> int:
    """A saved plan: its strategy and decisions, then ``plan.explain()``."""
    from memfit.data.plan import Plan

    if args.png:
        print(f"memfit show: {args.file} is a plan, which holds no memory curve to draw; draw a "
              "timeline (memfit demo writes them) or drop --png to read the plan", file=sys.stderr)
        return 2
    try:
        plan = Plan.from_json(data, source=args.file)
    except ValueError as error:
        print(f"memfit show: {error}", file=sys.stderr)
        return 2
    print(f"plan of strategy {plan.strategy!r} for graph {plan.graph_hash}"
          + (f", hardware {plan.hardware}" if plan.hardware else "")
          + f": {len(plan.decisions)} decisions ({len(plan.swapped)} Swap, "
          f"{len(plan.recomputed)} Recompute: values rebuilt on the way to saved tensors "
          f"included), {len(plan.reruns)} explicit re-runs")
    print(plan.explain(width=terminal_width(), rows=args.rows or None))
    return 0


# ---- the parser ----------------------------------------------------------------------------------


HOST_BYTES_HELP = ("host memory swaps may hold at once ('512GiB'; 'none': no limit); default: "
                   "the profile's figure (a typical host of the GPU's class)")


AUTOCAST_CHOICES = ("bf16", "fp16")
AUTOCAST_HELP = ("plan the step under the target's autocast to bfloat16 or float16 (a GPU "
                 "profile: CUDA's autocast policy and attention kernels; default: float32)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memfit", description="Fit a PyTorch training step into a device-memory budget.",
        epilog=EXAMPLES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter

    demo = commands.add_parser("demo", help="GPT-2 unplanned vs swap at half its peak",
                               epilog=EXAMPLES_HELP, formatter_class=raw)
    demo.add_argument("--quick", action="store_true", help="a smaller model, 2 steps (CI)")
    demo.add_argument("--out", default="memfit-demo", help="folder for memory.png and JSON")
    demo.add_argument("--steps", type=_positive_int, help="training steps per run (default 4)")
    demo.set_defaults(run=cmd_demo)

    plan = commands.add_parser("plan", help="plan a step for a hardware profile, no run",
                               epilog=EXAMPLES_HELP, formatter_class=raw)
    plan.add_argument("--model", required=True, choices=tuple(example_arguments()),
                      help=model_help())
    plan.add_argument("--batch", type=_positive_int, help="batch size (default: the model's)")
    plan.add_argument("--budget", type=_budget,
                      help="a fraction of the unplanned peak (0.5; 1 is all of it), or bytes: an "
                           "integer above 1 or a size with units ('3GiB')")
    plan.add_argument("--hardware", type=_hardware, default="h100-pcie",
                      help="profile name (default h100-pcie), or a profile saved with "
                           "hardware.save('profile.json')")
    plan.add_argument("--host-bytes", type=_host_bytes, default=argparse.SUPPRESS,
                      help=HOST_BYTES_HELP)
    plan.add_argument("--autocast", choices=AUTOCAST_CHOICES, default=None, help=AUTOCAST_HELP)
    plan.add_argument("--strategy", default=None,
                      help="auto | keep | swap | checkpoint | memory-poor | optimal-recompute | "
                           "vdnn_all | vdnn_conv | vdnn_dyn, '_' and '-' alike (default: auto "
                           "with a budget, else keep)")
    plan.add_argument("--param", type=_key_value, action="append", default=[], metavar="K=V",
                      help="a strategy parameter, repeatable: --param lb=3")
    plan.add_argument("--model-arg", type=_key_value, action="append", default=[],
                      metavar="K=V", help="a model size, repeatable: --model-arg layers=24")
    plan.add_argument("--depth", type=_positive_int, default=3,
                      help="module-path depth to group decisions by (default 3)")
    plan.add_argument("--rows", type=int, default=40,
                      help="most per-tensor rows to print, costliest first (0: all; default 40)")
    plan.add_argument("--save", metavar="PATH",
                      help="write the plan as JSON; run it later with "
                           "memfit.compile(model, loss_fn, plan=memfit.Plan.load(PATH))")
    _add_sharding(plan)
    plan.set_defaults(run=cmd_plan)

    search = commands.add_parser("max-batch-size", help="the fastest batch that fits, no run",
                                 epilog=EXAMPLES_HELP, formatter_class=raw)
    search.add_argument("--model", required=True, choices=tuple(example_arguments()),
                        help=model_help())
    search.add_argument("--budget", type=_budget, required=True,
                        help="the whole device's bytes: an integer or a size with units "
                             "('80GiB'); not a fraction, which changes with the batch")
    search.add_argument("--hardware", type=_hardware, default="h100-pcie",
                        help="profile name (default h100-pcie), or a profile saved as JSON")
    search.add_argument("--host-bytes", type=_host_bytes, default=argparse.SUPPRESS,
                        help=HOST_BYTES_HELP)
    search.add_argument("--objective", choices=("throughput", "largest"), default="throughput",
                        help="throughput (default): the fitting batch with the most predicted "
                             "samples/s; largest: the largest fitting batch, however slow")
    search.add_argument("--max-batch", type=_positive_int, default=1 << 16,
                        help="the largest batch tried (default 65536)")
    search.add_argument("--autocast", choices=AUTOCAST_CHOICES, default=None,
                        help=AUTOCAST_HELP)
    search.add_argument("--trace-each-batch", action="store_true",
                        help="trace the step for every batch tried, instead of once with a "
                             "symbolic batch priced at each")
    search.add_argument("--strategy", default=None, help="as for memfit plan (default auto)")
    search.add_argument("--param", type=_key_value, action="append", default=[], metavar="K=V",
                        help="a strategy parameter, repeatable: --param lb=3")
    search.add_argument("--model-arg", type=_key_value, action="append", default=[],
                        metavar="K=V", help="a model size, repeatable: --model-arg layers=24")
    _add_sharding(search)
    search.set_defaults(run=cmd_max_batch_size)

    show = commands.add_parser("show", help="re-render a saved Timeline or Plan JSON",
                               epilog=EXAMPLES_HELP, formatter_class=raw)
    show.add_argument("file", help="a Timeline JSON (memfit demo writes unplanned.json, swap.json) "
                                   "or a Plan JSON (memfit plan --save)")
    show.add_argument("--png", help="also draw it to this PNG")
    show.add_argument("--x", choices=("position", "time"), default="position",
                      help="x axis of the PNG: program position 0..1, or time (ms) where the "
                           "timeline has times (the simulator's do; a measured peak has none)")
    show.add_argument("--budget-bytes", type=int, help="draw a budget line at this many bytes")
    show.add_argument("--rows", type=int, default=40,
                      help="for a plan: most per-tensor rows to print (0: all; default 40)")
    show.set_defaults(run=cmd_show)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``memfit`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
