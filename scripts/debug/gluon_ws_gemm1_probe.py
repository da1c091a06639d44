"""Debug (issue 13): a warp-specialised Gluon GEMM1 that gathers its A rows, against the library's.

    PYTHONPATH=src:scripts/debug python3 scripts/debug/gluon_ws_gemm1_probe.py [--shapes qwen3,...]

Written in the ninth session after the Gluon GEMM2 (kernels/experts_ws.py) paid, compiled for sm_90
on the CPU machine with Triton 3.6 and 3.9, NOT yet run on a GPU: the first run checks every result
against torch and prints WRONG where it differs.

GEMM1 is two thirds of a prefill layer's FLOPs, and its A rows are x[slot // K] in the expert-sorted
order: a gather, which Hopper's TMA cannot do (no gather4 before Blackwell). So the producer here is
a partition of PRODUCER_WARPS warps: for each (tile, K step) it issues cp.async copies of the tile's
128 gathered x rows (16 bytes a copy; padding positions, slot -1, zero-filled) into the ring slot,
then one TMA load each of the expert's gate and up weight boxes. The slot's `ready` mbarrier
completes when the weights' bytes have landed (expect-tx, one arrive) and every producer thread's
copies have (cp.async.mbarrier.arrive.noinc: one arrive a thread, so the barrier counts 1 + the
producer's threads and no thread's arrive can race the others'). The MMA partition (8 warps, two
warpgroups of 64 rows) fences the generic-proxy writes for wgmma, multiplies the A slot by both
weight slots (two accumulators), frees the slot once those MMAs have retired, and stores
silu(gate) * up to the intermediate's rows (the layout GEMM2 reads).

It times, at T = 8192 with every expert given exactly T*K/E rows, the kernel in a few variants
(one reading A through TMA from x laid out by position beforehand, with that pass, a torch
index_select, timed apart: the alternative to gathering in the producer), and the library's own
GEMM1 as the table runs it (a torch.profiler trace of `safemoe.experts` on a
routing with the same per-expert counts). A measurement script, not a test.
"""

from __future__ import annotations

import statistics

import torch
import triton
from gluon_gemm2_probe import SHAPES
from gluon_ws_gemm2_probe import run_probe
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from safemoe.bench.harness import event_times_us
from safemoe.kernels.experts_ws import _coords

# Triton 3.9 renamed both loads to async_load (same arguments as 3.6's names)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _gather_producer(x_ptr, a_desc, w_desc, slots_ptr, block_end_ptr, a_bufs, gate_bufs, up_bufs, ready,
                     empty, num_m_blocks, hidden, inter, num_experts, TOP_K: gl.constexpr,
                     NUM_BINS: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                     STAGES: gl.constexpr, WARPS: gl.constexpr, GATHER: gl.constexpr):
    """GATHER: the A rows by cp.async from x; else by TMA from a_desc, over x already laid out by
    position (the pre-gathered variant)."""
    BN: gl.constexpr = w_desc.block_type.shape[0]
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BK, BK // 8], [WARPS, 1], [1, 0])
    bins = gl.arange(0, NUM_BINS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    block_end = gl.load(block_end_ptr + bins, mask=bins < num_experts, other=2147483647)
    num_n_blocks = gl.cdiv(inter, BN)
    k_steps = gl.cdiv(hidden, BK)
    ks = gl.arange(0, BK, layout=gl.SliceLayout(0, rows_layout))
    count = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
        m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
        expert = gl.sum((block_end <= m_block).to(gl.int32), axis=0)
        gate_row = expert * 2 * inter + n_block * BN
        rows = m_block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, rows_layout))
        slots = gl.load(slots_ptr + rows)
        # row offsets only (a thread's few rows); each step's [BM, BK] pointers are formed where
        # the copies use them, 16 bytes a copy
        row_offsets = (gl.maximum(slots, 0) // TOP_K).to(gl.int64) * hidden
        for k in range(k_steps):
            slot = count % STAGES
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            if GATHER:
                cols = k * BK + ks
                _cp_async(a_bufs.index(slot), x_ptr + row_offsets[:, None] + cols[None, :],
                          mask=(slots >= 0)[:, None] & (cols < hidden)[None, :])
                async_copy.mbarrier_arrive(bar, increment_count=False)
                mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
            else:
                mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes)
                _tma_load(a_desc, [m_block * BM, k * BK], bar, a_bufs.index(slot))
            # gate rows [n, n + BN) and up rows [I + n, ...) of the expert (boxes past I read the
            # next rows, whose columns are never stored; past H zeros)
            _tma_load(w_desc, [gate_row, k * BK], bar, gate_bufs.index(slot))
            _tma_load(w_desc, [gate_row + inter, k * BK], bar, up_bufs.index(slot))
            count += 1


