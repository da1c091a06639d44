"""The bench harness: how every safemoe timing is taken, and the floors it is compared with.

Timing (docs/bench.md says why each choice):
- `time_graph` captures ONE CUDA graph holding `calls_per_graph` calls of a step, call j running on
  input set `j % n_variants` (rotating inputs larger than L2 so weights and activations come from
  HBM, as they do in a real model), replays it, and times every replay with CUDA events. The result
  is the median replay time divided by `calls_per_graph`: per-call time with launch overhead
  amortised the way a graph-captured decode step amortises it.
- `time_eager` times single calls with events around each one, for peers that sync with the host
  (data-dependent shapes) and so cannot be captured.

Ceilings are measured in the same run on the same device (`measure_ceilings`, cached per device):
streaming-read bandwidth, copy bandwidth, bf16 and fp8 matmul peaks. Floors derive from them:
- bytes floor = bytes that must move / read bandwidth (expert weights are read, not copied);
- FLOP floor = FLOPs / matmul peak.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import torch

from safemoe.graphs import warm_up

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a runtime dependency on Linux
    triton = None

_Item = TypeVar("_Item")

# Ceiling measurement sizes. 2 GiB is >= 30x the L2 of any current GPU (H100 50 MiB, H200 60 MiB,
# B200 126 MiB), so the streaming measurements see HBM, not cache.
_STREAM_BYTES = 2 << 30
_MATMUL_N = 8192
_DEFAULT_L2_BYTES = 50 << 20


class GraphCaptureError(RuntimeError):
    """The step could not be captured in a CUDA graph (it syncs with the host, allocates by data...)."""


# ----------------------------------------------------------------------------------------------
# Device ceilings
# ----------------------------------------------------------------------------------------------


@dataclass
class DeviceCeilings:
    """What the device can do at best, measured in this run.

    read_gbps: streaming-read bandwidth, GB/s (1e9 bytes/s), from a read-only reduction kernel.
    copy_gbps: copy bandwidth, GB/s, counting read + written bytes.
    bf16_tflops: bf16 matmul peak (8192^3, random data), TFLOP/s.
    fp8_tflops: fp8 e4m3 matmul peak via torch._scaled_mm, TFLOP/s; None where unsupported.
    details: how each number was obtained (methods, sizes, the losing candidates).
    bf16_tflops_sustained: the same matmul timed as `time_graph` times every benchmark point (20
      calls a CUDA graph, 30 replays back to back): the peak under sustained load, where a power
      limit may lower the clocks; None where not measured (results written before 2026-11-27).
      Reported beside the prefill points; the floors and targets use `bf16_tflops`.
    """

    name: str
    read_gbps: float
    copy_gbps: float
    bf16_tflops: float
    fp8_tflops: float | None
    details: dict[str, Any] = field(default_factory=dict)
    bf16_tflops_sustained: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceCeilings:
        return cls(
            name=str(data["name"]),
            read_gbps=float(data["read_gbps"]),
            copy_gbps=float(data["copy_gbps"]),
            bf16_tflops=float(data["bf16_tflops"]),
            fp8_tflops=None if data.get("fp8_tflops") is None else float(data["fp8_tflops"]),
            details=dict(data.get("details", {})),
            bf16_tflops_sustained=(None if data.get("bf16_tflops_sustained") is None
                                   else float(data["bf16_tflops_sustained"])),
        )

    def summary(self) -> str:
        fp8 = "n/a" if self.fp8_tflops is None else f"{self.fp8_tflops:.0f}"
        sustained = (
            "" if self.bf16_tflops_sustained is None else f" ({self.bf16_tflops_sustained:.0f} sustained)"
        )
        return (
            f"{self.name}: read {self.read_gbps:.0f} GB/s, copy {self.copy_gbps:.0f} GB/s, "
            f"bf16 {self.bf16_tflops:.0f}{sustained} TFLOP/s, fp8 {fp8} TFLOP/s"
        )


_CEILINGS_CACHE: dict[str, DeviceCeilings] = {}


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU; this machine has none")


def event_times_us(run: Callable[[], object], iters: int, warmup: int) -> list[float]:
    """Microseconds of each of `iters` calls of `run`, each bracketed by CUDA events."""
    for _ in range(warmup):
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1000.0 for start, end in zip(starts, ends, strict=True)]


if triton is not None:

    @triton.jit
    def _stream_read_kernel(src_ptr, partial_ptr, BLOCK: tl.constexpr):
        """partial[p] = sum(src[p*BLOCK : (p+1)*BLOCK]); the buffer length is a multiple of BLOCK.

        One read of every element and one 4-byte store per BLOCK elements: a pure streaming read.
        """
        program = tl.program_id(0).to(tl.int64)  # program * BLOCK passes 2^31 for 2 GiB of fp32
        offsets = program * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(src_ptr + offsets)
        tl.store(partial_ptr + program, tl.sum(values, axis=0))


def _measure_read_gbps(device: torch.device, nbytes: int) -> tuple[float, dict[str, Any]]:
    """Best streaming-read bandwidth of a Triton and a torch reduction over `nbytes` of fp32.

    bytes = nbytes read (the partial sums written are nbytes / 16 KiB * 4 bytes: ignored).
    """
    block = 4096  # 16 KiB per program: 16 fp32 (four 128-bit loads) per thread at 8 warps
    numel = nbytes // 4 // block * block
    src = torch.ones(numel, dtype=torch.float32, device=device)
    results: dict[str, Any] = {}
    if triton is not None:
        partial = torch.empty(numel // block, dtype=torch.float32, device=device)
        grid = (numel // block,)  # one program per BLOCK elements

        def triton_read() -> None:
            _stream_read_kernel[grid](src, partial, BLOCK=block, num_warps=8)

        try:
            us = statistics.median(event_times_us(triton_read, iters=20, warmup=3))
            results["triton_sum"] = numel * 4 / (us * 1e-6) / 1e9
        except Exception as exc:  # the torch candidate below still gives a number
            results["triton_sum_error"] = f"{type(exc).__name__}: {exc}"[:200]
            print(f"ceilings: Triton read kernel failed ({type(exc).__name__}: {exc}); using torch.sum only")
    us = statistics.median(event_times_us(lambda: src.sum(), iters=20, warmup=3))
    results["torch_sum"] = numel * 4 / (us * 1e-6) / 1e9
    best = max(v for v in results.values() if isinstance(v, float))
    return best, results


def _measure_copy_gbps(device: torch.device, nbytes: int) -> float:
    """dst.copy_(src): bytes = 2 * nbytes (each byte read once and written once)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    us = statistics.median(event_times_us(lambda: dst.copy_(src), iters=20, warmup=3))
    return 2 * nbytes / (us * 1e-6) / 1e9


