"""The executable specification of safemoe, in plain PyTorch.

Every kernel is tested against these functions, and `backend="reference"` runs them. They are
written to be read: each step of the contract (docs/contract.md) is one commented line. They run on
any device; a device `num_valid` is honoured without a host sync in `route_reference`, while
`dispatch_reference` and `experts_reference` use data-dependent indexing (host syncs) and so are
not CUDA-graph safe.

Shapes: T tokens, E experts, K experts per token, H hidden, I intermediate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from safemoe._checks import NumValid

FLT_MAX = torch.finfo(torch.float32).max
SENTINEL = -1

# gpt-oss's clamped SwiGLU: alpha and limit as in its released model code.
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """fp32 copy with nan -> -FLT_MAX, +inf -> FLT_MAX, -inf -> -FLT_MAX."""
    x = logits.float()
    x = torch.where(torch.isnan(x), torch.full_like(x, -FLT_MAX), x)
    return x.clamp(-FLT_MAX, FLT_MAX)


def topk_lowest_index(values: torch.Tensor, k: int, eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the k largest values per row; ties go to the lowest index; only `eligible` columns.

    `values` must be NaN-free. A stable descending sort is a total order with exactly that tie rule
    (torch.topk promises no tie order).
    """
    keyed = values if eligible is None else values.masked_fill(~eligible, -math.inf)
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices
    if eligible is not None:
        # Ineligible columns all hold -inf and an eligible -inf would tie with them; move every
        # ineligible column behind every eligible one so it can never be picked first.
        rank = torch.gather((~eligible).to(torch.int8), -1, order)
        order = torch.gather(order, -1, torch.sort(rank, dim=-1, stable=True).indices)
    return order[..., :k]


