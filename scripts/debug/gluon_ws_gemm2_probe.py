"""Debug (issue 13): a warp-specialised Gluon prefill GEMM2 against the library's Triton GEMM2.

    PYTHONPATH=src:scripts/debug python3 scripts/debug/gluon_ws_gemm2_probe.py [--shapes qwen3,...]

The eighth session's naive Gluon GEMM2 (`gluon_gemm2_probe.py`: the consumer warps issue their own
TMA loads, one MMA in flight) ran at 37-69% of the bf16 peak. This probe splits the work the way
Hopper GEMMs that reach the peak do: a one-warp producer partition issues every TMA load of the
program's tile sequence into a ring of STAGES shared-memory slots (a `ready` and an `empty`
mbarrier per slot), and the default partition (8 warps, two warpgroups, each 64 rows of a 128-row
tile) only waits, issues wgmma with one group in flight, releases a slot when the MMA reading it
has retired, and runs the library's epilogue (each row scaled by its slot's routing weight in fp32
and scattered to y[slot]; rows of slot -1 never stored). So the producer runs ahead into the next
tile's K steps while the consumers do an epilogue.

It times, at T = 8192 with every expert given exactly T*K/E rows (no padding: the layout of a
uniform, multiple-of-128 routing), the WS kernel (several ring/tile variants), the naive kernel's
best variant, torch's grouped_mm on the same rows, and the library's own `_gemm2_kernel` (the
table's tiles, from a torch.profiler trace of `safemoe.experts` on a routing with the same
per-expert counts), every result checked against torch. A measurement script, not a test.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from safemoe.bench.harness import event_times_us

# Triton 3.6 names the TMA load async_copy_global_to_shared; 3.9 only async_load (same arguments).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

SHAPES = {
    "qwen3": (128, 8, 2048, 768),
    "deepseek": (256, 8, 7168, 2048),
    "gptoss": (128, 4, 2880, 2880),
    "mixtral": (8, 2, 4096, 14336),
}


@gluon.jit
def _coords(tile, num_m_blocks, num_n_blocks, GROUP_M: gl.constexpr):
    """(m_block, n_block) of a tile, GROUP_M M-blocks sharing each weight tile while it is in L2."""
    width = GROUP_M * num_n_blocks
    first_m = (tile // width) * GROUP_M
    size_m = gl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@gluon.jit
def _producer(a_desc, b_desc, block_expert_ptr, a_bufs, b_bufs, ready, empty, num_m_blocks, hidden, inter,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """One warp: every (tile, K step) load of this program, STAGES ahead of the consumers."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    num_n_blocks = gl.cdiv(hidden, BN)
    k_steps = gl.cdiv(inter, BK)
    count = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
        m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
        w_row = gl.load(block_expert_ptr + m_block) * hidden + n_block * BN
        for k in range(k_steps):
            slot = count % STAGES
            # empty barriers start in phase 1 complete: the first STAGES waits pass at once
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            _tma_load(a_desc, [m_block * BM, k * BK], bar, a_bufs.index(slot))
            _tma_load(b_desc, [w_row, k * BK], bar, b_bufs.index(slot))
            count += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, slots_ptr, weights_ptr, y_ptr, num_m_blocks, hidden, inter,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              STORE_BLOCKED: gl.constexpr, num_warps: gl.constexpr):
    """The default partition: wgmma over the ring, then the weighted scatter epilogue."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    num_n_blocks = gl.cdiv(hidden, BN)
    k_steps = gl.cdiv(inter, BK)
    count = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
        m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        for k in range(k_steps):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, use_acc=k > 0,
                                is_async=True)
            # one group in flight: the previous step's MMA has retired, its slot takes new loads
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1, pred=k > 0)
            count += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1)
        if STORE_BLOCKED:
            out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        else:
            out_layout: gl.constexpr = mma_layout
        rows = m_block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
        slots = gl.load(slots_ptr + rows)
        row_ok = slots >= 0
        weight = gl.load(weights_ptr + gl.where(row_ok, slots, 0), mask=row_ok, other=0.0)
        out = gl.convert_layout((acc * weight[:, None]).to(y_ptr.dtype.element_ty), out_layout)
        out_rows = gl.convert_layout(gl.where(row_ok, slots, -1), gl.SliceLayout(1, out_layout))
        cols = n_block * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, out_layout))
        ptrs = y_ptr + gl.maximum(out_rows, 0).to(gl.int64)[:, None] * hidden + cols[None, :]
        gl.store(ptrs, out, mask=(out_rows >= 0)[:, None] & (cols < hidden)[None, :])


@gluon.jit
def _ws_gemm2(a_desc, b_desc, block_expert_ptr, slots_ptr, weights_ptr, y_ptr, num_m_blocks, hidden, inter,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, STORE_BLOCKED: gl.constexpr,
              PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """y[slot] = weight[slot] * (intermediate rows of each M-block) @ w2[its expert].T; a_desc: [BM, BK]
    boxes of the intermediate [positions, I]; b_desc: [BN, BK] boxes of w2 seen as [E * H, I]."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready, empty, slots_ptr, weights_ptr, y_ptr, num_m_blocks, hidden, inter,
                     BM, BN, BK, GROUP_M, STAGES, STORE_BLOCKED, num_warps)),
        (_producer, (a_desc, b_desc, block_expert_ptr, a_bufs, b_bufs, ready, empty, num_m_blocks, hidden, inter,
                     GROUP_M, STAGES)),
    ], [1], [PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def _mma_to_smem(a_bufs, b_bufs, ready, empty, c_smem, c_ready, c_empty, slots_ptr, weights_ptr, num_m_blocks,
                 hidden, inter, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
                 STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The default partition of _ws_epi_gemm2: as _consumer, but its epilogue only scales the tile
    and writes it to shared memory for the store partition, then goes on to the next tile."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    num_n_blocks = gl.cdiv(hidden, BN)
    k_steps = gl.cdiv(inter, BK)
    count = 0
    local = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
        m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
        for k in range(k_steps):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, use_acc=k > 0,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1, pred=k > 0)
            count += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), count=1)
        rows = m_block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_layout))
        slots = gl.load(slots_ptr + rows)
        row_ok = slots >= 0
        weight = gl.load(weights_ptr + gl.where(row_ok, slots, 0), mask=row_ok, other=0.0)
        out = (acc * weight[:, None]).to(c_smem.dtype)
        mbarrier.wait(c_empty.index(0), (local & 1) ^ 1)
        c_smem.store(out)
        mbarrier.arrive(c_ready.index(0), count=1)
        local += 1