def _bf16_mm(device: torch.device, n: int) -> Callable[[], object]:
    """torch.mm of two n x n bf16 matrices of random normal data into a preallocated output."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    return lambda: torch.mm(a, b, out=out)


def _measure_bf16_tflops(device: torch.device, n: int, mm: Callable[[], object] | None = None) -> float:
    """`_bf16_mm` (or `mm`, the same product), median of 20 timed calls: FLOPs = 2 n^3."""
    us = statistics.median(event_times_us(mm or _bf16_mm(device, n), iters=20, warmup=5))
    return 2 * n**3 / (us * 1e-6) / 1e12


def _measure_bf16_tflops_sustained(device: torch.device, n: int,
                                   mm: Callable[[], object] | None = None) -> float:
    """The bf16 peak as every benchmark point is timed (`time_graph`: 20 calls a graph, 30 replays
    back to back, about a second of full load): FLOPs = 2 n^3 a call.

    Why a second number: on an H200 (2026-11-27, scripts/debug log in bench/results/logs/
    sustained_peak_*) the SM clock fell from 1980 MHz to 1305-1485 MHz at the 700 W power limit
    under that load, and torch.mm gave 671 TFLOP/s against 785 from `_measure_bf16_tflops`'s
    20-call burst; a prefill layer point, timed the same way, runs at the lower clocks."""
    run = mm or _bf16_mm(device, n)
    us = time_graph(lambda _: run(), calls_per_graph=20, replays=30)
    return 2 * n**3 / (us * 1e-6) / 1e12


def _measure_fp8_tflops(device: torch.device, n: int) -> tuple[float | None, str]:
    """torch._scaled_mm on e4m3 n x n inputs, per-tensor scales, bf16 out: FLOPs = 2 n^3.

    use_fast_accum=True, as fp8 inference GEMMs run it. None where fp8 matmul is unsupported
    (pre-Hopper/Ada devices, builds without it)."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None or not hasattr(torch, "_scaled_mm"):
        return None, "torch has no float8_e4m3fn/_scaled_mm"
    try:
        a = torch.randn(n, n, device=device).to(fp8)
        b = torch.randn(n, n, device=device).to(fp8)  # [N, K] row-major; b.t() is column-major
        one = torch.ones((), dtype=torch.float32, device=device)

        def run() -> object:
            return torch._scaled_mm(
                a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True
            )

        us = statistics.median(event_times_us(run, iters=20, warmup=5))
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return None, f"fp8 matmul unsupported: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return 2 * n**3 / (us * 1e-6) / 1e12, "torch._scaled_mm e4m3, use_fast_accum=True"


