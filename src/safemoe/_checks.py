"""Host-side argument checks: every public op calls these before any kernel launches.

Messages name the argument and the offending value, so a user sees what to fix. Nothing here
reads device memory (no host sync): a device `num_valid` is checked for dtype, shape and device
only, and kernels clamp its value to [0, T].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from safemoe.numerics import FP8_BLOCK, FP8_DTYPE
from safemoe.route_config import RouteConfig

if TYPE_CHECKING:
    from safemoe.workspace import Workspace

ACTIVATIONS = ("silu", "gelu", "swigluoai")
BACKENDS = ("auto", "reference", "triton")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class NumValid:
    """`num_valid` normalised: exactly one of `count` (host int) and `tensor` (0-dim device) is set."""

    count: int | None
    tensor: torch.Tensor | None

    def row_mask(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """[T] bool, True for rows below num_valid (device op, no host sync)."""
        rows = torch.arange(num_rows, device=device)
        if self.tensor is not None:
            return rows < self.tensor.to(device=device, dtype=torch.int64).clamp(0, num_rows)
        assert self.count is not None
        return rows < self.count


def check_tensor(name: str, t: object, *, dims: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    return t


def check_same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (like the other inputs), got {t.device}")


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)}); "
            f"call {name}.contiguous() first"
        )


def check_num_valid(num_valid: object, num_rows: int, device: torch.device) -> NumValid:
    """Validate `num_valid` against T rows on `device`."""
    if num_valid is None:
        return NumValid(count=num_rows, tensor=None)
    if isinstance(num_valid, bool):
        raise TypeError("num_valid must be None, an int or a 0-dim integer tensor, got bool")
    if isinstance(num_valid, int):
        if not 0 <= num_valid <= num_rows:
            raise ValueError(f"num_valid must be in [0, T={num_rows}], got {num_valid}")
        return NumValid(count=num_valid, tensor=None)
    if isinstance(num_valid, torch.Tensor):
        if num_valid.dim() != 0:
            raise ValueError(f"num_valid tensor must be 0-dim, got shape {tuple(num_valid.shape)}")
        if num_valid.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"num_valid tensor must be int32 or int64, got {num_valid.dtype}")
        if num_valid.device != device:
            raise ValueError(
                f"num_valid tensor must be on {device} (the inputs' device), got {num_valid.device}"
            )
        return NumValid(count=None, tensor=num_valid)
    raise TypeError(
        f"num_valid must be None, an int or a 0-dim integer tensor, got {type(num_valid).__name__}"
    )


def check_backend(backend: object) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return str(backend)


def resolve_auto(choice: str, device: torch.device, elsewhere: str) -> str:
    """'auto' is "triton" on CUDA and `elsewhere` on other devices (the interpreter is slow);
    any other choice stands. Backends and EP exchanges both resolve this way."""
    if choice == "auto":
        return "triton" if device.type == "cuda" else elsewhere
    return choice


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' is the Triton kernels on CUDA and the reference elsewhere."""
    return resolve_auto(backend, device, "reference")


def check_flag(name: str, value: object) -> bool:
    """A keyword that must be a bool (not 0/1, not None)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_batch_invariant(batch_invariant: object, backend: str, what: str) -> bool:
    """batch_invariant must be a bool; True needs the Triton kernels (`backend` resolved): the
    reference's torch matmuls and reductions pick their algorithm by shape."""
    flag = check_flag("batch_invariant", batch_invariant)
    if flag and backend != "triton":
        raise ValueError(
            f"{what}: batch_invariant=True is a guarantee of the Triton kernels, got backend={backend!r} "
            "(pass backend='triton'; on CPU that runs under TRITON_INTERPRET=1)"
        )
    return flag


def check_route_args(
    logits: object,
    top_k: int | RouteConfig,
    *,
    bias: object = None,
    **options: Any,
) -> RouteConfig:
    """Validate router logits [T, E] (and the selection bias [E]) against a routing config, given
    whole or as top_k plus options; returns the config."""
    config = RouteConfig.of(top_k, options)  # type and range checks of every option
    logits = check_tensor("logits", logits, dims=2, dtypes=FLOAT_DTYPES)
    check_contiguous("logits", logits)
    num_experts = logits.shape[1]
    if num_experts < 1:
        raise ValueError(f"logits must have at least one expert column, got shape {tuple(logits.shape)}")
    config.check(num_experts)
    if bias is not None:
        bias = check_tensor("bias", bias, dims=1, dtypes=FLOAT_DTYPES)
        if bias.shape[0] != num_experts:
            raise ValueError(f"bias must have shape [E={num_experts}], got {tuple(bias.shape)}")
        check_same_device("bias", bias, logits.device)
        check_contiguous("bias", bias)
    return config


