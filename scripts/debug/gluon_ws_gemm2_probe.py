"""Debug (issue 13): a warp-specialised Gluon prefill GEMM2 against the library's Triton GEMM2.

    PYTHONPATH=src:scripts/debug python3 scripts/debug/gluon_ws_gemm2_probe.py [--shapes qwen3,...]

The eighth session's naive Gluon GEMM2 (`gluon_gemm2_probe.py`: the MMA warps issue their own TMA
loads, one MMA in flight) ran at 37-69% of the bf16 peak. This probe times the library's warp-
specialised GEMM2 (`safemoe.kernels.experts_ws._gemm2_ws_kernel`: a one-warp TMA producer, two wgmma
warpgroups, optionally a store partition; the design is in that module and docs/experts.md) at T =
8192 with every expert given exactly T*K/E rows (no padding: the layout of a uniform, multiple-
of-128 routing), in a few ring/engine variants, beside the naive kernel's best variant, torch's
grouped_mm on the same rows and the library's own GEMM2 as the table runs it (the Triton
`_gemm2_kernel` or, since the ninth session's table, the Gluon one at some T = 8192 points; from a
torch.profiler trace of `safemoe.experts` on a routing with the same per-expert counts); every
result is checked against torch. A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
from gluon_gemm2_probe import SHAPES, expected_gemm2
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from safemoe.bench.harness import event_times_us


def descriptors(inter_rows: torch.Tensor, w2_rows: torch.Tensor, bm: int, bn: int, bk: int):
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    return (
        TensorDescriptor.from_tensor(inter_rows, [bm, bk], a_layout),
        TensorDescriptor.from_tensor(w2_rows, [bn, bk], b_layout),
    )


def timed(fn, rounds: int = 25) -> float:
    """Median microseconds of a call (the bench's per-call CUDA-event timing)."""
    return statistics.median(event_times_us(fn, iters=rounds, warmup=2))


def library_gemm2_us(experts: int, top_k: int, hidden: int, inter: int, tokens: int) -> float:
    """Device time of the library's GEMM2 launches in `safemoe.experts` on a routing giving every
    expert exactly T*K/E rows (token t's k-th expert (t*K + k) % E), from a profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    import safemoe

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = (
        torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
        * hidden**-0.5
    )
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=g) * inter**-0.5
    ids = (
        (torch.arange(tokens, device="cuda")[:, None] * top_k + torch.arange(top_k, device="cuda")) % experts
    ).to(torch.int32)
    weights = torch.rand(tokens, top_k, device="cuda", generator=g)
    routing = safemoe.Routing(weights=weights, ids=ids)
    ws = safemoe.Workspace(tokens, experts, top_k, hidden, inter, torch.bfloat16, "cuda")

    def step() -> None:
        safemoe.experts(x, w13, w2, routing, workspace=ws)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    reps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    # the Triton _gemm2_kernel, or where the table runs the Gluon engine, _gemm2_ws_kernel
    total = sum(e.device_time_total for e in prof.key_averages() if "_gemm2_" in e.key and "kernel" in e.key)
    return total / reps


def run_probe(description: str, probe_shape, variants: list) -> None:
    """--shapes / --tokens, the bf16 ceiling measured once, then probe_shape(name, T, peak, SMs,
    variants) for each shape (shared by the Gluon GEMM1 probe)."""
    from safemoe.bench.harness import _measure_bf16_tflops

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shapes", default="qwen3,deepseek,gptoss,mixtral")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak = _measure_bf16_tflops(torch.device("cuda"), 8192)
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}: "
          f"bf16 peak (torch.mm 8192^3) {peak:.0f} TFLOP/s", flush=True)
    for name in args.shapes.split(","):
        probe_shape(name, args.tokens, peak, sms, variants)
        torch.cuda.empty_cache()


def main() -> None:
    # (engine, BN, BK, STAGES, GROUP_M); the ninth session also ran GROUP_M 4 / 16, 128-column
    # tiles and a 2-stage store partition (all slower, docs/experts.md)
    variants = [("ws", 256, 64, 3, 8), ("ws", 256, 64, 4, 8), ("ws_store", 256, 64, 3, 8)]
    run_probe(__doc__.splitlines()[0], probe_shape, variants)


def probe_shape(name: str, tokens: int, peak: float, sms: int, variants: list) -> None:
    """Every kernel of the probe on one shape at T = tokens."""
    from gluon_gemm2_probe import _grouped_gemm2

    from safemoe.peers import _grouped_mm_op

    experts, top_k, hidden, inter = SHAPES[name]
    slots_total = tokens * top_k
    rows_per_expert = slots_total // experts
    g = torch.Generator(device="cuda").manual_seed(0)
    inter_rows = torch.randn(slots_total, inter, device="cuda", dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=g) * inter**-0.5
    slots = torch.randperm(slots_total, device="cuda", generator=g).to(torch.int32)
    weights = torch.rand(slots_total, device="cuda", generator=g)
    flops = 2 * slots_total * hidden * inter

    def line(label: str, us: float, err: float | None = None) -> None:
        bad = "" if err is None or err < 1e-2 else f"  WRONG rel err {err:.3g}"
        print(
            f"  {label:44s} {us:9.1f} us {flops / us / 1e6:5.0f} TFLOP/s ({flops / us / 1e6 / peak:5.1%})"
            + bad,
            flush=True,
        )

    print(
        f"{name} GEMM2 T={tokens} ({slots_total} rows, {rows_per_expert} an expert, N {hidden}, K {inter})",
        flush=True,
    )
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows_per_expert
    grouped_mm = _grouped_mm_op()[0]
    line("torch grouped_mm", timed(lambda: grouped_mm(inter_rows, w2.transpose(1, 2), offs=offs)))
    try:
        line(
            "library GEMM2 (the table's engine and tiles)",
            library_gemm2_us(experts, top_k, hidden, inter, tokens),
        )
    except Exception as exc:  # a probe: report and go on
        print(f"  library: {type(exc).__name__}: {exc}"[:300], flush=True)
    expected_y = expected_gemm2(inter_rows, w2, slots, weights)
    y = torch.empty(slots_total, hidden, device="cuda", dtype=torch.bfloat16)
    bm = 128
    num_m_blocks = slots_total // bm
    block_expert = (torch.arange(num_m_blocks, device="cuda", dtype=torch.int32) * bm) // rows_per_expert
    from safemoe.kernels import experts_ws as ws
    from safemoe.workspace import num_bins

    w2_rows = w2.view(experts * hidden, inter)

    def check(run) -> float:
        y.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        return ((y.float() - expected_y).norm() / expected_y.norm()).item()

    a_desc, b_desc = descriptors(inter_rows, w2_rows, 128, 256, 64)
    grid = min(num_m_blocks * triton.cdiv(hidden, 256), sms)
    naive_args = (a_desc, b_desc, block_expert, slots, weights, y, num_m_blocks, hidden, inter)

    def naive(args_now=naive_args, grid=grid) -> None:
        _grouped_gemm2[(grid,)](*args_now, GROUP_M=8, NUM_BUFFERS=3, STORE_BLOCKED=True, num_warps=8)

    try:
        err = check(naive)
        line("naive gluon BN 256 BK 64 x3 (8th session)", timed(naive), err)
    except Exception as exc:
        print(f"  naive: {type(exc).__name__}: {exc}"[:300], flush=True)
    block_end = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows_per_expert // bm)
    num_blocks = torch.tensor([num_m_blocks, 0], device="cuda", dtype=torch.int32)
    for engine, bn, bk, stages, group_m in variants:
        a_desc, b_desc = descriptors(inter_rows, w2_rows, bm, bn, bk)
        grid = min(num_m_blocks * triton.cdiv(hidden, bn), sms)
        ws_args = (a_desc, b_desc, weights, slots, block_end, num_blocks, y, hidden, inter, experts)

        def run(args_now=ws_args, grid=grid, stages=stages, group_m=group_m, engine=engine) -> None:
            ws._gemm2_ws_kernel[(grid,)](
                *args_now,
                NUM_BINS=num_bins(experts),
                GROUP_M=group_m,
                STAGES=stages,
                STORE_PARTITION=engine == "ws_store",
                PRODUCER_REGS=ws.PRODUCER_REGS,
                STORE_WARPS=ws.STORE_WARPS,
                STORE_REGS=ws.STORE_REGS,
                STORE_ROWS=ws.STORE_ROWS,
                num_warps=ws.NUM_WARPS,
                maxnreg=ws.MAX_NREG,
            )

        label = f"{engine} BN {bn} BK {bk} x{stages} G{group_m}"
        try:
            err = check(run)
            line(label, timed(run), err)
        except Exception as exc:  # a probe: report and go on
            print(f"  {label}: {type(exc).__name__}: {exc}"[:400], flush=True)


if __name__ == "__main__":
    main()