def measure_ceilings(device: torch.device | str | None = None, *, refresh: bool = False) -> DeviceCeilings:
    """Measure the device's ceilings once per process (cached per device; `refresh` re-measures)."""
    _require_cuda("measure_ceilings")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key in _CEILINGS_CACHE and not refresh:
        return _CEILINGS_CACHE[key]
    with torch.cuda.device(device):
        read_gbps, read_candidates = _measure_read_gbps(device, _STREAM_BYTES)
        copy_gbps = _measure_copy_gbps(device, _STREAM_BYTES)
        mm = _bf16_mm(device, _MATMUL_N)  # one set of operands for both bf16 peaks
        bf16_tflops = _measure_bf16_tflops(device, _MATMUL_N, mm)
        fp8_tflops, fp8_note = _measure_fp8_tflops(device, _MATMUL_N)
        bf16_sustained = _measure_bf16_tflops_sustained(device, _MATMUL_N, mm)
        del mm
        torch.cuda.empty_cache()
    ceilings = DeviceCeilings(
        name=torch.cuda.get_device_name(device),
        read_gbps=read_gbps,
        copy_gbps=copy_gbps,
        bf16_tflops=bf16_tflops,
        fp8_tflops=fp8_tflops,
        bf16_tflops_sustained=bf16_sustained,
        details={
            "read_candidates_gbps": read_candidates,
            "stream_bytes": _STREAM_BYTES,
            "matmul_n": _MATMUL_N,
            "fp8": fp8_note,
            "l2_bytes": l2_bytes(device),
            "medians_of": 20,
        },
    )
    _CEILINGS_CACHE[key] = ceilings
    return ceilings


def l2_bytes(device: torch.device | str | None = None) -> int:
    """The device's L2 size in bytes (50 MiB when torch does not report it)."""
    if not torch.cuda.is_available():
        return _DEFAULT_L2_BYTES
    props = torch.cuda.get_device_properties(torch.device("cuda") if device is None else device)
    return int(getattr(props, "L2_cache_size", 0) or _DEFAULT_L2_BYTES)