def check_routing_tensors(ids: object, weights: object, num_rows: int, device: torch.device) -> None:
    ids = check_tensor("routing.ids", ids, dims=2, dtypes=(torch.int32,))
    weights = check_tensor("routing.weights", weights, dims=2, dtypes=(torch.float32,))
    if ids.shape != weights.shape:
        raise ValueError(
            f"routing.ids and routing.weights must have the same shape, got {tuple(ids.shape)} "
            f"and {tuple(weights.shape)}"
        )
    if ids.shape[0] != num_rows:
        raise ValueError(f"routing has {ids.shape[0]} rows but x has T={num_rows}")
    if ids.shape[1] < 1:
        raise ValueError(f"routing must have K >= 1 columns, got shape {tuple(ids.shape)}")
    check_same_device("routing.ids", ids, device)
    check_same_device("routing.weights", weights, device)
    check_contiguous("routing.ids", ids)
    check_contiguous("routing.weights", weights)


def check_experts_args(x: object, w13: object, w2: object, activation: object) -> tuple[int, int, int, int]:
    """Returns (T, E, H, I)."""
    x = check_tensor("x", x, dims=2, dtypes=FLOAT_DTYPES)
    w13 = check_tensor("w13", w13, dims=3, dtypes=FLOAT_DTYPES)
    w2 = check_tensor("w2", w2, dims=3, dtypes=FLOAT_DTYPES)
    num_tokens, hidden = x.shape
    num_experts, two_inter, w13_hidden = w13.shape
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"x, w13 and w2 must share a dtype, got {x.dtype=} {w13.dtype=} {w2.dtype=}")
    if two_inter % 2 != 0 or two_inter == 0:
        raise ValueError(
            f"w13 must have shape [E, 2*I, H] with gate rows then up rows, got {tuple(w13.shape)}"
        )
    inter = two_inter // 2
    if w13_hidden != hidden:
        raise ValueError(f"w13 must have shape [E, 2*I, H={hidden}] to match x, got {tuple(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(
            f"w2 must have shape [E={num_experts}, H={hidden}, I={inter}] to match w13, got {tuple(w2.shape)}"
        )
    if num_experts < 1 or hidden < 1:
        raise ValueError(f"w13 must have E >= 1 and H >= 1, got {tuple(w13.shape)}")
    for name, t in (("w13", w13), ("w2", w2)):
        check_same_device(name, t, x.device)
    check_contiguous("x", x)
    check_contiguous("w13", w13)
    check_contiguous("w2", w2)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return num_tokens, num_experts, hidden, inter


# ----------------------------------------------------------------------------------------------
# fp8 (e4m3) expert weights
# ----------------------------------------------------------------------------------------------

FP8_WEIGHT_DTYPES = (FP8_DTYPE,)
FP8_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp8Weights:
    """fp8 expert weight scales, validated. mode "per_tensor": w13_scale [E] or [E, 2] (gate, up),
    w2_scale [E]; activations per token. mode "block": 128x128 weight blocks, w13_scale
    [E, ceil(2I/128), ceil(H/128)], or [E, 2*ceil(I/128), ceil(H/128)] when gate and up were
    quantised as separate matrices (`gate_up_split`; the two shapes differ only when I % 128 != 0),
    w2_scale [E, ceil(H/128), ceil(I/128)]; activations in 1x128 groups."""

    mode: str
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    gate_up_split: bool = False


