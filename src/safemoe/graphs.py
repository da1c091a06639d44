"""`CUDAGraphRunner`: replay a captured callable for any batch size up to `max_tokens`.

The shape of nano-vllm's runner: one CUDA graph per token bucket (1, 2, 4, 8, ... , max_tokens),
all captured into ONE memory pool (largest first, so smaller graphs reuse its blocks), static
input buffers of the largest size that every bucket slices, one static output buffer per output
that every bucket writes its first rows of, and one 0-dim device `num_valid` scalar that every
graph reads. A call copies the batch into the first T rows of the inputs, sets `num_valid` to T
(`fill_`, an async device write), replays the smallest bucket >= T and returns the first T rows
of the outputs.

Guarantees:
- Padding rows (T..bucket) of the static inputs are left as they are (stale data, or NaN after
  `poison_padding()`): `fn` must honour `num_valid`, as every safemoe op does.
- Outputs are views into the static buffers: valid until the next call (clone to keep them).
  For safemoe ops the padded rows of the static outputs are exact zeros.
- No host sync on the replay path; `fn` is run eagerly once per bucket (warm-up: Triton
  compilation, cuBLAS workspaces) before capture.

On a device other than CUDA, construction raises `RuntimeError`, unless `allow_eager=True`: then
the runner keeps the same buckets, static buffers and `num_valid` scalar and calls `fn` eagerly
(`runner.graphed` is False). The demo uses that on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch


def warm_up(step: Callable[[], object], device: torch.device | str | None = None) -> None:
    """step() on a side stream, joined back to the current stream and synchronised: lazy
    initialisation, cuBLAS workspaces and Triton compilation happen there, not inside the CUDA-graph
    capture that follows (the warm-up torch's CUDA-graph docs ask for). CUDA only."""
    if not callable(step):
        raise TypeError(f"warm_up: step must be callable, got {type(step).__name__}")
    if not torch.cuda.is_available():
        raise RuntimeError("warm_up: needs CUDA (it warms a step up before a CUDA-graph capture)")
    if device is not None and torch.device(device).type != "cuda":
        raise ValueError(f"warm_up: device must be a CUDA device, got {device}")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


def token_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to max_tokens (max_tokens itself included when not a power of two)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    buckets = []
    size = 1
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    buckets.append(max_tokens)
    return buckets


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in out):
        return tuple(out)
    raise TypeError(f"fn must return a Tensor or a tuple of Tensors, got {type(out).__name__}")