@gluon.jit
def _gate_up_mma(a_bufs, gate_bufs, up_bufs, ready, empty, slots_ptr, inter_ptr, num_m_blocks, inter,
                 k_steps, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                 num_warps: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    num_n_blocks = gl.cdiv(inter, BN)
    count = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
        m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
        gate = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
        up = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
        for k in range(k_steps):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            fence_async_shared()  # the cp.async rows are generic-proxy writes; wgmma reads async
            gate = warpgroup_mma(a_bufs.index(slot), gate_bufs.index(slot).permute((1, 0)), gate,
                                 use_acc=k > 0, is_async=True)
            up = warpgroup_mma(a_bufs.index(slot), up_bufs.index(slot).permute((1, 0)), up, use_acc=k > 0,
                               is_async=True)
            # the previous step's two MMAs have retired: its slot takes new loads
            gate, up = warpgroup_mma_wait(num_outstanding=2, deps=(gate, up))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1, pred=k > 0)
            count += 1
        gate, up = warpgroup_mma_wait(num_outstanding=0, deps=(gate, up))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1)
        h = gate / (1.0 + gl.exp(-gate)) * up
        rows = m_block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        cols = n_block * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, acc_layout))
        slots = gl.load(slots_ptr + rows)
        ptrs = inter_ptr + rows.to(gl.int64)[:, None] * inter + cols[None, :]
        gl.store(ptrs, h.to(inter_ptr.dtype.element_ty), mask=(slots >= 0)[:, None] & (cols < inter)[None, :])


