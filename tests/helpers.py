"""Shared test tools: adversarial inputs, poisoned outputs, one assert_close for the project."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import pytest
import torch

FLT_MAX = torch.finfo(torch.float32).max

# Per-dtype tolerances (atol, rtol) for values computed in fp32 and stored in the given dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1.3e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

STALE_ID = 123456789  # what a torch.empty buffer once held in vLLM #41834


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    what: str = "",
) -> None:
    """Values within the dtype's tolerance; NaN never passes; prints the worst mismatches."""
    assert actual.shape == expected.shape, f"{what} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    default_atol, default_rtol = TOLERANCES[dtype or expected.dtype]
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    nonfinite = ~torch.isfinite(a) & torch.isfinite(e)
    err = (a - e).abs()
    bad = nonfinite | ~(err <= atol + rtol * e.abs())
    if bad.any():
        flat = torch.where(bad.reshape(-1), torch.nan_to_num(err.reshape(-1), nan=math.inf), -1.0)
        worst = torch.topk(flat, min(8, int(bad.sum()))).indices
        lines = []
        for i in worst.tolist():
            idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), a.shape))
            got, want = a.reshape(-1)[i].item(), e.reshape(-1)[i].item()
            lines.append(f"  at {idx}: actual {got:.6g} expected {want:.6g}")
        raise AssertionError(
            f"{what} {int(bad.sum())}/{a.numel()} elements differ (atol={atol}, rtol={rtol}); worst:\n"
            + "\n".join(lines)
        )


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Exact equality (ids, maps, bitwise outputs); prints the first differences."""
    assert actual.shape == expected.shape, f"{what} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point():
        same = (a.view(torch.int16 if a.element_size() == 2 else torch.int32)
                == e.view(torch.int16 if e.element_size() == 2 else torch.int32))
    else:
        same = a == e
    if not bool(same.all()):
        where = torch.nonzero(~same)[:8].tolist()
        lines = [f"  at {tuple(w)}: actual {a[tuple(w)].item()} expected {e[tuple(w)].item()}" for w in where]
        raise AssertionError(f"{what} {int((~same).sum())} elements differ; first:\n" + "\n".join(lines))


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A buffer full of values no kernel should leave behind: NaN for floats, a stale id for ints."""
    if dtype.is_floating_point:
        return torch.full(shape, math.nan, dtype=dtype, device=device)
    return torch.full(shape, STALE_ID, dtype=dtype, device=device)


