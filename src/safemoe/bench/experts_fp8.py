"""Suite `experts_fp8`: the fp8 (e4m3) expert kernels against their floor, the bf16 kernels and peers.

Cases (E, K, H, I): Qwen3-30B-A3B (128, 8, 2048, 768) and DeepSeek-V3 (256, 8, 7168, 2048);
full runs add Mixtral-8x7B (8, 2, 4096, 14336) and gpt-oss-120b (128, 4, 2880, 2880,
swigluoai). Uniform random routing, 4 rotating input sets, CUDA-graph replay, one workspace.
T: quick 8, 64, 256, 8192, 16384 (the issue's decode range and prefill points); full 1..16384.
Implementations, each `experts` only (dispatch + GEMMs + combine, with the activation
quantisation kernels for fp8):
- `safemoe-fp8-block`: DeepSeek-V3 128x128 weight blocks, 1x128 activation groups;
- `safemoe-fp8-per_tensor`: one scale per expert matrix, per-token activation scales;
- `safemoe-bf16`: the bf16 kernels on the bf16 weights the fp8 ones were quantised from
  (`x_vs_bf16` on the fp8 rows; quick runs time it at T = 16384 only, the issue's comparison);
- `torch-scaled_grouped_mm`: per-tensor weights with rowwise activation scales through
  `torch._scaled_grouped_mm` (the mode it supports; our own torch code around it: sort, per-row
  quantisation, activation, weighted scatter-add), fast accumulation;
- vLLM's fp8 `fused_experts` when importable.
Variant `quantize` (block mode, T = 8 and 16384): the two activation-quantisation launches alone
on the call's own layout: what fusing them into the GEMMs could save at most.

Floor per row = max(read floor, FLOP floor):
  read floor = D x (3*H*I bytes of fp8 weights + their fp32 scales) / streaming-read bandwidth,
               D = E(1 - (1 - K/E)^T) distinct experts touched
  FLOP floor = 2*T*K*3*H*I / fp8 matmul peak (torch._scaled_mm, measured in the same run)
The bf16 rows keep the bf16 floor (2 bytes per weight, bf16 peak), as in suite `experts`.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from safemoe.bench.experts import N_VARIANTS, Inputs, timing_args
from safemoe.bench.harness import (
    BenchRow,
    DeviceCeilings,
    bytes_floor_us,
    chosen_cases,
    distinct_experts,
    error_note,
    flops_floor_us,
    moe_floor_us,
    moe_flops,
    plot_pct_of_floor,
    progress,
    sampled_distinct_experts,
    time_graph,
    write_targets,
)

if TYPE_CHECKING:
    from safemoe._checks import NumValid
    from safemoe.workspace import Workspace

SUITE = "experts_fp8"

# name: (E, K, H, I, activation)
SHAPES: dict[str, tuple[int, int, int, int, str]] = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu"),
    "deepseek-v3": (256, 8, 7168, 2048, "silu"),
    "mixtral-8x7b": (8, 2, 4096, 14336, "silu"),
    "gpt-oss-120b": (128, 4, 2880, 2880, "swigluoai"),
}
QUICK_SHAPES = ("qwen3-30b-a3b", "deepseek-v3")
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_TOKENS = (8, 64, 256, 8192, 16384)
QUANTIZE_TOKENS = (8, 16384)
MODES = ("block", "per_tensor")
PREFILL_TARGET = 1.6  # issue 7: fp8 >= 1.6 x the bf16 kernel at T = 16384
DECODE_TARGET_PCT = 85.0  # issue 7: >= 85% of the fp8 read floor for T = 8..256
# Issue 13's fp8 targets, judged in `targets_table` (experts_fp8_targets.md): block mode >= 1.5x
# the bf16 kernel at T = 8192 on DeepSeek-V3 and Qwen3; >= 88% of the fp8 floor at T = 8..256,
# every shape and mode (those points are read-bound: the row's `bound` says so).
PREFILL_TOKENS_13 = 8192
PREFILL_X_13 = 1.5
PREFILL_SHAPES_13 = ("deepseek-v3", "qwen3-30b-a3b")
DECODE_PCT_13 = 88.0


def fp8_floor_us(
    shape: tuple[int, int, int, int, str], num_tokens: int, mode: str, ceilings: DeviceCeilings,
    distinct: float | None = None,
) -> tuple[float, str]:
    """(floor, bound) of an fp8 expert step: fp8 weight + scale bytes read, or fp8 FLOPs. `distinct`:
    the experts the timed routings hit (default: the uniform expectation)."""
    num_experts, top_k, hidden, inter, _ = shape
    if mode == "block":
        scales = 3 * math.ceil(hidden / 128) * math.ceil(inter / 128) * 4  # w13 and w2 block grids
    else:
        scales = 2 * 4
    if distinct is None:
        distinct = distinct_experts(num_experts, top_k, num_tokens)
    nbytes = distinct * (3 * hidden * inter + scales)
    read = bytes_floor_us(nbytes, ceilings.read_gbps)
    peak = ceilings.fp8_tflops or 2 * ceilings.bf16_tflops
    compute = flops_floor_us(moe_flops(num_tokens, top_k, hidden, inter), peak)
    return (read, "read") if read >= compute else (compute, "flops")


class _Weights:
    """bf16 weights of one shape and their two fp8 forms (quantised expert by expert)."""

    def __init__(self, shape: tuple[int, int, int, int, str], device: torch.device, seed: int) -> None:
        from safemoe._checks import check_fp8_weights
        from safemoe.fp8 import quantize_experts

        num_experts, _, hidden, inter, _ = shape
        gen = torch.Generator(device=device).manual_seed(seed)
        self.w13 = torch.randn(
            num_experts, 2 * inter, hidden, dtype=torch.bfloat16, device=device, generator=gen
        )
        self.w13.mul_(hidden**-0.5)
        self.w2 = torch.randn(num_experts, hidden, inter, dtype=torch.bfloat16, device=device, generator=gen)
        self.w2.mul_(inter**-0.5)
        self.fp8 = {}
        for mode in MODES:
            q13, q2, s13, s2 = quantize_experts(self.w13, self.w2, mode)
            self.fp8[mode] = (q13, q2, check_fp8_weights(q13, q2, s13, s2))


def _scaled_grouped_mm_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """Per-tensor fp8 experts through torch._scaled_grouped_mm (rowwise scales: per-token
    activation scales, each weight column scaled by its expert's per-tensor scale)."""
    from safemoe.peers import PeerUnavailable
    from safemoe.reference import FP8_DTYPE, FP8_MAX, activation_reference

    op = getattr(torch, "_scaled_grouped_mm", None)
    if op is None:
        raise PeerUnavailable("torch._scaled_grouped_mm: not in this torch")
    num_tokens, top_k = ids.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2

    def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale = t.float().abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
        return (t.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale

    sorted_ids, order = torch.sort(ids.reshape(-1))
    token_of_slot = order // top_k
    counts = torch.histc(sorted_ids.int(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    xq, xs = quantize(x[token_of_slot])
    scale13 = w13_scale.reshape(num_experts, -1)[:, :1].expand(num_experts, two_inter).contiguous()
    h = op(
        xq, w13.transpose(-2, -1), xs, scale13, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True
    )
    act = activation_reference(h[:, :inter].float(), h[:, inter:].float(), activation).to(torch.bfloat16)
    aq, a_scale = quantize(act)
    scale2 = w2_scale[:, None].expand(num_experts, w2.shape[1]).contiguous()
    y = op(
        aq, w2.transpose(-2, -1), a_scale, scale2, offs=offsets, out_dtype=torch.bfloat16, use_fast_accum=True
    )
    y = y.float() * weights.reshape(-1)[order][:, None]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of_slot, y)
    return out.to(x.dtype)


def _vllm_fp8_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    block: bool,
) -> torch.Tensor:
    from safemoe.peers import PeerUnavailable

    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except ImportError as exc:
        raise PeerUnavailable(f"vllm fp8 fused_experts: not importable ({exc})") from exc
    try:
        return fused_experts(
            x,
            w13,
            w2,
            weights,
            ids,
            use_fp8_w8a8=True,
            w1_scale=w13_scale,
            w2_scale=w2_scale,
            block_shape=[128, 128] if block else None,
        )
    except (AttributeError, TypeError) as exc:
        raise PeerUnavailable(f"vllm fp8 fused_experts: API not recognised ({exc})") from exc


def _vllm_step(inputs: Inputs, weights: _Weights, mode: str) -> Callable[[int], torch.Tensor]:
    w13, w2, spec = weights.fp8[mode]

    def step(j: int) -> torch.Tensor:
        return _vllm_fp8_experts(
            inputs.xs[j],
            w13,
            w2,
            spec.w13_scale,
            spec.w2_scale,
            inputs.weights[j],
            inputs.ids[j],
            mode == "block",
        )

    return step


def _case_rows(
    case: str,
    shape: tuple[int, int, int, int, str],
    num_tokens: int,
    weights: _Weights,
    ceilings: DeviceCeilings,
    *,
    with_bf16: bool = True,
) -> list[BenchRow]:
    from safemoe._checks import NumValid
    from safemoe.kernels.experts import experts_triton
    from safemoe.peers import PeerUnavailable
    from safemoe.workspace import Workspace

    num_experts, top_k, hidden, inter, activation = shape
    device = weights.w13.device
    inputs = Inputs(shape, num_tokens, device, seed=num_tokens)
    # The read floors count the experts these routings hit (issue 13's "% read"; as the layer suite).
    distinct = sampled_distinct_experts(inputs.ids)
    outs = [torch.empty_like(x) for x in inputs.xs]
    workspace = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device, fp8=True)
    nv = NumValid(None, torch.tensor(num_tokens, device=device, dtype=torch.int32))
    rows: list[BenchRow] = []

    def add(
        impl: str, step: Callable[[int], object], floor: tuple[float, str], variant: str = "experts"
    ) -> BenchRow:
        row = BenchRow(
            SUITE, case, num_tokens, variant, impl, None, floor[0], note="graph", extra={"bound": floor[1]}
        )
        rows.append(row)
        try:
            row.median_us = time_graph(step, n_variants=N_VARIANTS, **timing_args(1.3 * floor[0] + 15))
        except PeerUnavailable as exc:
            row.note = str(exc)
        except Exception as exc:  # keep the other rows: record what went wrong
            row.note = error_note(exc)
            torch.cuda.synchronize()
        return row

    def safemoe_step(mode: str | None) -> Callable[[int], object]:
        if mode is None:
            w13, w2, fp8 = weights.w13, weights.w2, None
        else:
            w13, w2, fp8 = weights.fp8[mode]
        return lambda j: experts_triton(
            inputs.xs[j],
            w13,
            w2,
            inputs.weights[j],
            inputs.ids[j],
            activation=activation,
            num_valid=nv,
            health=None,
            workspace=workspace,
            out=outs[j],
            fp8=fp8,
        )

    for mode in MODES:
        add(f"safemoe-fp8-{mode}", safemoe_step(mode),
            fp8_floor_us(shape, num_tokens, mode, ceilings, distinct))
    bf16 = None
    if with_bf16:
        bf16_floor = moe_floor_us(num_experts, top_k, hidden, inter, num_tokens, ceilings, distinct=distinct)
        bf16 = add("safemoe-bf16", safemoe_step(None), bf16_floor)
    q13, q2, per_tensor = weights.fp8["per_tensor"]
    add(
        "torch-scaled_grouped_mm",
        lambda j: _scaled_grouped_mm_experts(
            inputs.xs[j],
            q13,
            q2,
            per_tensor.w13_scale,
            per_tensor.w2_scale,
            inputs.weights[j],
            inputs.ids[j],
            activation,
        ),
        fp8_floor_us(shape, num_tokens, "per_tensor", ceilings, distinct),
    )
    if importlib.util.find_spec("vllm") is not None:
        for mode in MODES:
            add(
                f"vllm-fp8-{mode}",
                _vllm_step(inputs, weights, mode),
                fp8_floor_us(shape, num_tokens, mode, ceilings, distinct),
            )
    if num_tokens in QUANTIZE_TOKENS:
        rows.append(_quantize_row(case, shape, num_tokens, weights, inputs, workspace, nv, ceilings))
    fp8_rows = [r for r in rows if r.impl.startswith("safemoe-fp8") and r.variant == "experts"]
    for row in fp8_rows:
        if row.median_us and bf16 is not None and bf16.median_us:
            row.extra["x_vs_bf16"] = round(bf16.median_us / row.median_us, 3)
        if num_tokens == 16384:
            row.extra["target_x_vs_bf16"] = PREFILL_TARGET
        if 8 <= num_tokens <= 256:
            row.extra["target_pct_of_floor"] = DECODE_TARGET_PCT
    peer = {r.variant: r.median_us for r in rows if r.impl == "torch-scaled_grouped_mm" and r.median_us}
    for row in rows:
        if row.impl.startswith("safemoe-fp8") and row.median_us and peer.get(row.variant):
            row.extra["x_vs_torch-scaled_grouped_mm"] = round(peer[row.variant] / row.median_us, 3)
    return rows


def _quantize_row(
    case: str,
    shape: tuple[int, int, int, int, str],
    num_tokens: int,
    weights: _Weights,
    inputs: Inputs,
    workspace: Workspace,
    nv: NumValid,
    ceilings: DeviceCeilings,
) -> BenchRow:
    """The two quantisation launches of block mode alone, on the layout of a full call."""
    from safemoe.configs import get_config
    from safemoe.kernels.act_quant import quantize_positions_into, quantize_rows_into
    from safemoe.kernels.experts import experts_triton
    from safemoe.workspace import max_m_blocks

    num_experts, top_k, hidden, inter, activation = shape
    w13, w2, fp8 = weights.fp8["block"]
    experts_triton(
        inputs.xs[0],
        w13,
        w2,
        inputs.weights[0],
        inputs.ids[0],
        activation=activation,
        num_valid=nv,
        health=None,
        workspace=workspace,
        out=torch.empty_like(inputs.xs[0]),
        fp8=fp8,
    )
    cfg = get_config(num_tokens, num_experts, hidden, inter, top_k, torch.bfloat16, w13.device, "block")
    views = workspace.views(num_tokens, num_experts, top_k, hidden, inter)
    f8 = workspace.fp8_views(num_tokens, num_experts, top_k, hidden, inter, 128)
    positions = max_m_blocks(num_tokens, num_experts, top_k, cfg.block_m) * cfg.block_m

    def step(j: int) -> None:
        quantize_rows_into(inputs.xs[j], f8.x, f8.x_scale, 128, nv)
        quantize_positions_into(
            views.intermediate,
            f8.inter,
            f8.inter_scale,
            128,
            views.sorted_slots,
            views.num_blocks,
            cfg.block_m,
            0,
            positions,
        )

    # bytes: x read (2 B) + fp8 written; used intermediate rows read (2 B) + fp8 written
    nbytes = num_tokens * hidden * 3 + num_tokens * top_k * inter * 3
    floor = bytes_floor_us(nbytes, ceilings.copy_gbps)
    row = BenchRow(
        SUITE,
        case,
        num_tokens,
        "quantize",
        "safemoe-fp8-block",
        None,
        floor,
        note="graph",
        extra={"bound": "copy", "what": "x + intermediate quantisation launches only"},
    )
    try:
        row.median_us = time_graph(step, n_variants=N_VARIANTS, **timing_args(20.0))
    except Exception as exc:
        row.note = error_note(exc)
        torch.cuda.synchronize()
    return row


def run(
    ceilings: DeviceCeilings,
    *,
    quick: bool,
    on_case: Callable[[list[BenchRow]], None] | None = None,
    shapes: Sequence[str] | None = None,
) -> list[BenchRow]:
    """All rows; `on_case(rows so far)` after each model shape (partial results survive a timeout);
    shapes: the SHAPES names to run (`safemoe bench --shapes`), default all (QUICK_SHAPES with quick)."""
    device = torch.device("cuda", torch.cuda.current_device())
    rows: list[BenchRow] = []
    for case in chosen_cases(SHAPES, QUICK_SHAPES, quick=quick, names=shapes):
        shape = SHAPES[case]
        weights = _Weights(shape, device, seed=0)
        for num_tokens in progress(QUICK_TOKENS if quick else TOKENS, f"experts_fp8 suite: {case}"):
            # quick: the bf16 kernels only where the issues compare with them (prefill)
            with_bf16 = not quick or num_tokens >= PREFILL_TOKENS_13
            rows.extend(_case_rows(case, shape, num_tokens, weights, ceilings, with_bf16=with_bf16))
            torch.cuda.empty_cache()
        del weights
        torch.cuda.empty_cache()
        if on_case is not None:
            on_case(rows)
    return rows


def targets_table(rows: list[BenchRow]) -> list[dict[str, Any]]:
    """Issue 13's fp8 targets on safemoe's fp8 rows: (target, case, T, limit, measured, met)."""
    out: list[dict[str, Any]] = []
    ours = sorted((r for r in rows if r.impl.startswith("safemoe-fp8") and r.variant == "experts"
                   and r.median_us is not None), key=lambda r: (r.case, r.impl, r.tokens))  # fmt: skip
    decode_target = f">= {DECODE_PCT_13:.0f}% of the fp8 floor at T = 8..256"
    prefill_target = f">= {PREFILL_X_13}x the bf16 kernel at T = {PREFILL_TOKENS_13}"
    for r in ours:
        mode = r.impl.removeprefix("safemoe-fp8-")
        pct = r.pct_of_floor
        if 8 <= r.tokens <= 256 and pct is not None:
            out.append({"target": f"fp8 decode ({mode}): {decode_target}", "case": r.case, "T": r.tokens,
                        "limit": f"{DECODE_PCT_13:.0f}%", "met": pct >= DECODE_PCT_13,
                        "measured": f"{pct:.1f}% ({r.extra.get('bound', '')}-bound)"})  # fmt: skip
        if (mode == "block" and r.tokens == PREFILL_TOKENS_13 and r.case in PREFILL_SHAPES_13
                and "x_vs_bf16" in r.extra):
            speedup = float(r.extra["x_vs_bf16"])
            out.append({"target": f"fp8 prefill (block): {prefill_target}", "case": r.case, "T": r.tokens,
                        "limit": f"{PREFILL_X_13}x", "measured": f"{speedup:.2f}x",
                        "met": speedup >= PREFILL_X_13})  # fmt: skip
    return out


def plot(rows: list[BenchRow], out_dir: Path) -> None:
    """`experts_fp8_targets.md` (issue 13's fp8 targets) and one PNG per model shape: % of floor
    against T for each implementation."""
    write_targets(targets_table(rows), Path(out_dir) / f"{SUITE}_targets.md")
    for case in SHAPES:
        picked = [r for r in rows if r.case == case and r.variant == "experts"]
        if picked:
            plot_pct_of_floor(
                picked, Path(out_dir) / f"experts_fp8_{case}.png", title=f"experts fp8: {case} (% of floor)"
            )


def main(argv: list[str] | None = None) -> int:
    """`python -m safemoe.bench.experts_fp8 [--quick] --out DIR`: this suite alone, results (CSV,
    JSON, table) written after each model shape, PNGs at the end."""
    import argparse

    from safemoe.bench.harness import measure_ceilings, write_results

    parser = argparse.ArgumentParser(prog="python -m safemoe.bench.experts_fp8")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings()
    print(f"ceilings: {ceilings.summary()}", flush=True)

    def save(rows: list[BenchRow]) -> None:
        write_results(rows, args.out, SUITE, ceilings)  # prints the table too

    rows = run(ceilings, quick=args.quick, on_case=save)
    plot(rows, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
