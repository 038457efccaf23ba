"""A Llama-shaped 7B model on 8xH100 SXM under FSDP2, planned from one CPU (issue 14).

One rank of an FSDP2 job (``fully_shard`` on each decoder layer and on the root, as
torchtitan does; bf16 parameters, AdamW state in bf16 too, 8 ranks over NVLink 4) is planned on
meta tensors for the ``h100-sxm`` profile, at its 80 GiB: the largest per-rank batch (sequence
4096) and its predicted throughput without memfit (``keep``), with per-block checkpointing
(torchtitan's default activation checkpointing: each decoder layer's output kept, the rest
recomputed; memfit's ``checkpoint`` strategy with ``checkpoints=["model.layers.*"]``) and with
memfit ``auto`` (the fastest batch, and the largest). Throughput is tokens per second per rank,
predicted by the simulator (compute, copy and communication streams). Wall times of each search
are printed; they are the planning cost of a 32-layer capture each batch.

Run: ``python -m bench.cluster [--layers 32] [--width 4096] [--sequence 4096]`` (prints), or
``python -m bench.run --only cluster`` (writes its section of ``bench/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import memfit
from memfit.data.tables import table
from memfit.data.units import format_bytes

BUDGET = "80GiB"


def llama_unfilled(layers: int, width: int, sequence: int, vocab: int = 32000) -> torch.nn.Module:
    """LlamaForCausalLM with Llama-2-7B's shapes (intermediate 11008 at width 4096), bf16, built
    on the meta device and moved to the CPU unfilled (``to_empty``: pages never written are never
    committed, so 7B of parameters take address space, not RAM).

    Note:
        Not left on the meta device: a step traced with meta parameters came out forward-only
        (no backward ops, measured on a 1-layer model: 172 forward ops and no backward, against
        156 + 169 with CPU parameters), so its plan would miss the whole backward pass."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=width,
                         intermediate_size=width * 11008 // 4096, num_hidden_layers=layers,
                         num_attention_heads=max(1, width // 128),
                         num_key_value_heads=max(1, width // 128),
                         max_position_embeddings=sequence)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    filling = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    try:  # bench.run turns deterministic algorithms on, which would fill (so commit) every page
        return model.to_empty(device="cpu")
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = filling  # type: ignore[attr-defined]


def loss_fn(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=labels, use_cache=False).loss


ROWS = (("without memfit (keep)", "keep", {}, "largest"),
        ("per-block checkpointing (torchtitan's default)", "checkpoint",
         {"checkpoints": ["model.layers.*"]}, "largest"),
        ("memfit auto, largest batch", "auto", {}, "largest"),
        ("memfit auto, fastest batch", "auto", {}, "throughput"))
HEADERS = ("per rank", "batch", "predicted peak", "step time", "tokens/s per rank",
           "batches planned", "wall time")


def cluster_rows(log: Callable[[str], None], layers: int = 32, width: int = 4096,
                 sequence: int = 4096, world_size: int = 8,
                 max_batch: int = 64) -> list[tuple[str, ...]]:
    """One row per way of training: the batch ``max_batch_size`` finds for one rank and its
    predicted figures."""
    model = llama_unfilled(layers, width, sequence)
    optimizer = torch.optim.AdamW(model.parameters())

    def make_inputs(batch: int) -> tuple[torch.Tensor, ...]:
        tokens = torch.zeros(batch, sequence, dtype=torch.long)
        return tokens, tokens

    rows, batches = [], {}
    for label, strategy, params, objective in ROWS:
        start = time.perf_counter()
        found = memfit.max_batch_size(model, loss_fn, make_inputs, BUDGET, "h100-sxm", strategy,
                                      objective=objective, max_batch=max_batch, verify=False,
                                      world_size=world_size, sharding="fsdp",
                                      optimizer=optimizer, **params)
        wall_s = time.perf_counter() - start
        batches[strategy] = found.batch_size
        rows.append(_row(label, found.batch_size, found.predicted_peak_bytes,
                         found.predicted_step_time_s, sequence, len(found.tried), wall_s))
        log(f"cluster: {' | '.join(rows[-1])}")
    batch = batches["checkpoint"]  # memfit at the batch per-block checkpointing reaches
    start = time.perf_counter()
    with torch.device("meta"):
        tokens = make_inputs(batch)
    plan = memfit.plan(model, loss_fn, *tokens, budget=BUDGET, hardware="h100-sxm",
                       world_size=world_size, sharding="fsdp", optimizer=optimizer)
    assert plan.explanation is not None
    rows.append(_row("memfit auto at checkpointing's batch", batch, plan.explanation.peak_bytes,
                     plan.explanation.step_time_s, sequence, 1, time.perf_counter() - start))
    log(f"cluster: {' | '.join(rows[-1])}")
    return rows


def _row(label: str, batch: int, peak_bytes: int, step_s: float, sequence: int, plans: int,
         wall_s: float) -> tuple[str, ...]:
    return (label, str(batch), format_bytes(peak_bytes), f"{step_s:.2f} s",
            f"{batch * sequence / step_s:,.0f}", str(plans), f"{wall_s:.0f} s")


def cluster_section(log: Callable[[str], None]) -> str:
    """The Markdown section of ``bench/RESULTS.md`` (``python -m bench.run --only cluster``)."""
    rows = cluster_rows(log)
    return "\n".join([
        "## A 7B Llama on 8xH100 under FSDP2, planned from one CPU\n",
        "One rank of FSDP2 (`fully_shard` per decoder layer and on the root, bf16 parameters and "
        "AdamW state, 8 ranks on NVLink 4 at 360 GB/s ring bus bandwidth), planned on this CPU "
        "for `h100-sxm` at 80 GiB per rank, sequence 4096: `memfit.max_batch_size(..., "
        "world_size=8, sharding=\"fsdp\", optimizer=adamw, verify=False)`. Peaks and step "
        "times are predicted (simulated), nothing ran on a GPU. Each plan traces the whole "
        "32-layer step once (parameters unfilled on the CPU). The last row plans memfit `auto` "
        "at the batch per-block checkpointing reaches (`memfit.plan`, which also plans the "
        "what-ifs at the budget x0.9 and x1.1). Wall times are this shared 2-core CPU's.\n",
        table(HEADERS, rows),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--sequence", type=int, default=4096)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=64)
    args = parser.parse_args()
    print(f"Llama {args.layers} layers, width {args.width}, sequence {args.sequence}, bf16, "
          f"FSDP2 over {args.world_size} x h100-sxm, per-rank budget {BUDGET}")
    rows = cluster_rows(print, args.layers, args.width, args.sequence, args.world_size,
                        args.max_batch)
    print(table(HEADERS, rows))


if __name__ == "__main__":
    main()
