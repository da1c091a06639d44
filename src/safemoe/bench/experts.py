"""Suite `experts`: the Triton expert kernels against the physical floor and against peers, bf16.

Cases (E, K, H, I): Qwen3-30B-A3B (128, 8, 2048, 768), Mixtral-8x7B (8, 2, 4096, 14336),
gpt-oss-120b in bf16 (128, 4, 2880, 2880, swigluoai), DeepSeek-V3 (256, 8, 7168, 2048); uniform
random routing; T from 1 to 16384 (quick: a subset). Variants:
- `experts`: dispatch + GEMM1 + GEMM2 + combine (`safemoe.kernels.experts.experts_triton` with a
  workspace), under CUDA-graph replay; peers on the same inputs: `torch-grouped_mm`
  (transformers' grouped_mm path), `hf-eager` (per-expert loop, host syncs: timed eagerly) and
  vLLM's `fused_experts` when importable.
- `layer`: route (Triton router when built) + experts, one CUDA graph.
- `padding`: T = 1024 rows with num_valid = 1 (device tensor) against T = 1 (extra `x_vs_T1`).
Each call rotates through 4 input sets (different routing, so different experts' weights).

Floor per row = max(decode floor, prefill floor):
  decode floor  = D x 3*H*I*2 bytes / streaming-read bandwidth, D = E(1 - (1 - K/E)^T)
  prefill floor = 2*T*K*3*H*I FLOPs / bf16 matmul peak
`extra.target_us` is the issue's reference figure (vLLM's two fused_moe GEMM launches on an H200,
its tuned configs), where one exists.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from safemoe.bench.harness import (
    BenchRow,
    DeviceCeilings,
    add_speedups,
    chosen_cases,
    error_note,
    moe_floor_us,
    plot_pct_of_floor,
    progress,
    sampled_distinct_experts,
    time_eager,
    time_graph,
)

SUITE = "experts"

# name: (E, K, H, I, activation)
SHAPES: dict[str, tuple[int, int, int, int, str]] = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu"),
    "mixtral-8x7b": (8, 2, 4096, 14336, "silu"),
    "gpt-oss-120b": (128, 4, 2880, 2880, "swigluoai"),
    "deepseek-v3": (256, 8, 7168, 2048, "silu"),
}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_TOKENS = (1, 8, 64, 256, 2048, 8192)
HF_MAX_TOKENS = 4096  # the eager loop beyond this only costs bench time
N_VARIANTS = 4
PADDED_TOKENS = 1024

# vLLM fused_moe, two GEMM launches only, H200, tuned configs (microseconds; from the issue).
VLLM_H200_US: dict[str, dict[int, float]] = {
    "qwen3-30b-a3b": {1: 25.8, 8: 112.6, 64: 281, 256: 307, 2048: 450, 8192: 1283},
    "mixtral-8x7b": {1: 173.5, 8: 516, 64: 638, 256: 695, 2048: 2604, 8192: 9081},
    "deepseek-v3": {8192: 26100},
}


def timing_args(estimate_us: float) -> dict[str, int]:
    """`time_graph`'s calls_per_graph and replays for a step of about `estimate_us`: enough calls per
    graph to amortise launch gaps, few enough to keep big T cheap (also used by `experts_fp8`)."""
    calls = int(min(20, max(2, 20000 / estimate_us)))
    replays = int(min(30, max(5, 400000 / (estimate_us * calls))))
    return {"calls_per_graph": calls, "replays": replays}


class Inputs:
    """N_VARIANTS input sets of one (shape, T): x [T, H] and logits [T, E] bf16, and the softmax
    top-k routing of those logits (weights fp32, ids int32). Also used by `experts_fp8`."""

    def __init__(
        self, shape: tuple[int, int, int, int, str], num_tokens: int, device: torch.device, seed: int
    ) -> None:
        num_experts, top_k, hidden, _, _ = shape
        gen = torch.Generator(device=device).manual_seed(seed)
        self.xs = [
            torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(N_VARIANTS)
        ]
        self.logits = [
            torch.randn(num_tokens, num_experts, device=device, dtype=torch.bfloat16, generator=gen)
            for _ in range(N_VARIANTS)
        ]
        self.weights, self.ids = [], []
        for logits in self.logits:
            probs = torch.softmax(logits.float(), dim=-1)
            top = torch.topk(probs, top_k, dim=-1)
            self.weights.append((top.values / top.values.sum(-1, keepdim=True)).contiguous())
            self.ids.append(top.indices.to(torch.int32).contiguous())


def _route_backend() -> str:
    try:
        import safemoe.kernels.routing  # noqa: F401
    except ImportError:
        return "reference"
    return "triton"


class _Steps:
    """The two safemoe steps timed on one input set: `experts` (experts_triton into preallocated
    outputs) and `layer` (route + experts), num_valid as a device tensor, one shared workspace."""

    def __init__(
        self,
        shape: tuple[int, int, int, int, str],
        inputs: Inputs,
        w13: torch.Tensor,
        w2: torch.Tensor,
        num_valid: int,
    ) -> None:
        from safemoe._checks import NumValid
        from safemoe.workspace import Workspace

        num_experts, self.top_k, hidden, inter, self.activation = shape
        num_tokens = inputs.xs[0].shape[0]
        self.inputs, self.w13, self.w2 = inputs, w13, w2
        self.ws = Workspace(num_tokens, num_experts, self.top_k, hidden, inter, torch.bfloat16, w13.device)
        self.nv_tensor = torch.tensor(num_valid, device=w13.device, dtype=torch.int32)
        self.nv = NumValid(None, self.nv_tensor)
        self.outs = [torch.empty_like(x) for x in inputs.xs]
        self.route_backend = _route_backend()

    def experts(self, j: int) -> torch.Tensor:
        from safemoe.kernels.experts import experts_triton

        inputs = self.inputs
        return experts_triton(
            inputs.xs[j],
            self.w13,
            self.w2,
            inputs.weights[j],
            inputs.ids[j],
            activation=self.activation,
            num_valid=self.nv,
            health=None,
            workspace=self.ws,
            out=self.outs[j],
        )

    def layer(self, j: int) -> torch.Tensor:
        import safemoe

        inputs = self.inputs
        routing = safemoe.route(
            inputs.logits[j], self.top_k, num_valid=self.nv_tensor, backend=self.route_backend
        )
        return safemoe.experts(
            inputs.xs[j],
            self.w13,
            self.w2,
            routing,
            activation=self.activation,
            num_valid=self.nv_tensor,
            backend="triton",
            workspace=self.ws,
        )


def _case_rows(
    case: str,
    shape: tuple[int, int, int, int, str],
    num_tokens: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ceilings: DeviceCeilings,
    quick: bool,
) -> list[BenchRow]:
    from safemoe.peers import PeerUnavailable, grouped_mm_experts, hf_experts_loop, vllm_fused_experts

    num_experts, top_k, hidden, inter, activation = shape
    inputs = Inputs(shape, num_tokens, w13.device, seed=num_tokens)
    # The read floor counts the experts these routings hit (issue 13's "% read"; as the layer suite).
    floor, bound = moe_floor_us(num_experts, top_k, hidden, inter, num_tokens, ceilings,
                                distinct=sampled_distinct_experts(inputs.ids))
    timing = timing_args(1.3 * floor + 15)
    steps = _Steps(shape, inputs, w13, w2, num_valid=num_tokens)

    def peer(fn: Callable[..., torch.Tensor]) -> Callable[[int], torch.Tensor]:
        return lambda j: fn(inputs.xs[j], w13, w2, inputs.weights[j], inputs.ids[j], activation)

    target = VLLM_H200_US.get(case, {}).get(num_tokens)
    rows: list[BenchRow] = []

    def add(variant: str, impl: str, step: Callable[[int], torch.Tensor], how: str) -> BenchRow:
        row = BenchRow(SUITE, case, num_tokens, variant, impl, None, floor, extra={"bound": bound})
        if target is not None and impl == "safemoe-triton":
            row.extra["target_us"] = target
        rows.append(row)
        try:
            if how == "graph":
                row.median_us = time_graph(step, n_variants=N_VARIANTS, **timing)
                row.note = "graph"
            else:
                row.median_us = time_eager(step, n_variants=N_VARIANTS, iters=5 if quick else 15)
                row.note = "eager (host syncs)"
        except PeerUnavailable as exc:
            row.note = str(exc)
        except Exception as exc:  # keep the other rows: record what went wrong
            row.note = error_note(exc)
            torch.cuda.synchronize()
        if target is not None and row.median_us and impl == "safemoe-triton":
            row.extra["x_vs_target"] = round(target / row.median_us, 3)
        return row

    add("experts", "safemoe-triton", steps.experts, "graph")
    add("layer", "safemoe-triton", steps.layer, "graph").extra["route_backend"] = steps.route_backend
    add("experts", "torch-grouped_mm", peer(grouped_mm_experts), "graph")
    if num_tokens <= HF_MAX_TOKENS and not (quick and num_tokens > 256):
        add("experts", "hf-eager", peer(hf_experts_loop), "eager")
    if importlib.util.find_spec("vllm") is not None:
        add("experts", "vllm-fused_experts", peer(vllm_fused_experts), "graph")
    return rows


def _padding_rows(
    case: str,
    shape: tuple[int, int, int, int, str],
    w13: torch.Tensor,
    w2: torch.Tensor,
    ceilings: DeviceCeilings,
) -> list[BenchRow]:
    """T = 1024 with num_valid = 1 against T = 1, experts only and the whole layer."""
    num_experts, top_k, hidden, inter, _ = shape
    floor, bound = moe_floor_us(num_experts, top_k, hidden, inter, 1, ceilings)
    timing = timing_args(1.3 * floor + 15)
    rows = []
    times: dict[tuple[str, int], float | None] = {}
    for num_tokens in (1, PADDED_TOKENS):
        inputs = Inputs(shape, num_tokens, w13.device, seed=7)
        for x in inputs.xs:
            x[1:] = math.nan  # padding rows hold garbage; they must cost nothing and leak nothing
        steps = _Steps(shape, inputs, w13, w2, num_valid=1)
        for variant, step in (("padding experts", steps.experts), ("padding layer", steps.layer)):
            row = BenchRow(
                SUITE,
                case,
                num_tokens,
                variant,
                "safemoe-triton",
                None,
                floor,
                note="num_valid=1 (device tensor)",
                extra={"bound": bound, "num_valid": 1},
            )
            try:
                row.median_us = time_graph(step, n_variants=N_VARIANTS, **timing)
            except Exception as exc:
                row.note = error_note(exc)
                torch.cuda.synchronize()
            times[(variant, num_tokens)] = row.median_us
            rows.append(row)
    for row in rows:
        base = times.get((row.variant, 1))
        if row.tokens == PADDED_TOKENS and base and row.median_us:
            row.extra["x_vs_T1"] = round(row.median_us / base, 3)
    return rows


def run(ceilings: DeviceCeilings, *, quick: bool, shapes: Sequence[str] | None = None) -> list[BenchRow]:
    """shapes: the SHAPES names to run (`safemoe bench --shapes`); default all."""
    device = torch.device("cuda", torch.cuda.current_device())
    tokens = QUICK_TOKENS if quick else TOKENS
    rows: list[BenchRow] = []
    generator = torch.Generator(device=device).manual_seed(0)
    for case in chosen_cases(SHAPES, None, quick=quick, names=shapes):
        shape = SHAPES[case]
        num_experts, _, hidden, inter, _ = shape
        # Scaled so activations stay O(1): the bf16 math is then representative.
        w13 = torch.randn(
            num_experts, 2 * inter, hidden, dtype=torch.bfloat16, device=device, generator=generator
        )
        w13.mul_(hidden**-0.5)
        w2 = torch.randn(num_experts, hidden, inter, dtype=torch.bfloat16, device=device, generator=generator)
        w2.mul_(inter**-0.5)
        for num_tokens in progress(tokens, f"experts suite: {case}"):
            rows.extend(_case_rows(case, shape, num_tokens, w13, w2, ceilings, quick))
            torch.cuda.empty_cache()
        rows.extend(_padding_rows(case, shape, w13, w2, ceilings))
        del w13, w2
        torch.cuda.empty_cache()
    add_speedups(rows, "torch-grouped_mm")
    return rows


def plot(rows: list[BenchRow], out_dir: Path) -> None:
    """One PNG per model shape: % of floor against T for each (impl, variant)."""
    for case in SHAPES:
        picked = [r for r in rows if r.case == case and not r.variant.startswith("padding")]
        plot_pct_of_floor(
            picked, Path(out_dir) / f"experts_{case}.png", title=f"experts: {case} (% of floor)"
        )