def route_reference(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    num_valid: NumValid | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights float32 [T, K], ids int32 [T, K]); arguments already validated."""
    num_tokens, num_experts = logits.shape
    device = logits.device
    valid = (num_valid or NumValid(num_tokens, None)).row_mask(num_tokens, device)  # [T] bool

    # 1. Sanitise, then score in fp32. Padded rows are replaced by zeros first, so whatever they
    #    hold can influence nothing (rows are independent anyway; this makes it evident).
    x = torch.where(valid[:, None], sanitize_logits(logits), torch.zeros((), device=device))
    scores = torch.softmax(x, dim=-1) if scoring == "softmax" else torch.sigmoid(x)  # [T, E]

    # 2. Selection scores: the bias (also sanitised) steers selection only.
    select = scores if bias is None else scores + sanitize_logits(bias)[None, :]
    select = select.clamp(-FLT_MAX, FLT_MAX)  # FLT_MAX + 1 is still finite; keep it so

    # 3. Group-limited selection: a group's score is the sum of its two best selection scores
    #    (its one score if groups have a single expert); keep the best topk_group groups, mask the
    #    others with -inf (never 0: a 0 can outrank real negative scores).
    eligible = torch.ones_like(select, dtype=torch.bool)
    if n_group is not None and topk_group is not None:
        group_size = num_experts // n_group
        grouped = select.view(num_tokens, n_group, group_size)
        best_two = torch.sort(grouped, dim=-1, descending=True).values[..., : min(2, group_size)]
        group_score = best_two.sum(dim=-1)  # [T, n_group], finite or +-inf, never NaN
        kept_groups = topk_lowest_index(group_score, topk_group)  # [T, topk_group]
        group_mask = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=device)
        group_mask.scatter_(1, kept_groups, True)
        eligible = group_mask[:, :, None].expand(-1, -1, group_size).reshape(num_tokens, num_experts)

    # 4. Total-order top-k: K distinct ids, ties to the lowest index.
    ids = topk_lowest_index(select, top_k, eligible)  # [T, K] int64
    weights = torch.gather(scores, 1, ids)  # unbiased scores

    # 5. Renormalise in fp32; a zero sum stays zero, so weights are never NaN.
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = torch.where(total > 0, weights / torch.where(total > 0, total, 1.0), 0.0)
    weights = weights * routed_scaling_factor

    # 6. Padded rows: ids -1, weights 0.
    ids = torch.where(valid[:, None], ids, SENTINEL).to(torch.int32)
    weights = torch.where(valid[:, None], weights, 0.0).to(torch.float32)
    return weights.contiguous(), ids.contiguous()


def valid_slot_mask(ids: torch.Tensor, num_experts: int, num_valid: NumValid | None = None) -> torch.Tensor:
    """[T, K] bool: the (token, k) slots that are served. A slot is served when its row is below
    num_valid and its id is in [0, E); everything else (-1, negative, >= E, stale garbage) is
    dropped and never used as an address. Duplicate ids in a row are each served."""
    num_tokens = ids.shape[0]
    rows = (num_valid or NumValid(num_tokens, None)).row_mask(num_tokens, ids.device)
    return rows[:, None] & (ids >= 0) & (ids < num_experts)


@dataclass
class DispatchLayout:
    """Expert-sorted layout of the served (token, k) slots: the spec the dispatch kernel follows.

    Slots are numbered s = t * K + k. Within each expert, slots appear in increasing s (a kernel
    may order them differently inside an expert; tests compare per-expert sets).
    """

    counts: torch.Tensor  # [E] int32: counts[e] is the number of served slots with id e
    offsets: torch.Tensor  # [E + 1] int64: exclusive prefix sum of counts
    sorted_slots: torch.Tensor  # [sum(counts)] int64: slot ids grouped by expert
    dropped: int  # slots of valid rows whose id was out of range


def dispatch_reference(
    ids: torch.Tensor, num_experts: int, num_valid: NumValid | None = None
) -> DispatchLayout:
    num_tokens, top_k = ids.shape
    served = valid_slot_mask(ids, num_experts, num_valid).reshape(-1)
    rows_valid = (num_valid or NumValid(num_tokens, None)).row_mask(num_tokens, ids.device)
    flat_ids = ids.reshape(-1).to(torch.int64)
    slots = torch.arange(num_tokens * top_k, device=ids.device)[served]
    experts_of_slots = flat_ids[served]
    order = torch.sort(experts_of_slots, stable=True).indices
    counts = torch.bincount(experts_of_slots, minlength=num_experts).to(torch.int32)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = torch.cumsum(counts.to(torch.int64), 0)
    dropped = int(rows_valid.sum().item()) * top_k - int(served.sum().item())
    return DispatchLayout(counts=counts, offsets=offsets, sorted_slots=slots[order], dropped=dropped)


def activation_reference(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated activation on fp32 inputs."""
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swigluoai":
        # gpt-oss: gate clamped above at 7, up clamped to +-7, gate * sigmoid(1.702 gate) * (up + 1).
        gate = gate.clamp(max=SWIGLUOAI_LIMIT)
        up = up.clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
        return gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate) * (up + 1)
    raise ValueError(f"activation must be one of silu, gelu, swigluoai, got {activation!r}")


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    activation: str = "silu",
    num_valid: NumValid | None = None,
) -> torch.Tensor:
    """out[t] = sum over served k of weights[t,k] * w2[e] @ act(w13[e] @ x[t]), e = ids[t,k].

    Products accumulate in fp32; the I-wide intermediate is rounded to x's dtype (kernels store it
    that way); the output is rounded once at the end. Rows >= num_valid are exact zeros; only served
    slots are read, so padded rows of x, ids and weights may hold anything (NaN, garbage).
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    served = valid_slot_mask(ids, num_experts, num_valid)
    rows, ks = torch.nonzero(served, as_tuple=True)
    experts_of_slots = ids[rows, ks].to(torch.int64)
    for expert in torch.unique(experts_of_slots).tolist():
        pick = experts_of_slots == expert
        token_rows, slot_ks = rows[pick], ks[pick]
        h = x[token_rows].float() @ w13[expert].float().t()  # [n, 2I]
        act = activation_reference(h[:, :inter], h[:, inter:], activation).to(x.dtype).float()
        y = act @ w2[expert].float().t()  # [n, H]
        out.index_add_(0, token_rows, y * weights[token_rows, slot_ks].float()[:, None])
    return out.to(x.dtype)


def moe_reference(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    *,
    activation: str = "silu",
    num_valid: NumValid | None = None,
    **route_kwargs: object,
) -> torch.Tensor:
    weights, ids = route_reference(router_logits, top_k, num_valid=num_valid, **route_kwargs)  # type: ignore[arg-type]
    return experts_reference(x, w13, w2, weights, ids, activation=activation, num_valid=num_valid)