@gluon.jit
def _ws_gemm1(x_ptr, a_desc, w_desc, slots_ptr, block_end_ptr, num_blocks_ptr, inter_ptr, hidden, inter,
              num_experts, TOP_K: gl.constexpr, NUM_BINS: gl.constexpr, BK: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
              PRODUCER_REGS: gl.constexpr, GATHER: gl.constexpr, num_warps: gl.constexpr):
    """inter[position] = silu(x[slot // K] @ w_gate.T) * (x[slot // K] @ w_up.T) for the 128-row
    M-blocks of the dispatch layout; w_desc: [BN, BK] boxes of w13 seen as [E * 2I, H]; a_desc
    (GATHER False): [128, BK] boxes of x laid out by position (with GATHER, any descriptor)."""
    BM: gl.constexpr = 128
    BN: gl.constexpr = w_desc.block_type.shape[0]
    num_m_blocks = gl.load(num_blocks_ptr)
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], w_desc.dtype)
    a_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BM, BK], a_layout)
    gate_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    up_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # the expect-tx arrive, and with GATHER one cp.async arrive per producer thread
        mbarrier.init(ready.index(i), count=1 + 32 * PRODUCER_WARPS if GATHER else 1)
        mbarrier.init(empty.index(i), count=1)
    k_steps = gl.cdiv(hidden, BK)
    gl.warp_specialize([
        (_gate_up_mma, (a_bufs, gate_bufs, up_bufs, ready, empty, slots_ptr, inter_ptr, num_m_blocks, inter,
                        k_steps, BM, BN, GROUP_M, STAGES, num_warps)),
        (_gather_producer, (x_ptr, a_desc, w_desc, slots_ptr, block_end_ptr, a_bufs, gate_bufs, up_bufs,
                            ready, empty, num_m_blocks, hidden, inter, num_experts, TOP_K, NUM_BINS, BM, BK,
                            GROUP_M, STAGES, PRODUCER_WARPS, GATHER)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def weight_descriptor(w13_rows: torch.Tensor, bn: int, bk: int) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    return TensorDescriptor.from_tensor(w13_rows, [bn, bk], layout)


def launch(x, a_desc, w_desc, slots, block_end, num_blocks, inter_rows, experts, top_k, bk, stages,
           producer_warps, producer_regs, grid, gather=True) -> None:
    _ws_gemm1[(grid,)](
        x, a_desc, w_desc, slots, block_end, num_blocks, inter_rows, x.shape[1], inter_rows.shape[1], experts,
        TOP_K=top_k, NUM_BINS=1 << experts.bit_length(), BK=bk, GROUP_M=8, STAGES=stages,
        PRODUCER_WARPS=producer_warps, PRODUCER_REGS=producer_regs, GATHER=gather, num_warps=8,
        maxnreg=65536 // (32 * (8 + 4 * triton.cdiv(producer_warps, 4))) // 8 * 8,
    )


def library_gemm1_us(experts: int, top_k: int, hidden: int, inter: int, tokens: int) -> float:
    """Device time of the library's GEMM1 launches in `safemoe.experts` (the table's tiles) on a
    routing giving every expert exactly T*K/E rows, from a profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    import safemoe

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 *= hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=g) * inter**-0.5
    ids = torch.arange(tokens, device="cuda")[:, None] * top_k + torch.arange(top_k, device="cuda")
    ids %= experts
    weights = torch.rand(tokens, top_k, device="cuda", generator=g)
    routing = safemoe.Routing(weights=weights, ids=ids.to(torch.int32))
    ws = safemoe.Workspace(tokens, experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    for _ in range(3):
        safemoe.experts(x, w13, w2, routing, workspace=ws)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            safemoe.experts(x, w13, w2, routing, workspace=ws)
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if "_gemm1_" in e.key) / 10


def probe_shape(name: str, tokens: int, peak: float, sms: int, variants: list) -> None:
    experts, top_k, hidden, inter = SHAPES[name]
    slots_total = tokens * top_k
    rows_per_expert = slots_total // experts
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 *= hidden**-0.5
    # position p holds slot slots[p]; expert p // rows_per_expert (the layout of balanced routing)
    slots = torch.randperm(slots_total, device="cuda", generator=g).to(torch.int32)
    flops = 2 * slots_total * 2 * inter * hidden
    gathered = x[(slots // top_k).long()].float().view(experts, rows_per_expert, hidden)
    both = gathered @ w13.float().transpose(1, 2)
    expected = (torch.nn.functional.silu(both[..., :inter]) * both[..., inter:]).reshape(slots_total, inter)
    inter_rows = torch.empty(slots_total, inter, device="cuda", dtype=torch.bfloat16)
    num_m_blocks = slots_total // 128
    block_end = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows_per_expert // 128)
    num_blocks = torch.tensor([num_m_blocks, 0], device="cuda", dtype=torch.int32)
    w13_rows = w13.view(experts * 2 * inter, hidden)

    def line(label: str, us: float, err: float | None = None) -> None:
        bad = "" if err is None or err < 1e-2 else f"  WRONG rel err {err:.3g}"
        rate = flops / us / 1e6
        print(f"  {label:44s} {us:9.1f} us {rate:5.0f} TFLOP/s ({rate / peak:5.1%}){bad}", flush=True)

    print(f"{name} GEMM1 T={tokens} ({slots_total} rows, {rows_per_expert} an expert, N 2 x {inter}, "
          f"K {hidden})", flush=True)
    try:
        line("library GEMM1 (the table's tiles)", library_gemm1_us(experts, top_k, hidden, inter, tokens))
    except Exception as exc:  # a probe: report and go on
        print(f"  library: {type(exc).__name__}: {exc}"[:300], flush=True)
    tokens_by_position = (slots // top_k).long()
    x_sorted = torch.empty(slots_total, hidden, device="cuda", dtype=torch.bfloat16)

    def gather_pass() -> None:  # the pre-gathered variant's extra pass (torch, for scale)
        torch.index_select(x, 0, tokens_by_position, out=x_sorted)

    gather_pass()
    gather_us = statistics.median(event_times_us(gather_pass, iters=20, warmup=2))
    print(f"  (torch index_select of x by position: {gather_us:.1f} us)", flush=True)
    for bn, bk, stages, producer_warps, producer_regs, gather in variants:
        w_desc = weight_descriptor(w13_rows, bn, bk)
        a_desc = weight_descriptor(x_sorted, 128, bk)
        grid = min(num_m_blocks * triton.cdiv(inter, bn), sms)

        def run(a_desc=a_desc, w_desc=w_desc, bk=bk, stages=stages, warps=producer_warps, regs=producer_regs,
                grid=grid, gather=gather) -> None:
            launch(x, a_desc, w_desc, slots, block_end, num_blocks, inter_rows, experts, top_k, bk, stages,
                   warps, regs, grid, gather)

        how = "gather" if gather else "pre-gathered TMA"
        label = f"WS {how} BN {bn} BK {bk} x{stages} producer {producer_warps}w/{producer_regs}r"
        try:
            inter_rows.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            err = ((inter_rows.float() - expected).norm() / expected.norm()).item()
            line(label, statistics.median(event_times_us(run, iters=20, warmup=2)), err)
        except Exception as exc:  # a probe: report and go on
            print(f"  {label}: {type(exc).__name__}: {exc}"[:400], flush=True)


def main() -> None:
    # (BN, BK, STAGES, producer warps, producer registers, gather): a stage is a [128, BK] A tile and
    # two [BN, BK] weight tiles (BN 128, BK 64: 48 KiB); gather False reads A through TMA from x
    # laid out by position beforehand (that pass printed apart)
    variants = [(128, 64, 4, 4, 88, True), (128, 64, 3, 4, 88, True), (64, 64, 5, 4, 88, True),
                (128, 64, 4, 8, 64, True), (128, 64, 4, 1, 40, False)]
    run_probe(__doc__.splitlines()[0], probe_shape, variants)


if __name__ == "__main__":
    main()