def tie_free_logits(
    num_tokens: int,
    num_experts: int,
    *,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Logits whose values in a row are distinct steps of min(1/8, 16/E) inside [-8, 8).

    The steps are far apart relative to fp32 rounding of softmax and sigmoid (sigmoid(8) is still
    4e-5 from its neighbour, against an ulp of 6e-8), so the K largest scores are unambiguous for
    any correct implementation. In bf16 with E > 256 neighbours can round together: those become
    exact ties, which the contract resolves deterministically (lowest index)."""
    perms = torch.argsort(torch.rand(num_tokens, num_experts, generator=generator), dim=1)
    step = min(1.0 / 8.0, 16.0 / num_experts)
    values = (perms.float() - num_experts / 2) * step
    return values.to(dtype).to(device)


ADVERSARIAL_ROW_KINDS = (
    "all_nan", "all_pos_inf", "all_neg_inf", "mixed_nonfinite", "one_nan_odd", "one_pos_inf_odd",
    "one_neg_inf_odd", "all_equal", "huge_finite", "tie_free",
)


def adversarial_logits(num_experts: int, *, dtype: torch.dtype = torch.float32,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[str]]:
    """One row of each adversarial kind, [len(ADVERSARIAL_ROW_KINDS), E], and the kinds' names."""
    base = tie_free_logits(len(ADVERSARIAL_ROW_KINDS), num_experts, generator=generator)
    rows = base.clone()
    odd = min(num_experts - 1, 2 * (num_experts // 4) + 1)  # an odd offset inside the row
    for i, kind in enumerate(ADVERSARIAL_ROW_KINDS):
        if kind == "all_nan":
            rows[i] = math.nan
        elif kind == "all_pos_inf":
            rows[i] = math.inf
        elif kind == "all_neg_inf":
            rows[i] = -math.inf
        elif kind == "mixed_nonfinite":
            pattern = torch.tensor([math.nan, math.inf, -math.inf, 1.0])
            rows[i] = pattern.repeat(num_experts // 4 + 1)[:num_experts]
        elif kind == "one_nan_odd":
            rows[i, odd] = math.nan
        elif kind == "one_pos_inf_odd":
            rows[i, odd] = math.inf
        elif kind == "one_neg_inf_odd":
            rows[i, odd] = -math.inf
        elif kind == "all_equal":
            rows[i] = 0.5
        elif kind == "huge_finite":
            rows[i] = torch.where(base[i] > 0, 3e4, -3e4)  # finite in fp16 too
    return rows.to(dtype), list(ADVERSARIAL_ROW_KINDS)


def garbage_ids(num_tokens: int, top_k: int, num_experts: int, *,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """[T, K] int32 ids mixing valid, duplicate, -1, negative, >= E and stale values."""
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=generator, dtype=torch.int32)
    choice = torch.randint(0, 8, (num_tokens, top_k), generator=generator)
    ids = torch.where(choice == 0, torch.full_like(ids, -1), ids)
    ids = torch.where(choice == 1, torch.full_like(ids, num_experts), ids)
    ids = torch.where(choice == 2, torch.full_like(ids, STALE_ID), ids)
    ids = torch.where(choice == 3, torch.full_like(ids, -7), ids)
    if top_k > 1:  # duplicates: copy column 0 into column 1 on some rows
        dup = torch.rand(num_tokens, generator=generator) < 0.3
        ids[:, 1] = torch.where(dup, ids[:, 0], ids[:, 1])
    return ids


# ---------------------------------------------------------------------------------------------
# Devices: one test body, parametrised over where the Triton kernels run
# ---------------------------------------------------------------------------------------------

DEVICES = ("cpu", "cuda")
# Set by conftest.py on a machine without CUDA (before anything imports triton), as safemoe does.
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_skip_reason(device: str) -> str | None:
    """Why the Triton kernels cannot run on `device` here, or None."""
    if device == "cpu" and not INTERPRETER:
        return ("cpu: the Triton interpreter is off (TRITON_INTERPRET is not 1, as on a CUDA machine), "
                "so Triton kernels cannot run on CPU tensors")
    if device == "cuda":
        if not torch.cuda.is_available():
            return "needs a CUDA device"
        if INTERPRETER:
            return "cuda: TRITON_INTERPRET=1 is set; compiled kernels need it unset"
    return None


def device_marks(device: str) -> list:
    """The cuda variant is marked gpu (conftest skips those without CUDA; `-m gpu` selects them);
    a variant this machine cannot run is skipped with the reason."""
    marks = [pytest.mark.gpu] if device == "cuda" else []
    reason = device_skip_reason(device)
    if reason is not None:
        marks.append(pytest.mark.skip(reason=reason))
    return marks


def device_param(device: str, *values: object, marks: Iterable = (), id: str | None = None):
    """One pytest.param whose first value is the device, carrying that device's marks."""
    return pytest.param(device, *values, marks=[*device_marks(device), *marks], id=id)


def by_device(*, cpu: Iterable = (), cuda: Iterable = ()) -> list:
    """Parameters for ("device", *names): each device's own cases, so shapes that differ between
    the interpreter (small) and a GPU (model-sized) are data, not a second test body. A case is a
    tuple of values (or one value); wrap it in pytest.param to give it marks or an id.

        @pytest.mark.parametrize(("device", "num_tokens"), by_device(cpu=[1, 7], cuda=[1, 7, 4097]))
    """
    params = []
    for device, cases in (("cpu", cpu), ("cuda", cuda)):
        for case in cases:
            if isinstance(case, type(pytest.param())):
                params.append(device_param(device, *case.values, marks=case.marks, id=case.id))
            else:
                values = case if isinstance(case, tuple) else (case,)
                params.append(device_param(device, *values))
    return params


def case_id(value: object) -> str | None:
    """Readable test ids for dtypes ("bf16", not "dtype3"); pytest's own for everything else."""
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    return names.get(value) if isinstance(value, torch.dtype) else None


def interpreter_only(reason: str) -> pytest.MarkDecorator:
    """For Triton cases that run on the interpreter only (the reason says why not compiled)."""
    return pytest.mark.skipif(not INTERPRETER, reason=f"interpreter only: {reason}")


# ---------------------------------------------------------------------------------------------
# A Qwen3-30B-A3B MoE layer on the GPU (graphs, compile and memory cases)
# ---------------------------------------------------------------------------------------------

QWEN3_SHAPE = (128, 8, 2048, 768)  # (E, K, H, I) of Qwen3-30B-A3B


def qwen3_workspace(max_tokens: int):
    from safemoe.workspace import Workspace

    num_experts, top_k, hidden, inter = QWEN3_SHAPE
    return Workspace(max_tokens, num_experts, top_k, hidden, inter, torch.bfloat16, "cuda")


def qwen3_moe(workspace=None, **kwargs):
    """safemoe.MoE at the Qwen3-30B-A3B shape in bf16 on CUDA, N(0, fan_in^-1/2) weights."""
    from safemoe.layer import MoE

    num_experts, top_k, hidden, inter = QWEN3_SHAPE
    torch.manual_seed(0)
    moe = MoE(hidden, inter, num_experts, top_k, dtype=torch.bfloat16, device="cuda", workspace=workspace,
              **kwargs)
    with torch.no_grad():
        moe.gate.weight.normal_(0, hidden**-0.5)
        moe.w13.normal_(0, hidden**-0.5)
        moe.w2.normal_(0, inter**-0.5)
    return moe


def load_script(name: str):
    """scripts/<name>.py as a module (registered in sys.modules under `name`, so that its
    dataclasses and pickling work)."""
    import importlib.util
    import sys
    from pathlib import Path

    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def capture_graph(step) -> tuple[torch.cuda.CUDAGraph, object]:
    """step() once on a side stream (kernels compiled and the allocator warmed before capture, as
    torch's CUDA-graph docs ask), then step() captured into a CUDA graph. Returns the graph and
    what the captured call returned (tensors each replay writes again)."""
    from safemoe.graphs import warm_up

    warm_up(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


# ---------------------------------------------------------------------------------------------
# --test-shard K/N (conftest.py): the suite split over device calls
# ---------------------------------------------------------------------------------------------


def parse_test_shard(text: str) -> tuple[int, int]:
    """"K/N" -> (K, N) with 1 <= K <= N; ValueError naming what is wrong."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"expected K/N such as 1/2, got {text!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"K/N needs 1 <= K <= N, got {text!r}")
    return k, n


def in_test_shard(nodeid: str, part: tuple[int, int]) -> bool:
    """Whether a test belongs to part K of N: crc32 of its id (stable across processes, xdist
    workers and runs; Python's hash() is salted per process)."""
    import zlib

    k, n = part
    return zlib.crc32(nodeid.encode()) % n == k - 1


def run_compiled(module: str, expression: str, timeout: int = 900) -> str:
    """stdout of `print(expression)` evaluated after `import <module> as m` in a fresh Python
    with this tests directory on its path and TRITON_INTERPRET=0: Triton compiles for a GPU target
    there (no GPU needed), where this process interprets every @triton.jit it has imported.
    Fails the test with the child's stderr when it exits non-zero."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, sys.argv[1]); import {module} as m; print({expression})"
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compiled, as on a GPU
    done = subprocess.run([sys.executable, "-c", code, tests], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
