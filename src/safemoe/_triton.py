"""Where Triton kernels run: compiled on CUDA, interpreted on CPU.

The Triton interpreter is chosen when `@triton.jit` decorates a function, and triton's own
standard library (`tl.sum`, `tl.max`, ...) is decorated when `triton` is first imported. So
`TRITON_INTERPRET=1` has to be in the environment before anything imports triton. On a machine
with no CUDA device, `import safemoe` sets it (unless the user already chose), because compiled
Triton cannot run there anyway; the kernels then run on CPU tensors, slowly, for tests.
"""

from __future__ import annotations

import os
import sys

import torch


def configure_interpreter() -> None:
    """Turn on the Triton interpreter on CUDA-less machines, before triton is imported."""
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def require_triton(device: torch.device, what: str) -> None:
    """Raise a clear error when the Triton backend cannot run on `device`."""
    if not triton_importable():
        raise RuntimeError(f"{what}: backend='triton' needs the `triton` package, which is not installed")
    if device.type == "cuda":
        if interpreter_enabled():
            raise RuntimeError(
                f"{what}: backend='triton' got CUDA tensors but TRITON_INTERPRET=1 is set; "
                "unset it to run compiled kernels"
            )
        return
    if device.type == "cpu":
        if not interpreter_enabled():
            raise RuntimeError(
                f"{what}: backend='triton' on CPU tensors runs under the Triton interpreter; set "
                "TRITON_INTERPRET=1 before importing triton (or safemoe), or use backend='reference'"
            )
        return
    raise RuntimeError(f"{what}: backend='triton' does not support device {device}")