def rotation_count(
    bytes_per_variant: int,
    *,
    device: torch.device | str | None = None,
    factor: float = 3.0,
    max_variants: int = 64,
) -> int:
    """How many input sets a step should rotate through so one pass touches > factor x L2."""
    need = math.ceil(factor * l2_bytes(device) / max(1, bytes_per_variant))
    return max(1, min(max_variants, need))


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def _clear_failed_capture() -> None:
    """After a failed capture, drain the stream and the non-sticky error it left behind."""
    with contextlib.suppress(RuntimeError):
        torch.cuda.synchronize()


def time_graph(
    step: Callable[[int], object],
    *,
    n_variants: int = 1,
    calls_per_graph: int = 20,
    replays: int = 30,
    warmup: int = 3,
    pool: Any = None,  # torch.cuda.graph_pool_handle() (Any: callers splat dict[str, int] options)
) -> float:
    """Median microseconds per call of `step`, timed under CUDA-graph replay.

    Captures ONE graph holding `calls_per_graph` calls, call j = `step(j % n_variants)`, replays it
    `warmup` times untimed then `replays` times each bracketed by CUDA events, and returns the
    median replay time / calls_per_graph. The step is first run eagerly on a side stream (lazy
    initialisation, cuBLAS workspaces, Triton compilation must happen outside the capture).
    Raises GraphCaptureError when the step cannot be captured. pool: the graph's memory pool
    (`torch.cuda.graph_pool_handle()`), for a step that must know it; None: a pool of its own.
    """
    _require_cuda("time_graph")
    if n_variants < 1 or calls_per_graph < 1 or replays < 1:
        raise ValueError(f"{n_variants=}, {calls_per_graph=} and {replays=} must be >= 1")
    warm_up(lambda: [step(j % n_variants) for j in range(max(warmup, n_variants))])

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            for j in range(calls_per_graph):
                step(j % n_variants)
    except Exception as exc:
        del graph
        _clear_failed_capture()
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        raise GraphCaptureError(
            f"step cannot be captured in a CUDA graph: {type(exc).__name__}: {first_line}"
        ) from exc

    times = event_times_us(graph.replay, iters=replays, warmup=warmup)
    del graph
    return statistics.median(times) / calls_per_graph


def time_eager(
    step: Callable[[int], object], *, n_variants: int = 1, iters: int = 30, warmup: int = 3
) -> float:
    """Median microseconds per call of `step(j % n_variants)`, CUDA events around each call.

    For steps that sync with the host: the events then include the host time between launches,
    which is what such a step costs inside a model."""
    _require_cuda("time_eager")
    if n_variants < 1 or iters < 1:
        raise ValueError(f"{n_variants=} and {iters=} must be >= 1")
    counter = iter(range(1 << 62))

    def run() -> object:
        return step(next(counter) % n_variants)

    return statistics.median(event_times_us(run, iters=iters, warmup=max(warmup, n_variants)))


def time_auto(
    step: Callable[[int], object],
    *,
    n_variants: int = 1,
    calls_per_graph: int = 20,
    replays: int = 30,
    iters: int = 30,
    warmup: int = 3,
) -> tuple[float, str]:
    """`time_graph` when the step captures, else `time_eager`; returns (us, how it was timed)."""
    try:
        us = time_graph(
            step, n_variants=n_variants, calls_per_graph=calls_per_graph, replays=replays, warmup=warmup
        )
    except GraphCaptureError as exc:
        return time_eager(step, n_variants=n_variants, iters=iters, warmup=warmup), f"eager ({exc})"
    return us, "graph"


# ----------------------------------------------------------------------------------------------
# Floors (formulas; bytes in bytes, bandwidth in GB/s = 1e9 B/s, peaks in TFLOP/s)
# ----------------------------------------------------------------------------------------------


def bytes_floor_us(nbytes: float, gbps: float) -> float:
    """Time to move `nbytes` at `gbps`: nbytes / (gbps * 1e9) seconds, in microseconds."""
    return nbytes / (gbps * 1e9) * 1e6


