"""Launch helpers every kernel module shares: reading `num_valid` on the device, programmatic
dependent launch (PDL), the SM count that sizes persistent grids, and the interpreter's
position-independent product for batch-invariant mode."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """With programmatic dependent launch: wait until the previous kernel has finished and its
    writes are visible (before this kernel reads anything), then let the next kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def load_num_valid(num_valid_ptr, num_valid_count, num_tokens, HAS_NUM_VALID_PTR: tl.constexpr):
    """num_valid from the device (clamped to [0, T]) or the host int."""
    if HAS_NUM_VALID_PTR:
        count = tl.load(num_valid_ptr).to(tl.int64)
        count = tl.minimum(tl.maximum(count, 0), num_tokens)
        return count.to(tl.int32)
    else:
        return num_valid_count


@triton.jit
def rowwise_product(a, b):
    """a [M, K] @ b [K, N] in fp32 as a broadcast product summed over K, for the Triton interpreter
    in batch-invariant mode. The interpreter's tl.dot is numpy's matmul, and OpenBLAS's sgemm (numpy
    2.4, OpenBLAS 0.3.31, Haswell kernels) gives a row other bits at other positions of the same
    tile: with one row placed at each of the 32 positions of a [32, 32] @ [32, 32] product, rows
    6-11 and 18-31 differed from row 0 in 11 or 12 of 32 outputs. A GPU MMA computes every output
    alone, so the GEMMs there keep tl.dot; numpy's sum over a middle axis adds the K terms one
    after another for every output, wherever its row sits."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


# Host-side integer helpers for grids and block sizes. Triton 3.5+ makes triton.cdiv and
# triton.next_power_of_2 `constexpr_function`s, whose host calls unwrap every argument: a few
# microseconds each, ~20 of them in one eager decode step (cProfile, H100 host, 2026-11-27).
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (triton.cdiv's value)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1, 0 for n = 0 (triton.next_power_of_2's value)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def pdl_supported() -> bool:
    """Whether this triton accepts `launch_pdl` (programmatic dependent launch) as a launch option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_usable(device: torch.device) -> bool:
    """Whether kernels on `device` may launch with PDL: a CUDA device of compute capability 9.0
    or newer (griddepcontrol is Hopper's) and a Triton with the launch option. A config asking
    for PDL on another device launches without it."""
    return hopper_or_newer(device) and pdl_supported()


def hopper_or_newer(device: torch.device) -> bool:
    """Whether `device` is a CUDA device of compute capability 9.0 or newer (TMA, wgmma, PDL)."""
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device, got {type(device).__name__}")
    if device.type != "cuda":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=16)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def launch_options(use_pdl: bool) -> dict[str, bool]:
    return {"launch_pdl": True} if use_pdl else {}


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_grid(items: int, device: torch.device, programs_per_sm: int, cpu_programs: int = 8) -> int:
    """Programs of a persistent grid over `items` work items: at most `programs_per_sm` per SM on
    CUDA, `cpu_programs` under the interpreter (which runs programs one after another anyway)."""
    if device.type != "cuda":
        return max(1, min(items, cpu_programs))
    return max(1, min(items, num_sms(device.index or 0) * programs_per_sm))