@gluon.jit
def _smem_to_y(c_smem, c_ready, c_empty, slots_ptr, y_ptr, num_m_blocks, hidden,
               BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr, SUB_M: gl.constexpr,
               STORE_WARPS: gl.constexpr):
    """Store partition: each finished tile from shared memory to y[slot], SUB_M rows at a time,
    then the buffer back to the MMA partition."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [STORE_WARPS, 1], [1, 0])
    num_n_blocks = gl.cdiv(hidden, BN)
    local = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n_blocks, gl.num_programs(0)):
        m_block, n_block = _coords(tile, num_m_blocks, num_n_blocks, GROUP_M)
        cols = n_block * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        mbarrier.wait(c_ready.index(0), local & 1)
        for sub in gl.static_range(BM // SUB_M):
            vals = c_smem.slice(sub * SUB_M, SUB_M, dim=0).load(layout)
            rows = m_block * BM + sub * SUB_M + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, layout))
            slots = gl.load(slots_ptr + rows)
            ptrs = y_ptr + gl.maximum(slots, 0).to(gl.int64)[:, None] * hidden + cols[None, :]
            gl.store(ptrs, vals, mask=(slots >= 0)[:, None] & (cols < hidden)[None, :])
        mbarrier.arrive(c_empty.index(0), count=1)
        local += 1


@gluon.jit
def _ws_epi_gemm2(a_desc, b_desc, block_expert_ptr, slots_ptr, weights_ptr, y_ptr, num_m_blocks, hidden, inter,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, SUB_M: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                  STORE_REGS: gl.constexpr, STORE_WARPS: gl.constexpr, num_warps: gl.constexpr):
    """_ws_gemm2 with a third partition for the epilogue's global stores: the MMA partition hands
    each scaled tile over in shared memory and starts the next tile while it is stored."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
    c_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(c_ready.index(0), count=1)
    mbarrier.init(c_empty.index(0), count=1)
    gl.warp_specialize([
        (_mma_to_smem, (a_bufs, b_bufs, ready, empty, c_smem, c_ready, c_empty, slots_ptr, weights_ptr,
                        num_m_blocks, hidden, inter, BM, BN, BK, GROUP_M, STAGES, num_warps)),
        (_producer, (a_desc, b_desc, block_expert_ptr, a_bufs, b_bufs, ready, empty, num_m_blocks, hidden, inter,
                     GROUP_M, STAGES)),
        (_smem_to_y, (c_smem, c_ready, c_empty, slots_ptr, y_ptr, num_m_blocks, hidden, BM, BN, GROUP_M, SUB_M,
                        STORE_WARPS)),
    ], [1, STORE_WARPS], [PRODUCER_REGS, STORE_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    mbarrier.invalidate(c_ready.index(0))
    mbarrier.invalidate(c_empty.index(0))


def descriptors(inter_rows: torch.Tensor, w2_rows: torch.Tensor, bm: int, bn: int, bk: int):
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gl.bfloat16)
    b_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gl.bfloat16)
    return (TensorDescriptor.from_tensor(inter_rows, [bm, bk], a_layout),
            TensorDescriptor.from_tensor(w2_rows, [bn, bk], b_layout))


def timed(fn, rounds: int = 25) -> float:
    """Median microseconds of a call (the bench's per-call CUDA-event timing)."""
    return statistics.median(event_times_us(fn, iters=rounds, warmup=2))