def flops_floor_us(flops: float, tflops: float) -> float:
    """Time to do `flops` at `tflops`: flops / (tflops * 1e12) seconds, in microseconds."""
    return flops / (tflops * 1e12) * 1e6


def distinct_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts touched by T tokens under uniform routing:
    D = E * (1 - (1 - K/E)^T)  (each expert is missed by one token with probability 1 - K/E)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def moe_weight_bytes(
    num_experts: int, top_k: int, hidden: int, inter: int, num_tokens: int, bytes_per_element: int = 2,
    distinct: float | None = None,
) -> float:
    """Expert weight bytes read: D x (w13 [2I, H] + w2 [H, I]) = D x 3*H*I x bytes_per_element, with D
    the experts the timed routings hit (`distinct`, e.g. `sampled_distinct_experts`) or, without
    it, its expectation under uniform routing."""
    if distinct is None:
        distinct = distinct_experts(num_experts, top_k, num_tokens)
    return distinct * 3 * hidden * inter * bytes_per_element


def sampled_distinct_experts(ids: list[torch.Tensor]) -> float:
    """Mean number of distinct experts in each routing sample's ids ([T, K] each): the D of the
    samples a bench times, which at small T can sit well off the uniform expectation (Mixtral T = 8:
    16 slots over 8 experts)."""
    if not ids:
        raise ValueError("sampled_distinct_experts: ids holds no routing sample")
    return sum(int(torch.unique(sample[sample >= 0]).numel()) for sample in ids) / len(ids)