def _is_fp8(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FP8_WEIGHT_DTYPES


def wants_fp8(w13: object, w2: object, w13_scale: object, w2_scale: object) -> bool:
    """True when a call asks for the fp8 path (fp8 weights or any scale given)."""
    return _is_fp8(w13) or _is_fp8(w2) or w13_scale is not None or w2_scale is not None


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def fp8_scale_shapes(num_experts: int, hidden: int, inter: int,
                     mode: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(w13_scale, w2_scale) shapes of fp8 experts in `mode` as `quantize_experts` makes them:
    per_tensor ([E], [E]); block ([E, ceil(2I/128), ceil(H/128)], [E, ceil(H/128), ceil(I/128)]).
    `check_fp8_weights` also accepts per-tensor [E, 2] and block gate/up quantised apart."""
    if mode == "per_tensor":
        return (num_experts,), (num_experts,)
    if mode == "block":
        return ((num_experts, _blocks(2 * inter), _blocks(hidden)),
                (num_experts, _blocks(hidden), _blocks(inter)))
    raise ValueError(f"mode must be 'per_tensor' or 'block', got {mode!r}")


def check_fp8_weights(w13: object, w2: object, w13_scale: object, w2_scale: object) -> Fp8Weights:
    """Validate fp8 weights and their scales; the mode follows from the scale shapes."""
    for name, w in (("w13", w13), ("w2", w2)):
        if isinstance(w, torch.Tensor) and w.dtype not in FP8_WEIGHT_DTYPES and (
            w13_scale is not None or w2_scale is not None
        ):
            raise TypeError(
                f"w13_scale/w2_scale are only for float8_e4m3fn weights, but {name} is {w.dtype}; "
                "quantise with safemoe.quantize_experts or drop the scales"
            )
    w13 = check_tensor("w13", w13, dims=3, dtypes=FP8_WEIGHT_DTYPES)
    w2 = check_tensor("w2", w2, dims=3, dtypes=FP8_WEIGHT_DTYPES)
    if w13_scale is None or w2_scale is None:
        raise ValueError(
            "float8_e4m3fn w13/w2 need both w13_scale and w2_scale (dequantised = fp8 * scale: from "
            f"safemoe.quantize_experts or a checkpoint's weight_scale_inv), got w13_scale="
            f"{'None' if w13_scale is None else 'tensor'} w2_scale={'None' if w2_scale is None else 'tensor'}"
        )
    num_experts, two_inter, hidden = w13.shape
    if two_inter % 2 != 0 or two_inter == 0 or num_experts < 1 or hidden < 1:
        raise ValueError(
            f"w13 must have shape [E, 2*I, H] with gate rows then up rows, got {tuple(w13.shape)}"
        )
    inter = two_inter // 2
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(
            f"w2 must have shape [E={num_experts}, H={hidden}, I={inter}] to match w13, got {tuple(w2.shape)}"
        )
    for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(scale).__name__}")
        if scale.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (dequantised = fp8 * scale), got {scale.dtype}")
    assert isinstance(w13_scale, torch.Tensor) and isinstance(w2_scale, torch.Tensor)
    for name, t in (("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        check_same_device(name, t, w13.device)
    for name, t in (("w13", w13), ("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        check_contiguous(name, t)

    Shapes = list[tuple[int, ...]]
    per_tensor_13, per_tensor_2 = fp8_scale_shapes(num_experts, hidden, inter, "per_tensor")
    per_tensor_shapes: dict[str, Shapes] = {"w13_scale": [per_tensor_13, (num_experts, 2)],
                                            "w2_scale": [per_tensor_2]}
    stacked, block_2 = fp8_scale_shapes(num_experts, hidden, inter, "block")
    split = (num_experts, 2 * _blocks(inter), _blocks(hidden))
    block_shapes: dict[str, Shapes] = {"w13_scale": [stacked, split], "w2_scale": [block_2]}
    modes = []
    for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        shape = tuple(scale.shape)
        if shape in per_tensor_shapes[name]:
            modes.append("per_tensor")
        elif shape in block_shapes[name]:
            modes.append("block")
        else:
            raise ValueError(
                f"{name} has shape {shape}; for w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} it must be "
                f"per-tensor {' or '.join(map(str, per_tensor_shapes[name]))}, or 128x128 block "
                f"{' or '.join(map(str, dict.fromkeys(block_shapes[name])))}"
            )
    if modes[0] != modes[1]:
        raise ValueError(
            f"w13_scale is {modes[0]} ({tuple(w13_scale.shape)}) but w2_scale is {modes[1]} "
            f"({tuple(w2_scale.shape)}); both matrices must use one mode"
        )
    gate_up_split = modes[0] == "block" and tuple(w13_scale.shape) != stacked
    return Fp8Weights(modes[0], w13_scale, w2_scale, gate_up_split)


def check_fp8_experts_args(
    x: object, w13: object, w2: object, w13_scale: object, w2_scale: object, activation: object
) -> tuple[int, int, int, int, Fp8Weights]:
    """Returns (T, E, H, I, scales) for a call with fp8 expert weights."""
    spec = check_fp8_weights(w13, w2, w13_scale, w2_scale)
    if isinstance(x, torch.Tensor) and x.dtype not in FP8_ACTIVATION_DTYPES and x.dim() == 2:
        raise TypeError(f"with float8_e4m3fn weights x must be bfloat16 or float16, got {x.dtype}")
    x = check_tensor("x", x, dims=2, dtypes=FP8_ACTIVATION_DTYPES)
    num_tokens, hidden = x.shape
    assert isinstance(w13, torch.Tensor)
    num_experts, two_inter, w13_hidden = w13.shape
    if w13_hidden != hidden:
        raise ValueError(f"w13 must have shape [E, 2*I, H={hidden}] to match x, got {tuple(w13.shape)}")
    check_same_device("w13", w13, x.device)
    check_contiguous("x", x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return num_tokens, num_experts, hidden, two_inter // 2, spec


def check_workspace(workspace: object, x: torch.Tensor, w13: torch.Tensor, top_k: int,
                    *, fp8: bool = False) -> Workspace | None:
    """A `safemoe.Workspace` (or None) that can serve a call with these inputs, on every backend
    (the reference backend does not use it, but takes the same arguments as the Triton one)."""
    from safemoe.workspace import Workspace

    if workspace is None:
        return None
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a safemoe.Workspace or None, got {type(workspace).__name__}")
    num_experts, two_inter, hidden = w13.shape
    workspace.check(x.shape[0], num_experts, top_k, hidden, two_inter // 2, x.dtype, x.device, fp8=fp8)
    return workspace


def check_expert_weights(
    x: object, w13: object, w2: object, activation: object, w13_scale: object, w2_scale: object
) -> tuple[int, int, int, int, Fp8Weights | None]:
    """(T, E, H, I, fp8 scales or None) of an expert call: fp8 weights (or any scale given) take
    the fp8 checks, anything else the bf16/fp16/fp32 ones."""
    if wants_fp8(w13, w2, w13_scale, w2_scale):
        return check_fp8_experts_args(x, w13, w2, w13_scale, w2_scale, activation)
    return (*check_experts_args(x, w13, w2, activation), None)