def library_gemm2_us(experts: int, top_k: int, hidden: int, inter: int, tokens: int) -> float:
    """Device time of the library's _gemm2_kernel in `safemoe.experts` on a routing giving every
    expert exactly T*K/E rows (token t's k-th expert (t*K + k) % E), from a profiler trace."""
    import safemoe
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=g) * inter**-0.5
    ids = ((torch.arange(tokens, device="cuda")[:, None] * top_k + torch.arange(top_k, device="cuda"))
           % experts).to(torch.int32)
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
    total = sum(e.device_time_total for e in prof.key_averages() if "_gemm2_kernel" in e.key)
    del x, w13, w2, ws
    return total / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3,deepseek,gptoss,mixtral")
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    from gluon_gemm2_probe import _grouped_gemm2

    from safemoe.bench.harness import _measure_bf16_tflops
    from safemoe.peers import _grouped_mm_op

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak = _measure_bf16_tflops(torch.device("cuda"), 8192)
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}: "
          f"bf16 peak (torch.mm 8192^3) {peak:.0f} TFLOP/s", flush=True)
    # (kernel, BN, BK, STAGES, GROUP_M, blocked store / store rows per step): "ws" two partitions,
    # "epi" a third (store) partition
    variants = [("ws", 256, 64, 3, 8, True), ("ws", 256, 64, 4, 8, True), ("ws", 256, 64, 3, 4, True),
                ("ws", 256, 64, 3, 16, True), ("epi", 256, 64, 2, 8, 16), ("epi", 256, 64, 3, 8, 16),
                ("ws", 128, 64, 5, 8, True)]
    for name in args.shapes.split(","):
        experts, top_k, hidden, inter = SHAPES[name]
        slots_total = args.tokens * top_k
        rows_per_expert = slots_total // experts
        g = torch.Generator(device="cuda").manual_seed(0)
        inter_rows = torch.randn(slots_total, inter, device="cuda", dtype=torch.bfloat16, generator=g)
        w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=g) * inter**-0.5
        slots = torch.randperm(slots_total, device="cuda", generator=g).to(torch.int32)
        weights = torch.rand(slots_total, device="cuda", generator=g)
        flops = 2 * slots_total * hidden * inter

        def line(label: str, us: float, err: float | None = None) -> None:
            bad = "" if err is None or err < 1e-2 else f"  WRONG rel err {err:.3g}"
            print(f"  {label:44s} {us:9.1f} us {flops / us / 1e6:5.0f} TFLOP/s ({flops / us / 1e6 / peak:5.1%})"
                  + bad, flush=True)

        print(f"{name} GEMM2 T={args.tokens} ({slots_total} rows, {rows_per_expert} an expert, N {hidden}, "
              f"K {inter})", flush=True)
        offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows_per_expert
        grouped_mm = _grouped_mm_op()[0]
        line("torch grouped_mm", timed(lambda: grouped_mm(inter_rows, w2.transpose(1, 2), offs=offs)))
        try:
            line("library _gemm2_kernel (table tiles)", library_gemm2_us(experts, top_k, hidden, inter, args.tokens))
        except Exception as exc:  # a probe: report and go on
            print(f"  library: {type(exc).__name__}: {exc}"[:300], flush=True)
        expected = (inter_rows.view(experts, rows_per_expert, inter).float()
                    @ w2.float().transpose(1, 2)).reshape(slots_total, hidden)
        expected_y = torch.empty_like(expected)
        expected_y[slots.long()] = expected * weights[slots.long(), None]
        y = torch.empty(slots_total, hidden, device="cuda", dtype=torch.bfloat16)
        bm = 128
        num_m_blocks = slots_total // bm
        block_expert = (torch.arange(num_m_blocks, device="cuda", dtype=torch.int32) * bm) // rows_per_expert
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
        for kind, bn, bk, stages, group_m, store in variants:
            a_desc, b_desc = descriptors(inter_rows, w2_rows, bm, bn, bk)
            grid = min(num_m_blocks * triton.cdiv(hidden, bn), sms)
            ws_args = (a_desc, b_desc, block_expert, slots, weights, y, num_m_blocks, hidden, inter)
            if kind == "ws":
                def run(args_now=ws_args, grid=grid, stages=stages, group_m=group_m, blocked=store) -> None:
                    _ws_gemm2[(grid,)](*args_now, GROUP_M=group_m, STAGES=stages, STORE_BLOCKED=blocked,
                                       PRODUCER_REGS=40, num_warps=8, maxnreg=168)
                label = f"WS gluon BN {bn} BK {bk} x{stages} G{group_m}{' blocked' if store else ''}"
            else:
                def run(args_now=ws_args, grid=grid, stages=stages, group_m=group_m, sub=store) -> None:
                    _ws_epi_gemm2[(grid,)](*args_now, GROUP_M=group_m, STAGES=stages, SUB_M=sub, PRODUCER_REGS=40,
                                           STORE_REGS=64, STORE_WARPS=2, num_warps=8, maxnreg=168)
                label = f"WS+store gluon BN {bn} BK {bk} x{stages} G{group_m} sub {store}"
            try:
                err = check(run)
                line(label, timed(run), err)
            except Exception as exc:
                print(f"  {label}: {type(exc).__name__}: {exc}"[:400], flush=True)
        del inter_rows, w2, expected, expected_y, y
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
