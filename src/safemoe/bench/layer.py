"""Suite `layer`: the whole MoE layer (`safemoe.moe`: route + experts), end to end, bf16, against
the spec (the reference backend) and the HF peers. (Its name was `reference` before: the results
committed then are `bench/results/reference_*`.)

Implementations, side by side on the same inputs:
- `safemoe-reference`: `safemoe.moe(..., backend="reference")`, the executable spec (host syncs:
  timed eagerly). Not meant to be fast; it is the baseline every kernel is checked against.
- `hf-eager`: HF's routing (softmax + topk + renormalise) and HF's per-expert loop (eager).
- `torch-grouped_mm`: HF's routing and transformers' grouped_mm experts path, graph-captured when
  it captures (the `note` says how it was timed).
- `safemoe-triton`: `safemoe.moe(..., backend="triton")` under graph replay, once the kernels exist.

Floor per row: max(decode floor, prefill floor) with
  decode floor  = D x 3*H*I*2 bytes / streaming-read bandwidth, D = E(1 - (1 - K/E)^T),
  prefill floor = 2*T*K*3*H*I FLOPs / bf16 matmul peak
(routing's T*E logits and the activations are a rounding error next to the expert weights).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

import safemoe
from safemoe.bench.harness import (
    BenchRow,
    DeviceCeilings,
    add_speedups,
    moe_floor_us,
    progress,
    time_auto,
    time_eager,
)
from safemoe.peers import PeerUnavailable, grouped_mm_experts, hf_experts_loop, torch_route

SUITE = "layer"

# (E, K, H, I)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
TOKENS = (1, 8, 64, 256, 2048)
QUICK_TOKENS = (1, 64, 2048)
# Input sets rotated through: x and logits differ per call, so each call routes to other experts.
# The expert weights (1.2 GB and 2.8 GB) dwarf any L2 already.
N_VARIANTS = 4
CHECK_TOKENS = 64  # where the peers' outputs are compared with the reference


def _triton_built() -> str | None:
    """None when the Triton kernels exist, else what is missing."""
    for module in ("safemoe.kernels.routing", "safemoe.kernels.experts"):
        if importlib.util.find_spec(module) is None:
            return f"not built yet ({module} missing)"
    return None


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (inf when actual has a non-finite value)."""
    if not bool(torch.isfinite(actual).all()):
        return float("inf")
    scale = float(expected.float().abs().max()) or 1.0
    return float((actual.float() - expected.float()).abs().max()) / scale


def _case_rows(
    case: str,
    shape: tuple[int, int, int, int],
    num_tokens: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ceilings: DeviceCeilings,
    quick: bool,
) -> list[BenchRow]:
    num_experts, top_k, hidden, _ = shape
    device = w13.device
    xs = [torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device) for _ in range(N_VARIANTS)]
    logits = [
        torch.randn(num_tokens, num_experts, dtype=torch.bfloat16, device=device) for _ in range(N_VARIANTS)
    ]
    floor, bound = moe_floor_us(num_experts, top_k, hidden, shape[3], num_tokens, ceilings)
    triton_missing = _triton_built()

    def reference(j: int) -> torch.Tensor:
        return safemoe.moe(xs[j], logits[j], w13, w2, top_k, backend="reference")

    def hf(j: int) -> torch.Tensor:
        weights, ids = torch_route(logits[j], top_k)
        return hf_experts_loop(xs[j], w13, w2, weights, ids)

    def grouped(j: int) -> torch.Tensor:
        weights, ids = torch_route(logits[j], top_k)
        return grouped_mm_experts(xs[j], w13, w2, weights, ids)

    def fused(j: int) -> torch.Tensor:
        return safemoe.moe(xs[j], logits[j], w13, w2, top_k, backend="triton")

    impls: list[tuple[str, Callable[[int], torch.Tensor], bool]] = [
        ("safemoe-reference", reference, False),
        ("hf-eager", hf, False),
        ("torch-grouped_mm", grouped, True),
        ("safemoe-triton", fused, True),
    ]
    graph_kwargs = {"calls_per_graph": 10, "replays": 15} if quick else {"calls_per_graph": 20, "replays": 30}
    eager_iters = 10 if quick else 30

    expected = reference(0) if num_tokens == CHECK_TOKENS else None
    rows = []
    for impl, step, capturable in impls:
        row = BenchRow(SUITE, case, num_tokens, "clean", impl, None, floor, extra={"bound": bound})
        rows.append(row)
        if impl == "safemoe-triton" and triton_missing:
            row.note = triton_missing
            continue
        try:
            if expected is not None and impl != "safemoe-reference":
                row.extra["rel_err_vs_reference"] = round(_rel_err(step(0), expected), 5)
            if capturable:
                row.median_us, how = time_auto(step, n_variants=N_VARIANTS, iters=eager_iters, **graph_kwargs)
                row.note = how
            else:
                row.median_us = time_eager(step, n_variants=N_VARIANTS, iters=eager_iters)
                row.note = "eager (host syncs)"
        except PeerUnavailable as exc:
            row.note = str(exc)
        except Exception as exc:  # keep the other rows: record what went wrong
            row.note = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return rows


def run(ceilings: DeviceCeilings, *, quick: bool) -> list[BenchRow]:
    device = torch.device("cuda", torch.cuda.current_device())
    tokens = QUICK_TOKENS if quick else TOKENS
    rows: list[BenchRow] = []
    generator = torch.Generator(device=device).manual_seed(0)
    for case, shape in SHAPES.items():
        num_experts, _, hidden, inter = shape
        # Weights scaled so activations stay O(1): the bf16 math is then representative.
        w13 = (
            torch.randn(
                num_experts, 2 * inter, hidden, dtype=torch.bfloat16, device=device, generator=generator
            )
            * hidden**-0.5
        )
        w2 = (
            torch.randn(num_experts, hidden, inter, dtype=torch.bfloat16, device=device, generator=generator)
            * inter**-0.5
        )
        for num_tokens in progress(tokens, f"layer suite: {case}"):
            rows.extend(_case_rows(case, shape, num_tokens, w13, w2, ceilings, quick))
        del w13, w2
        torch.cuda.empty_cache()
    add_speedups(rows, "hf-eager")
    return rows