class CUDAGraphRunner:
    """Capture `fn(*inputs, num_valid=scalar)` for every token bucket and replay it.

    fn: callable taking the static inputs (each [bucket, ...]) and the keyword `num_valid` (a 0-dim
        int32 tensor on the device, holding the real row count); returns a Tensor or a tuple of
        Tensors, each with `bucket` rows first.
    max_tokens: the largest batch; buckets are `token_buckets(max_tokens)` unless `buckets` given.
    example_inputs: one tensor per input of fn, giving dtype, device and trailing shape (the
        first dimension is ignored).
    pool: a memory pool handle (`torch.cuda.graph_pool_handle()`) to share with other runners.
    num_valid: the device scalar to set and pass (default: a new int32 one); give your own when
        something outside `fn`'s arguments must read it (model hooks, a patched model's state).
    allow_eager: on a non-CUDA device, run fn eagerly instead of raising. force_eager: run
        eagerly even on CUDA (same bucketing and padding; for comparisons and debugging).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        max_tokens: int,
        *example_inputs: torch.Tensor,
        buckets: Sequence[int] | None = None,
        pool: Any = None,
        num_valid: torch.Tensor | None = None,
        allow_eager: bool = False,
        force_eager: bool = False,
    ) -> None:
        if not example_inputs:
            raise ValueError("CUDAGraphRunner needs at least one example input")
        for i, t in enumerate(example_inputs):
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                raise TypeError(f"example_inputs[{i}] must be a tensor with a token dimension first")
        device = example_inputs[0].device
        if any(t.device != device for t in example_inputs):
            raise ValueError("all example inputs must be on one device")
        self.graphed = device.type == "cuda" and not force_eager
        if device.type != "cuda" and not allow_eager:
            raise RuntimeError(
                f"CUDAGraphRunner needs CUDA tensors (got inputs on {device}); CUDA graphs do not exist "
                "elsewhere. Pass allow_eager=True to run fn eagerly with the same bucketing and padding."
            )
        self.fn = fn
        self.device = device
        self.buckets = sorted(set(buckets)) if buckets is not None else token_buckets(max_tokens)
        if not self.buckets or self.buckets[0] < 1 or self.buckets[-1] != max_tokens:
            raise ValueError(
                f"buckets must be positive and end at max_tokens={max_tokens}, got {self.buckets}"
            )
        self.max_tokens = max_tokens
        # Static inputs of the largest size; bucket b reads rows [0, b).
        self.static_inputs = [
            torch.zeros((max_tokens, *t.shape[1:]), dtype=t.dtype, device=device) for t in example_inputs
        ]
        if num_valid is None:
            num_valid = torch.zeros((), dtype=torch.int32, device=device)
        elif (
            num_valid.dim() != 0
            or num_valid.dtype not in (torch.int32, torch.int64)
            or num_valid.device != device
        ):
            raise ValueError(f"num_valid must be a 0-dim int32/int64 tensor on {device}, got {num_valid!r}")
        self.num_valid = num_valid
        self.static_outputs: list[torch.Tensor] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool
        self._num_outputs: int | None = None
        self._single_output = True
        if self.graphed:
            self._capture_all()

    # -- capture -------------------------------------------------------------------------------
    def _run(self, bucket: int) -> tuple[torch.Tensor, ...]:
        out = self.fn(*(t[:bucket] for t in self.static_inputs), num_valid=self.num_valid)
        self._single_output = isinstance(out, torch.Tensor)
        outs = _as_tuple(out)
        for i, o in enumerate(outs):
            if o.dim() < 1 or o.shape[0] != bucket:
                raise ValueError(
                    f"output {i} of fn must have {bucket} rows first, got shape {tuple(o.shape)}"
                )
        return outs

    def _capture_all(self) -> None:
        # Largest bucket first: its blocks go into the pool and every smaller graph reuses them.
        for bucket in reversed(self.buckets):
            self.num_valid.fill_(bucket)
            warm = self._run(bucket)  # warm-up outside capture: compiles kernels, sizes outputs
            if not self.static_outputs:
                self.static_outputs = [
                    torch.empty((self.max_tokens, *o.shape[1:]), dtype=o.dtype, device=o.device) for o in warm
                ]
            del warm
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    outs = self._run(bucket)
                    for static, o in zip(self.static_outputs, outs, strict=True):
                        static[:bucket].copy_(o)
            except Exception as error:
                del graph
                with contextlib.suppress(RuntimeError):  # drain the error a failed capture leaves
                    torch.cuda.synchronize(self.device)
                first = (str(error).strip().splitlines() or [""])[0][:200]
                raise RuntimeError(
                    f"CUDA graph capture failed for bucket {bucket}: {type(error).__name__}: {first}"
                ) from error
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

    # -- replay --------------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int:
        """The smallest bucket >= num_tokens."""
        for bucket in self.buckets:
            if bucket >= num_tokens:
                return bucket
        raise ValueError(f"batch of {num_tokens} tokens exceeds max_tokens={self.max_tokens}")

    def poison_padding(self, num_tokens: int, bucket: int | None = None, value: float = float("nan")) -> None:
        """Fill rows [num_tokens, bucket) of the floating-point static inputs with `value` (tests)."""
        end = self.max_tokens if bucket is None else bucket
        for t in self.static_inputs:
            if t.is_floating_point():
                t[num_tokens:end].fill_(value)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"expected {len(self.static_inputs)} inputs, got {len(inputs)}")
        num_tokens = inputs[0].shape[0]
        if num_tokens < 1:
            raise ValueError("a batch needs at least one token")
        bucket = self.bucket_for(num_tokens)
        for static, t in zip(self.static_inputs, inputs, strict=True):
            if t.shape[0] != num_tokens or t.shape[1:] != static.shape[1:]:
                raise ValueError(
                    f"inputs must be [{num_tokens}, {tuple(static.shape[1:])}...], got {tuple(t.shape)}"
                )
            static[:num_tokens].copy_(t)
        self.num_valid.fill_(num_tokens)
        if self.graphed:
            self.graphs[bucket].replay()
            outs = tuple(o[:num_tokens] for o in self.static_outputs)
        else:
            outs = tuple(o[:num_tokens] for o in self._run(bucket))
        return outs[0] if self._single_output else outs
