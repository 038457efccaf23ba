"""One command for the benchmark: ``python -m bench.run`` writes RESULTS.md.

Every figure in the file is measured by the run that wrote it (the H100 step times are the
simulator's, and say so). CPU part: per-model capacity under a fixed budget, executor overhead,
GPT-2 beside the alternatives, recomputation curves (bench/recompute.py), memfit with inductor
at the peaks torch.compile's activation memory budget reaches (bench/compile_budget.py), auto
against the alternatives at real sizes (bench/auto.py), the cost model against published
throughput and auto's sensitivity to the profile (bench/validation.py), the time model's
predicted against measured step times on this CPU (bench/time_model.py), FSDP2 and DDP on two
gloo ranks beside per-block checkpointing (bench/distributed.py), the line count. ``--gpu``: the
host link and a GPT-2 medium step.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import tokenize
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from memfit.data.files import write_text
from memfit.data.tables import table

ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def machine() -> str:
    """CPU model and count, Python, torch, transformers and MONAI versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = [f"torch {torch.__version__}"]
    for package in ("transformers", "monai"):
        try:
            versions.append(f"{package} {__import__(package).__version__}")
        except ImportError:
            pass
    # the CPU's vector ISA picks oneDNN's kernels and their scratch buffers: the same U-Net holds
    # 10.30 MiB at its eager peak with AVX2 and 14.32 MiB with AVX-512
    capability = torch.backends.cpu.get_cpu_capability()
    return (f"{cpu} ({capability}), {os.cpu_count()} cores; Python {platform.python_version()}; "
            + ", ".join(versions))


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring."""
    lines: set[int] = set()
    previous = tokenize.NEWLINE
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    with path.open("rb") as source:
        for token in tokenize.tokenize(source.readline):
            if token.type in skip:
                if token.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
                    previous = token.type
                continue
            docstring = token.type == tokenize.STRING and previous in (
                tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
            previous = token.type
            if not docstring:
                lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines)


def line_counts() -> str:
    """Files, lines and code lines per package folder of memfit/ (like tinygrad's sz.py)."""
    rows, total = [], [0, 0, 0]
    package = ROOT / "memfit"
    folders = sorted({p.parent for p in package.rglob("*.py")})
    for folder in folders:
        files = sorted(folder.glob("*.py"))
        counts = (len(files), sum(len(f.read_text().splitlines()) for f in files),
                  sum(code_lines(f) for f in files))
        rows.append((str(folder.relative_to(ROOT)) + "/", *counts))
        total = [a + b for a, b in zip(total, counts, strict=True)]
    rows.append(("total", *total))
    return table(("folder", "files", "lines", "code lines"), rows)


def cpu_sections() -> list[str]:
    """The CPU part: capacity, overhead, alternatives, recomputation curves, auto at real sizes."""
    from bench.alternatives import ALTERNATIVE_HEADERS, alternative_rows
    from bench.auto import auto_section
    from bench.cluster import cluster_section
    from bench.compile_budget import compile_budget_section
    from bench.distributed import distributed_section
    from bench.first_call import first_call_section
    from bench.fit import fit_section
    from bench.models import (
        BENCH_MODELS,
        CAPACITY_HEADERS,
        OVERHEAD_HEADERS,
        PLANNING_HARDWARE,
        model_rows,
    )
    from bench.planning import planning_section
    from bench.planning_scaling import scaling_markdown
    from bench.recompute import recompute_section
    from bench.time_model import time_model_section
    from bench.transformers_loops import transformers_section
    from bench.validation import validation_section

    capacity, overhead = [], []
    for bench in BENCH_MODELS:
        started = time.perf_counter()
        capacity_row, overhead_row = model_rows(bench, log)
        capacity.append(capacity_row)
        overhead.append(overhead_row)
        log(f"{bench.name}: {time.perf_counter() - started:.0f} s")
    gpt2 = BENCH_MODELS[0]
    alternatives = alternative_rows(gpt2.build(), gpt2.base_batch, log)
    recompute = recompute_section(log, plot_path=ROOT / "bench" / "recompute.png")
    return [
        "## Capacity under a fixed budget\n",
        "Peaks are measured on this CPU by memfit's dispatch tracker (device bytes of the step: "
        "parameters, inputs, everything the step allocates; memfit's host copies excluded). "
        "Swap-all is `strategy=\"swap\"` with no budget (every candidate swapped, lb=1). Step "
        f"times are simulated on the `{PLANNING_HARDWARE}` profile. The fixed budget is the "
        "unplanned measured peak at the base batch; each largest batch is searched on predicted "
        "peaks (doubling, then bisection, up to 16x the base batch) and then verified by a "
        "measured run whose peak is shown.\n",
        table(CAPACITY_HEADERS, capacity),
        "\n## Executor overhead (CPU)\n",
        "Eager and memfit steps timed in turn (eager, keep, eager, keep, ...), median of 5 each "
        "after a warm-up; memfit with `measure=False` (no tracker). CPU times on a shared "
        "machine drift between runs; compare within a row.\n",
        table(OVERHEAD_HEADERS, overhead),
        f"\n## {gpt2.name}, batch {gpt2.base_batch}: the alternatives side by side\n",
        "One process, one batch, one seed; step time is the median of 5 after a warm-up "
        "(compile, capture and planning happen in the warm-up).\n",
        table(ALTERNATIVE_HEADERS, alternatives),
        "\nThis GPT-2 has dropout 0.1. A method whose loss is bitwise eager's but whose gradients "
        "differ computed its backward pass from values other than its forward pass's (a "
        "recomputed dropout that draws a new mask would do this).\n",
        recompute,
        "\n" + fit_section(log),
        "\n" + compile_budget_section(log),
        "\n" + transformers_section(log),
        "\n" + auto_section(log),
        "\n" + planning_section(log),
        "\n" + scaling_markdown(log),
        "\n" + validation_section(log),
        "\n" + time_model_section(log),
        "\n" + first_call_section(log),
        "\n" + cluster_section(log),
        "\n" + distributed_section(log),
    ]


SIZE_TITLE = "## Size"


def section_builders() -> dict[str, Callable[[], str]]:
    """The CPU sections that can be rerun alone (``--only``), by name; each returns Markdown
    starting with its ``## `` title."""
    from bench.auto import auto_section
    from bench.cluster import cluster_section
    from bench.compile_budget import compile_budget_section
    from bench.distributed import distributed_section
    from bench.first_call import first_call_section
    from bench.fit import fit_section
    from bench.planning import planning_section
    from bench.planning_scaling import scaling_markdown
    from bench.recompute import recompute_section
    from bench.time_model import time_model_section
    from bench.transformers_loops import transformers_section
    from bench.validation import validation_section

    return {
        "fit": lambda: fit_section(log),
        "compile_budget": lambda: compile_budget_section(log),
        "transformers": lambda: transformers_section(log),
        "recompute": lambda: recompute_section(log, plot_path=ROOT / "bench" / "recompute.png"),
        "auto": lambda: auto_section(log),
        "planning": lambda: planning_section(log),
        "scaling": lambda: scaling_markdown(log),
        "validation": lambda: validation_section(log),
        "time_model": lambda: time_model_section(log),
        "first_call": lambda: first_call_section(log),
        "cluster": lambda: cluster_section(log),
        "distributed": lambda: distributed_section(log),
    }


ONLY_CHOICES = ("fit", "compile_budget", "transformers", "recompute", "auto", "planning",
                "scaling", "validation", "time_model", "first_call", "cluster",
                "distributed")  # section_builders()'s keys, without importing the sections


def splice(old: str, section: str, stamp: str) -> str:
    """``old`` with ``section`` in place of its earlier copy (the text from its title to the next
    ``## `` title), or just before the Size table if it had none; ``stamp`` after the run-time
    line, replacing an earlier stamp of the same section; the Size table recounted."""
    title, body = section.split("\n", 1)
    head, _ = old.split(SIZE_TITLE, 1)  # the Size table is last, and recounted
    if title + "\n" in head:
        before, after = head.split(title + "\n", 1)
        following = after.find("\n## ")
        head = before + (after[following + 1:] if following >= 0 else "")
    lines = [line for line in head.rstrip("\n").split("\n")
             if not line.startswith(f"- section \"{title[3:]}\" rerun alone")]
    at = next(i for i, line in enumerate(lines) if line.startswith("- run time:"))
    lines.insert(at + 1, stamp)
    return ("\n".join(lines) + "\n\n" + title + "\n\n" + body.strip("\n") + "\n\n" + SIZE_TITLE
            + "\n\n" + line_counts() + "\n")


def rerun_section(name: str, out: Path, started: float) -> int:
    """Rerun the ``name`` section alone and put it in place of its old text in ``out``."""
    old = out.read_text()
    if SIZE_TITLE not in old or "- run time:" not in old:
        print(f"{out} has no {SIZE_TITLE!r} table or run-time line: run the whole benchmark "
              "instead", file=sys.stderr)
        return 1
    section = section_builders()[name]()
    title = section.split("\n", 1)[0]
    command = f"python -m bench.run --only {name}" + (f" --out {out}" if out != ROOT / "bench" /
                                                      "RESULTS.md" else "")
    stamp = (f"- section \"{title[3:]}\" rerun alone: `{command}`, "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{time.perf_counter() - started:.0f} s, {machine()}, load "
             f"average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other jobs "
             "share the machine: timings are noisy) (the other sections are from the run "
             "above)")
    write_text(out, splice(old, section, stamp))
    log(f"wrote the {name} section of {out} in {time.perf_counter() - started:.0f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument("--gpu", action="store_true", help="run the CUDA part instead")
    parser.add_argument("--out", help="default bench/RESULTS.md (bench/RESULTS-gpu.md with --gpu)")
    parser.add_argument("--only", choices=ONLY_CHOICES,
                        help="rerun one CPU section and splice it into the existing results file "
                        "(the other sections keep their figures; the Size table is recounted)")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    if args.only:
        if args.gpu:
            parser.error("--only is for the CPU part")
        return rerun_section(args.only, Path(args.out or ROOT / "bench" / "RESULTS.md"),
                             started)
    if args.gpu:
        from bench.gpu import gpu_sections

        sections = gpu_sections(log)
        if sections is None:
            print("no CUDA device: the GPU benchmark needs one; nothing was measured")
            return 0
    else:
        sections = cpu_sections()
    out = Path(args.out or ROOT / "bench" / ("RESULTS-gpu.md" if args.gpu else "RESULTS.md"))
    command = "python -m bench.run" + (" --gpu" if args.gpu else "") + \
        (f" --out {args.out}" if args.out else "")
    header = ["# memfit benchmark results\n",
              f"- command: `{command}`",
              f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              f"- machine: {machine()}",
              f"- run time: {time.perf_counter() - started:.0f} s\n"]
    footer = ["\n## Size\n", line_counts()]
    write_text(out, "\n".join(header + sections + footer) + "\n")
    log(f"wrote {out} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
