"""Small adversarial cases through the public API with backend="triton", for compute-sanitizer.

Run it under memcheck with the caching allocator off (it would hide out-of-bounds accesses inside
its large blocks):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python3 scripts/sanitize.py

Each case also checks the contract on its outputs (ids in range and distinct, finite weights and
outputs, padded rows -1/0/zeros), so a wrong result fails even where memcheck is silent. Stages
whose kernel module does not exist yet are skipped with a printed line. The `graph` stage (capture,
then replay with num_valid changed in place) needs the caching allocator, so it is skipped when
PYTORCH_NO_CUDA_MEMORY_CACHING=1 and run in a second memcheck pass without it
(`--stages graph`; scripts/gpu_run.sh runs both passes). Exit status 1 when any
case failed, 0 otherwise (memcheck adds its own errors through --error-exitcode).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable

import torch

STALE_ID = 123456789
_ROUTER, _EXPERTS = "safemoe.kernels.routing", "safemoe.kernels.experts"
KERNELS: dict[str, tuple[str, ...]] = {
    "route": (_ROUTER,),
    "experts": (_EXPERTS,),
    "moe": (_ROUTER, _EXPERTS),
    "graph": (_ROUTER, _EXPERTS),
}
Case = tuple[str, Callable[[], None]]


def _missing(stage: str) -> str | None:
    for module in KERNELS[stage]:
        if importlib.util.find_spec(module) is None:
            return module
    return None


def _bad_logits(num_tokens: int, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Random logits with an all-NaN row, an all-+Inf row, an all--Inf row and one NaN at an odd
    offset (rows that exist at this T)."""
    logits = torch.randn(num_tokens, num_experts, device="cuda").to(dtype)
    specials = [float("nan"), float("inf"), float("-inf")]
    for row, value in enumerate(specials[:num_tokens]):
        logits[row] = value
    if num_tokens > 3:
        logits[3, num_experts // 2 | 1 if num_experts > 1 else 0] = float("nan")
    return logits


def _check_routing(weights: torch.Tensor, ids: torch.Tensor, num_experts: int, num_valid: int) -> None:
    valid_ids, valid_w = ids[:num_valid].long(), weights[:num_valid]
    assert bool(((valid_ids >= 0) & (valid_ids < num_experts)).all()), "valid row with an id outside [0, E)"
    if valid_ids.numel():
        ordered = valid_ids.sort(dim=1).values
        assert bool((ordered[:, 1:] != ordered[:, :-1]).all()), "valid row with duplicate ids"
    assert bool(torch.isfinite(valid_w).all() & (valid_w >= 0).all()), "non-finite or negative weight"
    assert bool((ids[num_valid:] == -1).all()), "padded row id is not -1"
    assert bool((weights[num_valid:] == 0).all()), "padded row weight is not 0"


def route_cases() -> list[Case]:
    import safemoe

    cases: list[Case] = []
    for num_experts, top_k in ((8, 2), (60, 4), (128, 8), (257, 8)):
        for dtype in (torch.bfloat16, torch.float32):
            for num_tokens, num_valid in ((1, None), (7, "tensor"), (33, 20)):

                def case(e=num_experts, k=top_k, d=dtype, t=num_tokens, nv=num_valid) -> None:
                    logits = _bad_logits(t, e, d)
                    count = t if nv is None else (t // 2 if nv == "tensor" else nv)
                    arg = torch.tensor(count, device="cuda") if nv == "tensor" else nv
                    if count < t:
                        logits[count:] = float("nan")  # padding holds garbage; it must not be read
                    health = safemoe.new_health_tensor("cuda")
                    r = safemoe.route(logits, k, num_valid=arg, backend="triton", health=health)
                    _check_routing(r.weights, r.ids, e, count)

                cases.append(
                    (
                        f"route E={num_experts} K={top_k} {str(dtype)[6:]} T={num_tokens} "
                        f"num_valid={num_valid}",
                        case,
                    )
                )

    def grouped() -> None:
        logits = _bad_logits(17, 64, torch.bfloat16)
        bias = torch.randn(64, device="cuda")
        r = safemoe.route(
            logits,
            6,
            scoring="sigmoid",
            bias=bias,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            num_valid=torch.tensor(11, device="cuda"),
            backend="triton",
        )
        _check_routing(r.weights, r.ids, 64, 11)

    def empty() -> None:
        r = safemoe.route(torch.empty(0, 32, device="cuda", dtype=torch.bfloat16), 4, backend="triton")
        assert r.ids.shape == (0, 4)

    cases += [("route sigmoid+bias grouped 8/4 E=64 K=6", grouped), ("route T=0", empty)]
    return cases


def _routing_with_bad_ids(num_tokens: int, num_experts: int, top_k: int):
    import safemoe

    ids = torch.randint(0, num_experts, (num_tokens, top_k), device="cuda", dtype=torch.int32)
    bad = [-1, STALE_ID, -5, num_experts]
    for row in range(min(num_tokens, len(bad))):
        ids[row, 0] = bad[row]
    if num_tokens > 4 and top_k > 1:
        ids[4, 1] = ids[4, 0]  # duplicate ids in a row are legal: each slot counts
    weights = torch.rand(num_tokens, top_k, device="cuda")
    return safemoe.Routing(weights=weights, ids=ids)


def experts_cases() -> list[Case]:
    import safemoe

    cases: list[Case] = []
    settings = [
        ("silu", torch.bfloat16),
        ("gelu", torch.bfloat16),
        ("swigluoai", torch.bfloat16),
        ("silu", torch.float16),
    ]
    for activation, dtype in settings:
        for num_tokens, num_valid in ((1, None), (17, "tensor"), (33, 30)):

            def case(a=activation, d=dtype, t=num_tokens, nv=num_valid) -> None:
                num_experts, top_k, hidden, inter = 8, 2, 64, 32
                x = torch.randn(t, hidden, device="cuda").to(d)
                w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda") * 0.1).to(d)
                w2 = (torch.randn(num_experts, hidden, inter, device="cuda") * 0.1).to(d)
                routing = _routing_with_bad_ids(t, num_experts, top_k)
                count = t if nv is None else (t // 2 if nv == "tensor" else nv)
                arg = torch.tensor(count, device="cuda") if nv == "tensor" else nv
                x[count:] = float("nan")
                routing.ids[count:] = STALE_ID
                routing.weights[count:] = float("nan")
                health = safemoe.new_health_tensor("cuda")
                out = safemoe.experts(
                    x, w13, w2, routing, activation=a, num_valid=arg, backend="triton", health=health
                )
                assert bool(torch.isfinite(out[:count]).all()), "non-finite output on a valid row"
                assert bool((out[count:] == 0).all()), "padded output row is not exact zeros"

            cases.append(
                (f"experts {activation} {str(dtype)[6:]} T={num_tokens} num_valid={num_valid}", case)
            )
    for num_tokens, top_k in ((1, 8), (2, 8), (4, 4)):

        def fused_case(t=num_tokens, k=top_k) -> None:
            # The fused few-slot launch (GEMM1 and GEMM2 in one kernel, spin-waits on workspace
            # counters) is a per-bucket tuned choice the small shapes above never pick, so it is
            # run here through the launcher with an explicit config.
            from safemoe._checks import NumValid
            from safemoe.configs import ExpertsConfig, GemmTiles
            from safemoe.kernels.experts import experts_triton

            num_experts, hidden, inter = 6, 96, 80
            clean_x = torch.randn(t, hidden, device="cuda").to(torch.bfloat16)
            w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda") * 0.1).to(torch.bfloat16)
            w2 = (torch.randn(num_experts, hidden, inter, device="cuda") * 0.1).to(torch.bfloat16)
            routing = _routing_with_bad_ids(t, num_experts, k)
            cfg = ExpertsConfig(16, GemmTiles(block_n=32, block_k=64, group_m=1),
                                GemmTiles(block_n=64, block_k=32, group_m=1, tma=True), fused=True, pdl=True)
            for count in range(t + 1):
                x = clean_x.clone()
                x[count:] = float("nan")
                out = experts_triton(x, w13, w2, routing.weights, routing.ids, activation="silu",
                                     num_valid=NumValid(None, torch.tensor(count, device="cuda")),
                                     health=None, config=cfg, few_config=cfg)
                assert bool(torch.isfinite(out[:count]).all()), "non-finite output on a valid row"
                assert bool((out[count:] == 0).all()), "padded output row is not exact zeros"

        cases.append((f"experts fused few-slot launch T={num_tokens} K={top_k}", fused_case))
    return cases


def moe_cases() -> list[Case]:
    import safemoe

    def case() -> None:
        num_experts, top_k, hidden, inter, t, count = 16, 4, 64, 32, 9, 5
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        logits = _bad_logits(t, num_experts, torch.bfloat16)
        w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.1
        w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.1
        x[count:] = float("nan")
        out = safemoe.moe(
            x, logits, w13, w2, top_k, num_valid=torch.tensor(count, device="cuda"), backend="triton"
        )
        assert bool(torch.isfinite(out[:count]).all()) and bool((out[count:] == 0).all())

    return [("moe E=16 K=4 T=9 num_valid=tensor(5) NaN rows", case)]


def graph_cases() -> list[Case]:
    import safemoe

    def case() -> None:
        num_experts, top_k, hidden, inter, t = 16, 4, 64, 32, 12
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        logits = _bad_logits(t, num_experts, torch.bfloat16)
        w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.1
        w2 = torch.randn(num_experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.1
        num_valid = torch.tensor(t, device="cuda")
        safemoe.moe(x, logits, w13, w2, top_k, num_valid=num_valid, backend="triton")  # compile first
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = safemoe.moe(x, logits, w13, w2, top_k, num_valid=num_valid, backend="triton")
        for count in (5, 0, 1, t):
            num_valid.fill_(count)
            x[count:] = float("nan")
            graph.replay()
            torch.cuda.synchronize()
            assert bool(torch.isfinite(out[:count]).all()), f"replay with num_valid={count}: non-finite row"
            assert bool((out[count:] == 0).all()), f"replay with num_valid={count}: padded row not zero"
            x[count:] = torch.randn(t - count, hidden, device="cuda", dtype=torch.bfloat16)

    return [("graph capture moe, replay with num_valid 5, 0, 1, 12", case)]


STAGES = {"route": route_cases, "experts": experts_cases, "moe": moe_cases, "graph": graph_cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated, from {', '.join(STAGES)}"
    )
    stages = [name for name in parser.parse_args(argv).stages.split(",") if name]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}")
    if not torch.cuda.is_available():
        print("sanitize: needs a CUDA GPU; nothing run")
        return 0
    torch.manual_seed(0)
    no_caching = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0")
    ran = failed = skipped = 0
    for stage in stages:
        missing = _missing(stage)
        if missing is not None:
            print(f"skip {stage}: {missing} not built yet", flush=True)
            skipped += 1
            continue
        if stage == "graph" and no_caching:
            # Capture allocates from the caching allocator's graph pool; without it every
            # allocation is a cudaMalloc, which a capturing stream forbids.
            print(
                "skip graph: CUDA-graph capture needs the caching allocator; run this stage in a pass "
                "without PYTORCH_NO_CUDA_MEMORY_CACHING",
                flush=True,
            )
            skipped += 1
            continue
        make_cases = STAGES[stage]
        for name, case in make_cases():
            ran += 1
            try:
                case()
                torch.cuda.synchronize()
            except Exception as exc:
                failed += 1
                print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc()
            else:
                print(f"ok   {name}", flush=True)
    print(
        f"sanitize: {ran} cases run, {failed} failed, {skipped} stages skipped",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, "src")  # the GPU machine runs from a checkout without installing
    sys.exit(main())
