"""Probe: CUDA-graph conditional (IF) nodes as a way to make a large bucket's padded step cost a
small bucket's step (issue 13's padding target: T = 1024 with one valid row <= 1.1x T = 1).

A graph captured for T rows today runs the T-row launches whatever num_valid is; every kernel
branches on num_valid on the device, but the launches (and the large bucket's tiles) stay. With
conditional nodes (CUDA 12.4+, torch's CUDAGraph.begin_capture_to_if_node, what torch.cond uses
under capture) the graph can hold two bodies: IF num_valid <= S, the whole layer on the first S
rows (S's own tiles, the padding rows S..T zeroed) ELSE the T-row layer. This times, under graph
replay (time_graph, several calls a graph):

- `overhead`: N tiny kernels, plain or each inside an IF node (the set-condition kernel and the
  child graph launch are the cost), and the IF/IF-NOT pair torch.cond uses before CUDA 12.8;
- per shape: the T-row layer with num_valid 1 and T (`plain`), the S-row layer (`small`), and the
  conditional step with num_valid 1 and T (`if`). Each step copies the layer's output into one
  fixed [T, H] buffer (the conditional step needs one output for both bodies), so all pay the copy.

Two ways to build the node (--backend, default auto: torch's where this torch has it):
- `torch`: torch >= 2.13's CUDAGraph.begin_capture_to_if_node, two IF nodes (pred, not pred);
- `cuda-python` (twenty-eighth session, for the lent GPU's torch 2.11): the node spliced into
  torch's live capture through the CUDA driver API (cuda.bindings): a one-thread kernel, compiled
  with NVRTC, sets the node's condition from num_valid on the device (num_valid <= S); one IF/ELSE
  node (CUDA 12.8+) whose two bodies are captured on a side stream with
  cuStreamBeginCaptureToGraph, their allocations routed to the outer graph's memory pool. This is
  how NeMo's CUDA-graph decoders drive conditional nodes from PyTorch (idea from there; written
  here from the CUDA driver API's documentation). Ran on the H200 on 2026-12-02 (cuda.bindings
  13.3.1, driver 13.0): bitwise right, one IF/ELSE node ~7.4 us, so the padded steps got slower
  (log bench/results/logs/graph_if_cudapython_NVIDIA-H200_2026-12-02.json; docs/experts.md,
  twenty-eighth session).

Usage: PYTHONPATH=src python scripts/debug/graph_if_probe.py [--shapes qwen3,gptoss] [--T 1024]
    [--S 1] [--backend auto|torch|cuda-python] [--no-pdl]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import safemoe
from safemoe.bench.harness import time_graph
from safemoe.workspace import Workspace

sys.path.insert(0, str(Path(__file__).parent))
from ab_entry import shape_named, stand_ins

VARIANTS = 4


BACKEND = "torch"  # set by main()
# the memory pool of the graph being captured (`fresh_pools`), and the one the cuda-python bodies
# allocate from: torch refuses a second recording to the capture's own pool ("already recording
# to mempool_id"), so the bodies get their own, never released while the probe runs (the graphs
# replay from its blocks; in a library it would be released with the graph)
POOL: tuple[int, int] | None = None
BODY_POOL: tuple[int, int] | None = None


def torch_if_api() -> str | None:
    """None when this torch can capture IF nodes, else why not."""
    graph_cls = torch.cuda.CUDAGraph
    names = ("get_currently_capturing_graph", "begin_capture_to_if_node", "end_capture_to_conditional_node")
    for name in names:
        if not hasattr(graph_cls, name):
            return f"torch {torch.__version__}: CUDAGraph has no {name}"
    return None


def capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def if_body(pred: torch.Tensor, body) -> None:
    """`body()` inside an IF node on `pred` when capturing (torch backend); eagerly if not."""
    if not capturing():
        body()
        return
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    graph.begin_capture_to_if_node(pred)
    try:
        body()
    finally:
        graph.end_capture_to_conditional_node()


class DriverIf:
    """IF/ELSE nodes through the CUDA driver API (cuda.bindings), spliced into torch's capture."""

    SOURCE = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);
