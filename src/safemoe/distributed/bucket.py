"""Data-parallel padding: every rank pads its batch to one common bucket.

With data-parallel attention in front of an expert-parallel MoE, every rank runs the same captured
graph (the same bucket), so every rank pads its own batch to the bucket of the LARGEST batch of
any rank. That is exactly when padding rows are most common (a rank with 3 tokens runs a 256-row
bucket because another rank has 200), so the padding rows must never matter: `num_valid` stays
each rank's own real count, the EP layer never sends a padding row, and a rank with zero real
tokens still takes part in every collective.

- `common_bucket`: the max over ranks of `num_valid`, rounded up to a bucket, as a device scalar:
  one all_reduce(MAX), no host read (captures in a CUDA graph).
- `pad_to_common_bucket`: the eager helper a runtime calls before choosing the graph: reads the
  bucket on the host (one sync: the shapes depend on it) and returns the padded batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from safemoe import _checks

_BUCKET_TABLES: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}


def _bucket_table(buckets: Sequence[int], device: torch.device) -> torch.Tensor:
    """The sorted bucket sizes as an int64 device tensor, made once per (device, buckets) so a
    call inside a CUDA-graph capture finds it on the device already (no host-to-device copy)."""
    values = tuple(sorted(set(buckets)))
    if not values or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values):
        raise ValueError(f"buckets must be positive ints, got {list(buckets)!r}")
    key = (str(device), values)
    table = _BUCKET_TABLES.get(key)
    if table is None:
        table = torch.tensor(values, dtype=torch.int64, device=device)
        _BUCKET_TABLES[key] = table
    return table


def common_bucket(
    num_valid: int | torch.Tensor,
    group: Any = None,
    *,
    buckets: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """0-dim int64 tensor on the device: max over the ranks of `group` of `num_valid`, rounded up
    to the smallest of `buckets` at or above it (kept as is above the largest bucket, or when
    `buckets` is None).

    num_valid: this rank's real row count, a 0-dim integer device tensor (negative counts as 0)
        or an int (then `device` says where; building the tensor is a host-to-device copy, so
        pass a tensor inside a CUDA-graph capture). Every rank of the group must call this.
    """
    if isinstance(num_valid, torch.Tensor):
        if num_valid.dim() != 0 or num_valid.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                "num_valid must be a 0-dim int32/int64 tensor, "
                f"got {num_valid.dtype} {tuple(num_valid.shape)}"
            )
        value = num_valid.to(torch.int64, copy=True).clamp(min=0).reshape(1)
    elif isinstance(num_valid, int) and not isinstance(num_valid, bool):
        if device is None:
            raise ValueError("common_bucket with an int num_valid needs device= (where the collective runs)")
        value = torch.tensor([max(0, num_valid)], dtype=torch.int64, device=device)
    else:
        raise TypeError(f"num_valid must be an int or a 0-dim integer tensor, got {type(num_valid).__name__}")
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    if buckets is not None:
        table = _bucket_table(buckets, value.device)
        index = torch.searchsorted(table, value).clamp(max=table.numel() - 1)
        value = torch.maximum(table[index], value)
    return value.reshape(())


def pad_to_common_bucket(
    x: torch.Tensor,
    num_valid: int | torch.Tensor | None = None,
    group: Any = None,
    *,
    buckets: Sequence[int] | None = None,
    fill: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x padded to the common bucket B [B, ...], num_valid as a 0-dim int32 device tensor).

    Rows [0, min(T, B)) are x's (its own padding rows included, as they are), rows past T hold
    `fill` (NaN in tests: they must never matter). B >= every rank's num_valid, so rows of x past B
    are padding and are dropped. Reads B on the host: ONE sync per call, as choosing a graph does
    anyway; inside a graph use `common_bucket`. Every rank of the group must call this.
    """
    num_tokens = x.shape[0]
    nv = _checks.check_num_valid(num_valid, num_tokens, x.device)
    if nv.tensor is not None:
        local = nv.tensor.to(torch.int32, copy=True).clamp(0, num_tokens)
    else:
        local = torch.tensor(nv.count, dtype=torch.int32, device=x.device)
    bucket = int(common_bucket(local, group, buckets=buckets).item())  # the one host read
    out = x.new_empty((bucket, *x.shape[1:]))
    keep = min(num_tokens, bucket)
    out[:keep] = x[:keep]
    out[keep:] = fill
    return out, local