def sampled_computed_rows(ids: list[torch.Tensor], num_experts: int, block_m: int) -> float:
    """Mean over routing samples ([T, K] ids each) of the rows the expert GEMMs compute, each
    expert's slots padded up to a multiple of block_m (the dispatch layout), over the slots routed:
    1.0 when every expert's rows fill whole blocks. The "% of peak" scale counts only the routed
    rows, so this is what block padding adds to a prefill point's time."""
    if not ids:
        raise ValueError("sampled_computed_rows: ids holds no routing sample")
    for name, value in (("num_experts", num_experts), ("block_m", block_m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    factors = []
    for sample in ids:
        routed = sample[(sample >= 0) & (sample < num_experts)].to(torch.int64)
        if routed.numel() == 0:
            continue
        counts = torch.bincount(routed, minlength=num_experts)
        factors.append(float((((counts + block_m - 1) // block_m) * block_m).sum()) / routed.numel())
    return sum(factors) / len(factors) if factors else 1.0


def moe_flops(num_tokens: int, top_k: int, hidden: int, inter: int) -> float:
    """Expert GEMM FLOPs: T*K slots x (2*H*2I for GEMM1 + 2*I*H for GEMM2) = 2*T*K*3*H*I."""
    return 2.0 * num_tokens * top_k * 3 * hidden * inter


def moe_decode_floor_us(
    num_experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    num_tokens: int,
    ceilings: DeviceCeilings,
    bytes_per_element: int = 2,
    distinct: float | None = None,
) -> float:
    """Decode floor: D x 3*H*I*bytes / streaming-read bandwidth (activations ignored: tiny)."""
    nbytes = moe_weight_bytes(num_experts, top_k, hidden, inter, num_tokens, bytes_per_element, distinct)
    return bytes_floor_us(nbytes, ceilings.read_gbps)


def moe_prefill_floor_us(
    top_k: int, hidden: int, inter: int, num_tokens: int, ceilings: DeviceCeilings
) -> float:
    """Prefill floor: 2*T*K*3*H*I FLOPs / bf16 matmul peak."""
    return flops_floor_us(moe_flops(num_tokens, top_k, hidden, inter), ceilings.bf16_tflops)


def moe_floor_us(
    num_experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    num_tokens: int,
    ceilings: DeviceCeilings,
    bytes_per_element: int = 2,
    distinct: float | None = None,
) -> tuple[float, str]:
    """The roofline floor of the expert step: max(decode floor, prefill floor), and which bound
    (`distinct`: the experts the timed routings hit, as in moe_weight_bytes)."""
    read = moe_decode_floor_us(num_experts, top_k, hidden, inter, num_tokens, ceilings, bytes_per_element,
                               distinct)
    compute = moe_prefill_floor_us(top_k, hidden, inter, num_tokens, ceilings)
    return (read, "read") if read >= compute else (compute, "flops")


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


@dataclass
class BenchRow:
    """One measured (or unavailable) implementation on one case.

    median_us: median microseconds per call, None when the implementation could not run (say why
    in `note`). floor_us: the physical floor for this case from the run's ceilings.
    extra: anything else worth keeping (speedups, errors, achieved GB/s), JSON-serialisable.
    """

    suite: str
    case: str
    tokens: int
    variant: str
    impl: str
    median_us: float | None
    floor_us: float | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def pct_of_floor(self) -> float | None:
        """100 x floor / measured: 100 means at the floor; None when either is missing."""
        if self.median_us is None or self.floor_us is None or self.median_us <= 0:
            return None
        return 100.0 * self.floor_us / self.median_us

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["pct_of_floor"] = self.pct_of_floor
        return data


def add_speedups(rows: list[BenchRow], baseline_impl: str, *, key: str | None = None) -> None:
    """extra[key] = baseline median / row median for rows sharing (suite, case, tokens, variant)
    with a row of `baseline_impl` (>1: faster than the baseline). key defaults to `x_vs_<impl>`."""
    key = key or f"x_vs_{baseline_impl}"
    base = {(r.suite, r.case, r.tokens, r.variant): r.median_us for r in rows if r.impl == baseline_impl}
    for row in rows:
        ref = base.get((row.suite, row.case, row.tokens, row.variant))
        if ref and row.median_us and row.impl != baseline_impl:
            row.extra[key] = round(ref / row.median_us, 3)


def error_note(exc: BaseException) -> str:
    """A row's note for a step that raised: `error: <type>: <first line of the message>`."""
    text = str(exc).strip().splitlines()
    return f"error: {type(exc).__name__}: {text[0][:160] if text else ''}"


def run_info(device: torch.device | None = None) -> dict[str, Any]:
    """Device, software versions and date of this run, for the JSON files. `device`: the run's
    device when it is not the current CUDA device (a CPU run on a GPU machine says "cpu")."""
    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": getattr(triton, "__version__", None) if triton is not None else None,
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
        info.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_bytes=l2_bytes(),
        )
    else:
        info["device"] = "cpu"
    try:
        from safemoe import __version__

        info["safemoe"] = __version__
    except ImportError:  # pragma: no cover
        pass
    return info


_CSV_COLUMNS = (
    "suite",
    "case",
    "tokens",
    "variant",
    "impl",
    "median_us",
    "floor_us",
    "pct_of_floor",
    "note",
    "extra",
)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def write_results(rows: list[BenchRow], out_dir: Path, suite: str, ceilings: DeviceCeilings) -> None:
    """Write `<suite>.csv` and `<suite>.json` (rows + device, date, versions, ceilings) into
    `out_dir` and print the table."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"{suite}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            data = row.to_dict()
            data["extra"] = json.dumps(row.extra, sort_keys=True) if row.extra else ""
            for name in ("median_us", "floor_us", "pct_of_floor"):
                data[name] = _fmt(data[name], 3)
            writer.writerow({name: data[name] for name in _CSV_COLUMNS})
    payload = {
        "suite": suite,
        **run_info(),
        "ceilings": ceilings.to_dict(),
        "rows": [row.to_dict() for row in rows],
    }
    (out_dir / f"{suite}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print_table(rows, title=f"safemoe bench {suite} on {ceilings.name}")


def _extra_text(extra: dict) -> str:
    parts = []
    for key, value in extra.items():
        if isinstance(value, float):
            value = f"{value:.3g}"
        parts.append(f"{key}={value}")
    return " ".join(parts)


def print_table(rows: list[BenchRow], title: str) -> None:
    """A table of the rows (rich when installed, plain text otherwise)."""
    header = ["case", "T", "variant", "impl", "median us", "floor us", "% floor", "extra", "note"]
    body = [
        [
            r.case,
            str(r.tokens),
            r.variant,
            r.impl,
            "n/a" if r.median_us is None else _fmt(r.median_us, 2),
            _fmt(r.floor_us, 2),
            _fmt(r.pct_of_floor, 1),
            _extra_text(r.extra),
            r.note,
        ]
        for r in rows
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [
            max(len(h), *(len(line[i]) for line in body)) if body else len(h) for i, h in enumerate(header)
        ]
        for line in [header, *body]:
            print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        return
    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="right" if 4 <= i <= 6 else "left", overflow="fold")
    for line in body:
        table.add_row(*line)
    Console(width=200).print(table)


def write_targets(table: list[dict[str, Any]], path: Path) -> None:
    """A suite's targets (dicts with target, case, T, limit, measured, met) as a markdown table at
    `path`, printed too."""
    lines = ["| target | case | T | limit | measured | met |", "|---|---|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['case']} | {t['T']} | {t['limit']} | {t['measured']} | "
              f"{'yes' if t['met'] else 'NO'} |" for t in table]  # fmt: skip
    Path(path).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot_pct_of_floor(rows: list[BenchRow], path: Path, title: str) -> Path | None:
    """PNG of % of floor against T (log x) with one line per (case, impl[, variant]).

    Returns the path, or None (with a printed reason) when matplotlib is missing or there is
    nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot skipped ({path.name}): matplotlib is not installed (pip install 'safemoe[bench]')")
        return None
    points = [r for r in rows if r.pct_of_floor is not None]
    if not points:
        print(f"plot skipped ({path.name}): no row has both a time and a floor")
        return None
    several_variants = len({r.variant for r in points}) > 1
    lines: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for r in points:
        lines.setdefault((r.impl, r.case, r.variant), []).append((r.tokens, float(r.pct_of_floor or 0.0)))
    # One colour per implementation, one line style per case, so peers compare at a glance.
    impls = sorted({key[0] for key in lines})
    cases = sorted({key[1] for key in lines})
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for (impl, case, variant), xy in sorted(lines.items()):
        xy.sort()
        label = f"{case} {impl}" + (f" [{variant}]" if several_variants else "")
        ax.plot(
            [max(x, 1) for x, _ in xy],
            [y for _, y in xy],
            marker="o",
            label=label,
            color=f"C{impls.index(impl) % 10}",
            linestyle=styles[cases.index(case) % len(styles)],
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("% of floor (100 = at the physical floor)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def chosen_cases(
    shapes: dict[str, Any], quick_shapes: Iterable[str] | None, *, quick: bool, names: Sequence[str] | None
) -> list[str]:
    """The model shapes a suite runs, in its own order: `names` when given (`safemoe bench --shapes`,
    checked against `shapes` before anything is timed), else the quick ones with --quick (all when
    the suite has no quick list), else all."""
    if isinstance(names, str):  # a bare name would be read as its characters
        raise TypeError(f"names must be a sequence of shape names, got the str {names!r}")
    if names:
        unknown = [name for name in names if name not in shapes]
        if unknown:
            raise ValueError(f"unknown shape(s) {unknown}; known: {', '.join(shapes)}")
        return [case for case in shapes if case in names]
    if quick and quick_shapes is not None:
        return [case for case in shapes if case in quick_shapes]
    return list(shapes)


def progress(items: Iterable[_Item], description: str) -> Iterator[_Item]:
    """Iterate with a rich progress bar when rich is installed, plain otherwise."""
    try:
        from rich.progress import track
    except ImportError:
        print(description)
        yield from items
        return
    yield from track(list(items), description=description, transient=True)