extern "C" __global__ void set_if_at_most(cudaGraphConditionalHandle handle, const int* num_valid,
                                          int bound) {
    cudaGraphSetConditional(handle, *num_valid <= bound ? 1u : 0u);
}
"""

    def __init__(self) -> None:
        import ctypes

        from cuda.bindings import driver, nvrtc

        self.driver, self.ctypes = driver, ctypes
        major, minor = torch.cuda.get_device_capability()
        err, prog = nvrtc.nvrtcCreateProgram(self.SOURCE.encode(), b"set_if.cu", 0, [], [])
        self._nvrtc_ok(nvrtc, err, "nvrtcCreateProgram")
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC: {err}: {log.decode(errors='replace')}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        self._nvrtc_ok(nvrtc, err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        self._nvrtc_ok(nvrtc, err, "nvrtcGetCUBIN")
        torch.zeros(1, device="cuda")  # makes torch's (primary) context current on this thread
        torch.cuda.synchronize()
        self.module = self.call("cuModuleLoadData", driver.cuModuleLoadData(cubin))
        self.kernel = self.call("cuModuleGetFunction",
                                driver.cuModuleGetFunction(self.module, b"set_if_at_most"))
        self.side = torch.cuda.Stream()  # the bodies' capture stream, made before any capture
        import cuda.bindings
        print(f"  cuda-python backend: cuda.bindings {getattr(cuda.bindings, '__version__', '?')}, "
              f"driver {self.call('cuDriverGetVersion', driver.cuDriverGetVersion())}", flush=True)

    @staticmethod
    def _nvrtc_ok(nvrtc, err, what: str) -> None:
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what}: {err}")

    def call(self, what: str, result):
        """The value(s) of a cuda.bindings call after its CUresult, raising on an error."""
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {err}")
        return rest[0] if len(rest) == 1 else tuple(rest)

    def capture_info(self, stream):
        """(graph, dependencies) of `stream`'s active capture (cuda.bindings 12.x or 13.x)."""
        res = self.call("cuStreamGetCaptureInfo", self.driver.cuStreamGetCaptureInfo(stream))
        status, graph, deps = res[0], res[2], res[3]
        if status != self.driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise RuntimeError(f"stream not capturing: {status}")
        return graph, list(deps)

    def add_node(self, graph, deps, params):
        try:  # 13.x: edge data beside the dependencies
            return self.call("cuGraphAddNode",
                             self.driver.cuGraphAddNode(graph, deps, None, len(deps), params))
        except (TypeError, ValueError):
            return self.call("cuGraphAddNode", self.driver.cuGraphAddNode(graph, deps, len(deps), params))

    def set_deps(self, stream, nodes) -> None:
        flag = self.driver.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
        try:
            self.call("cuStreamUpdateCaptureDependencies",
                      self.driver.cuStreamUpdateCaptureDependencies(stream, nodes, None, len(nodes), flag))
        except (TypeError, ValueError):
            self.call("cuStreamUpdateCaptureDependencies",
                      self.driver.cuStreamUpdateCaptureDependencies(stream, nodes, len(nodes), flag))

    def if_else(self, num_valid: torch.Tensor, bound: int, then_body, else_body) -> None:
        """then_body() when num_valid <= bound at replay, else else_body(): one IF/ELSE node."""
        if not capturing():
            then_body()
            else_body()
            return
        if num_valid.dtype != torch.int32 or num_valid.dim() != 0:
            raise ValueError("num_valid must be a 0-dim int32 device tensor")
        drv = self.driver
        outer = torch.cuda.current_stream()
        stream = drv.CUstream(outer.cuda_stream)
        ctx = self.call("cuCtxGetCurrent", drv.cuCtxGetCurrent())
        graph, _ = self.capture_info(stream)
        handle = self.call("cuGraphConditionalHandleCreate",
                           drv.cuGraphConditionalHandleCreate(graph, ctx, 0, 0))
        c = self.ctypes
        args = ((int(handle), num_valid.data_ptr(), bound), (c.c_ulonglong, c.c_void_p, c.c_int))
        self.call("cuLaunchKernel", drv.cuLaunchKernel(self.kernel, 1, 1, 1, 1, 1, 1, 0, stream, args, 0))
        graph, deps = self.capture_info(stream)
        params = drv.CUgraphNodeParams()
        params.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
        params.conditional.size = 2  # IF / ELSE (CUDA 12.8+)
        params.conditional.ctx = ctx
        node = self.add_node(graph, deps, params)
        self.set_deps(stream, [node])
        bodies = [params.conditional.phGraph_out[i] for i in range(2)]
        side = self.side
        side_handle = drv.CUstream(side.cuda_stream)
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        device = torch.cuda.current_device()
        # torch >= 2.6 names, else the older ones
        names = (("_cuda_beginAllocateCurrentThreadToPool", "_cuda_beginAllocateCurrentStreamToPool"),
                 ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"))
        begin, end = (next(getattr(torch._C, n) for n in pair if hasattr(torch._C, n)) for pair in names)
        for body_graph, body in zip(bodies, (then_body, else_body), strict=True):
            self.call("cuStreamBeginCaptureToGraph",
                      drv.cuStreamBeginCaptureToGraph(side_handle, body_graph, None, None, 0, mode))
            try:
                with torch.cuda.stream(side):
                    begin(device, BODY_POOL)
                    try:
                        body()
                    finally:
                        end(device, BODY_POOL)
            finally:
                self.call("cuStreamEndCapture", drv.cuStreamEndCapture(side_handle))


DRIVER_IF: DriverIf | None = None


def if_else(num_valid: torch.Tensor, bound: int, then_body, else_body) -> None:
    """then_body() when num_valid <= bound, else else_body(), as conditional graph nodes under
    capture (BACKEND) and both eagerly when not capturing (the warm-up compiles both)."""
    if BACKEND == "torch":
        if_body(num_valid <= bound, then_body)
        if_body(num_valid > bound, else_body)
    else:
        assert DRIVER_IF is not None
        DRIVER_IF.if_else(num_valid, bound, then_body, else_body)


def fresh_pools() -> tuple[int, int]:
    """New pools for the next capture (POOL) and its cuda-python bodies (BODY_POOL); POOL returned."""
    global POOL, BODY_POOL
    POOL, BODY_POOL = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
    return POOL


def time_step(step, n_variants: int = 1, calls_per_graph: int = 10, replays: int = 20) -> float:
    """harness.time_graph, captured into a pool this script knows (the bodies' pool beside it)."""
    return time_graph(step, n_variants=n_variants, calls_per_graph=calls_per_graph, replays=replays,
                      pool=fresh_pools())


def overhead(n: int) -> dict[str, float]:
    x = torch.zeros(1024, device="cuda")
    nv = torch.ones((), dtype=torch.int32, device="cuda")

    def plain(j: int) -> None:
        for _ in range(n):
            x.add_(1.0)

    def in_if_else(j: int) -> None:  # one tiny kernel in the taken branch, another in the other
        for _ in range(n):
            if_else(nv, 1, lambda: x.add_(1.0), lambda: x.add_(2.0))

    res = {}
    for name, step in (("plain", plain), ("in_if_else", in_if_else)):
        res[name] = time_step(step, calls_per_graph=10, replays=30) / n
    return res


def shape_case(prefix: str, num_tokens: int, small: int, rounds: int) -> dict:
    device = torch.device("cuda")
    num_experts, top_k, hidden, inter, activation = shape_named(prefix)
    gen = torch.Generator(device=device).manual_seed(0)
    w13, w2, xs = stand_ins(prefix, num_tokens, VARIANTS, device, gen)
    logits = [torch.randn(num_tokens, num_experts, device=device, dtype=torch.bfloat16, generator=gen)
              for _ in range(VARIANTS)]  # fmt: skip
    ws = Workspace(num_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, device)
    out = torch.empty(num_tokens, hidden, device=device, dtype=torch.bfloat16)
    nvs = {n: torch.tensor(n, dtype=torch.int32, device=device) for n in (1, small, num_tokens)}

    def layer(j: int, rows: int, nv: torch.Tensor) -> None:
        res = safemoe.moe(xs[j][:rows], logits[j][:rows], w13, w2, top_k, activation=activation,
                          num_valid=nv, workspace=ws)
        out[:rows].copy_(res)

    def plain(nv: torch.Tensor):
        return lambda j: layer(j, num_tokens, nv)

    def small_only(nv: torch.Tensor):
        return lambda j: layer(j, small, nv)

    def conditional(nv: torch.Tensor):
        def step(j: int) -> None:
            def small_body() -> None:
                out[small:].zero_()
                layer(j, small, nv)

            if_else(nv, small, small_body, lambda: layer(j, num_tokens, nv))
        return step

    # correctness: the conditional step's output against the plain one, both num_valid kinds
    for n in (1, num_tokens):
        for make in (plain, conditional):
            out.fill_(float("nan"))
            graph = torch.cuda.CUDAGraph()
            make(nvs[n])(0)  # warm-up (both bodies eagerly for the conditional step)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=fresh_pools()):
                make(nvs[n])(0)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            if make is plain:
                ref = out.clone()
            else:
                same = torch.equal(out, ref)
                if n < num_tokens:
                    # small bucket's tiles: same math, possibly other fp32 order; padding exact zeros
                    err = ((out[:n].float() - ref[:n].float()).norm() / ref[:n].float().norm()).item()
                    zeros = bool((out[n:] == 0).all())
                    print(f"  {prefix} T={num_tokens} nv={n}: conditional vs plain bitwise {same}, "
                          f"rel err {err:.2e}, padding zeros {zeros}", flush=True)
                else:
                    print(f"  {prefix} T={num_tokens} nv={n}: conditional vs plain bitwise {same}",
                          flush=True)
            del graph

    steps = {
        "plain nv=1": plain(nvs[1]),
        f"small T={small} nv=1": small_only(nvs[1]),
        "if nv=1": conditional(nvs[1]),
        f"plain nv={num_tokens}": plain(nvs[num_tokens]),
        f"if nv={num_tokens}": conditional(nvs[num_tokens]),
    }
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(time_step(step, n_variants=VARIANTS, calls_per_graph=10, replays=20))
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    print(f"{prefix} T={num_tokens} S={small}: " + json.dumps(med), flush=True)
    return {"shape": prefix, "T": num_tokens, "S": small, "median_us": med, "rounds": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3,gptoss")
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--S", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=("auto", "torch", "cuda-python"), default="auto")
    parser.add_argument("--no-pdl", action="store_true", help="launch without PDL (safemoe's kernels)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    global BACKEND, DRIVER_IF
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    why = torch_if_api()
    BACKEND = args.backend if args.backend != "auto" else ("torch" if why is None else "cuda-python")
    if BACKEND == "torch" and why:
        raise SystemExit(why)
    if BACKEND == "cuda-python":
        DRIVER_IF = DriverIf()
    if args.no_pdl:
        from safemoe.kernels import launch

        launch.pdl_supported = lambda: False  # type: ignore[assignment]
    print(f"backend {BACKEND}{', no PDL' if args.no_pdl else ''}", flush=True)
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "backend": BACKEND,
                    "pdl": not args.no_pdl}
    try:
        result["overhead_us_per_kernel"] = {n: overhead(n) for n in (1, 8)}
    except Exception as exc:
        import traceback

        traceback.print_exc()
        raise SystemExit(f"overhead: {type(exc).__name__}: {exc}") from exc
    print("overhead (us per tiny kernel):", json.dumps(result["overhead_us_per_kernel"]), flush=True)
    result["cases"] = []
    for prefix in args.shapes.split(","):
        try:
            result["cases"].append(shape_case(prefix, args.T, args.S, args.rounds))
        except Exception as exc:  # keep the other shapes
            print(f"{prefix}: {type(exc).__name__}: {exc}", flush=True)
            result["cases"].append({"shape": prefix, "error": f"{type(exc).__name__}: {exc}"})
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
