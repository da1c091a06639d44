"""Suite `invariance`: what `batch_invariant=True` costs, against the default, at the same points.

Three pairs per (shape, T), each timed under CUDA-graph replay on the same inputs (bf16):
- `experts`: `safemoe.experts` (dispatch, GEMMs, combine), default vs batch_invariant (one tile
  config for every T, no small-batch switch);
- `moe`: `safemoe.moe` (router + experts) from given logits;
- `layer`: a `safemoe.MoE` forward (gate Linear + route + experts), where batch_invariant also
  moves the gate logits from cuBLAS to `kernels/linear.py`.
Rows: impl `<pair>` (default) and `<pair>-batch-invariant`, whose extra `slowdown` is its median
over the default's (1.15 = 15% slower). Targets (issue 14): <= 1.15 at decode (T <= 64), <= 1.25 at
prefill. Floor per row as in the layer suite (weights streamed once, or the FLOPs at the bf16 peak).

    python -m safemoe bench --suite invariance [--quick]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import safemoe
from safemoe.bench.harness import (
    BenchRow,
    DeviceCeilings,
    chosen_cases,
    error_note,
    moe_floor_us,
    progress,
    time_auto,
)

SUITE = "invariance"

# (E, K, H, I), as the layer suite
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
TOKENS = (1, 8, 64, 256, 1024, 2048, 8192)
QUICK_TOKENS = (1, 64, 2048)
N_VARIANTS = 4  # input sets rotated through, so each call routes to other experts


def _layers(shape: tuple[int, int, int, int], device: torch.device) -> tuple[safemoe.MoE, safemoe.MoE]:
    """(default, batch-invariant) MoE layers sharing one set of weights."""
    num_experts, top_k, hidden, inter = shape
    made = [
        safemoe.MoE(hidden, inter, num_experts, top_k, backend="triton", batch_invariant=flag,
                    dtype=torch.bfloat16, device="meta" if flag else device)
        for flag in (False, True)
    ]
    base, inv = made
    inv.gate.weight, inv.w13, inv.w2 = base.gate.weight, base.w13, base.w2
    return base, inv


def _case_rows(case: str, shape: tuple[int, int, int, int], num_tokens: int,
               layers: tuple[safemoe.MoE, safemoe.MoE], workspace: safemoe.Workspace,
               ceilings: DeviceCeilings, quick: bool) -> list[BenchRow]:
    num_experts, top_k, hidden, inter = shape
    base, _ = layers
    device = base.w13.device
    w13, w2 = base.w13.detach(), base.w2.detach()
    xs = [torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device) for _ in range(N_VARIANTS)]
    logits = [
        torch.randn(num_tokens, num_experts, dtype=torch.bfloat16, device=device) for _ in range(N_VARIANTS)
    ]
    routings = [safemoe.route(lg, top_k) for lg in logits]
    floor, bound = moe_floor_us(num_experts, top_k, hidden, inter, num_tokens, ceilings)

    def pair(flag: bool) -> dict[str, Callable[[int], torch.Tensor]]:
        layer = layers[flag]
        return {
            "experts": lambda j: safemoe.experts(xs[j], w13, w2, routings[j], workspace=workspace,
                                                 backend="triton", batch_invariant=flag),
            "moe": lambda j: safemoe.moe(xs[j], logits[j], w13, w2, top_k, workspace=workspace,
                                         backend="triton", batch_invariant=flag),
            "layer": lambda j: layer(xs[j]),
        }

    graph_kwargs = {"calls_per_graph": 10, "replays": 15} if quick else {"calls_per_graph": 20, "replays": 30}
    rows: list[BenchRow] = []
    steps = {False: pair(False), True: pair(True)}
    for name in ("experts", "moe", "layer"):
        timed: dict[bool, BenchRow] = {}
        for flag in (False, True):
            impl = f"{name}-batch-invariant" if flag else name
            row = BenchRow(SUITE, case, num_tokens, "clean", impl, None, floor, extra={"bound": bound})
            rows.append(row)
            try:
                with torch.no_grad():
                    row.median_us, row.note = time_auto(steps[flag][name], n_variants=N_VARIANTS,
                                                        iters=10 if quick else 30, **graph_kwargs)
                timed[flag] = row
            except Exception as exc:  # keep the other rows: record what went wrong
                row.note = error_note(exc)
        default_us = timed[False].median_us if False in timed else None
        invariant_us = timed[True].median_us if True in timed else None
        if default_us and invariant_us:
            timed[True].extra["slowdown"] = round(invariant_us / default_us, 3)
    return rows


def run(ceilings: DeviceCeilings, *, quick: bool, shapes: Sequence[str] | None = None) -> list[BenchRow]:
    """shapes: the SHAPES names to run (`safemoe bench --shapes`); default all."""
    device = torch.device("cuda", torch.cuda.current_device())
    tokens = QUICK_TOKENS if quick else TOKENS
    rows: list[BenchRow] = []
    for case in chosen_cases(SHAPES, None, quick=quick, names=shapes):
        shape = SHAPES[case]
        num_experts, top_k, hidden, inter = shape
        torch.manual_seed(0)
        layers = _layers(shape, device)
        workspace = safemoe.Workspace(max(tokens), num_experts, top_k, hidden, inter, torch.bfloat16, device)
        for layer in layers:
            layer.set_workspace(workspace)
        for num_tokens in progress(tokens, f"invariance suite: {case}"):
            rows.extend(_case_rows(case, shape, num_tokens, layers, workspace, ceilings, quick))
        del layers, workspace
        torch.cuda.empty_cache()
    return rows
