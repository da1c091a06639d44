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
from typing import Any

import torch
import torch.nn.functional as F

from safemoe._checks import NumValid
from safemoe.numerics import (
    FLT_MAX,
    FP8_AMAX_FLOOR,
    FP8_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    SENTINEL,
    SWIGLUOAI_ALPHA,
    SWIGLUOAI_LIMIT,
)
from safemoe.route_config import RouteConfig


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
    top_k: int | RouteConfig,
    *,
    bias: torch.Tensor | None = None,
    num_valid: NumValid | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights float32 [T, K], ids int32 [T, K]); arguments already validated. The
    routing config comes whole or as top_k plus its options (see `RouteConfig.of`)."""
    config = RouteConfig.of(top_k, options)
    top_k, scoring, n_group, topk_group = config.top_k, config.scoring, config.n_group, config.topk_group
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
    #    (its one score if groups have a single expert), or its best one (group_score="max");
    #    keep the best topk_group groups, mask the others with -inf (never 0: a 0 can outrank real
    #    negative scores).
    eligible = torch.ones_like(select, dtype=torch.bool)
    if n_group is not None and topk_group is not None:
        group_size = num_experts // n_group
        grouped = select.view(num_tokens, n_group, group_size)
        best = 1 if config.group_score == "max" else 2
        best_two = torch.sort(grouped, dim=-1, descending=True).values[..., : min(best, group_size)]
        group_score = best_two.sum(dim=-1)  # [T, n_group], finite or +-inf, never NaN
        kept_groups = topk_lowest_index(group_score, topk_group)  # [T, topk_group]
        group_mask = torch.zeros(num_tokens, n_group, dtype=torch.bool, device=device)
        group_mask.scatter_(1, kept_groups, True)
        eligible = group_mask[:, :, None].expand(-1, -1, group_size).reshape(num_tokens, num_experts)

    # 4. Total-order top-k: K distinct ids, ties to the lowest index.
    ids = topk_lowest_index(select, top_k, eligible)  # [T, K] int64
    weights = torch.gather(scores, 1, ids)  # unbiased scores

    # 5. Renormalise in fp32; a zero sum stays zero, so weights are never NaN.
    if config.renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = torch.where(total > 0, weights / torch.where(total > 0, total, 1.0), 0.0)
    weights = weights * config.routed_scaling_factor

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
    top_k: int | RouteConfig,
    *,
    activation: str = "silu",
    num_valid: NumValid | None = None,
    bias: torch.Tensor | None = None,
    **options: Any,
) -> torch.Tensor:
    weights, ids = route_reference(router_logits, top_k, bias=bias, num_valid=num_valid, **options)
    return experts_reference(x, w13, w2, weights, ids, activation=activation, num_valid=num_valid)


# ----------------------------------------------------------------------------------------------
# fp8 (e4m3) expert weights: the quantisation rules and the dequantised fp32 reference
# ----------------------------------------------------------------------------------------------



def quantize_groups_reference(t: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantisation of each row of t [R, C] in groups of `group` columns
    (group >= C: one group per row, i.e. per token). Returns (q float8_e4m3fn [R, C], scale
    float32 [R, ceil(C / group)]); dequantised = q * scale.

    Per group, in fp32: scale = max(amax, FP8_AMAX_FLOOR) / 448 with amax the largest |value|;
    q = round_to_nearest_even(clamp(value * (448 / max(amax, FP8_AMAX_FLOOR)), -448, 448)): one
    IEEE division a group, then a multiply per value (DeepGEMM's and SGLang's activation casts
    scale by the reciprocal the same way; a division per value made the kernel issue-bound). A group holding
    any NaN or +-Inf gets scale NaN and q = 0: it dequantises to all NaN, so a non-finite input
    poisons exactly its own group (hence its own row's outputs) and nothing else. Each group's
    scale depends only on that group's values.
    """
    rows, cols = t.shape
    group = min(group, cols)
    num_groups = -(-cols // group)
    padded = torch.zeros(rows, num_groups * group, dtype=torch.float32, device=t.device)
    padded[:, :cols] = t.float()
    v = padded.view(rows, num_groups, group)
    finite = torch.isfinite(v)
    bad = ~finite.all(dim=-1)  # [R, G]
    amax = torch.where(finite, v.abs(), 0.0).amax(dim=-1)
    floored = amax.clamp(min=FP8_AMAX_FLOOR)
    scale = floored / FP8_MAX
    # a tensor divided by a tensor: `FP8_MAX / t` runs as t.reciprocal() * FP8_MAX, which is not
    # the correctly rounded quotient (448 / 192 comes out one ulp high)
    multiplier = torch.full_like(floored, FP8_MAX) / floored
    q = (torch.where(finite, v, 0.0) * multiplier[..., None]).clamp(-FP8_MAX, FP8_MAX)
    q = torch.where(bad[..., None], 0.0, q).to(FP8_DTYPE)
    scale = torch.where(bad, math.nan, scale)
    return q.view(rows, -1)[:, :cols].contiguous(), scale.contiguous()


def dequantize_groups_reference(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 q * scale, scale column g covering columns [g * group, (g + 1) * group)."""
    cols = q.shape[1]
    group = min(group, cols)
    return q.float() * scale.repeat_interleave(group, dim=1)[:, :cols]


def _block_rows(rows: int, first_up_row: int | None, up_block_offset: int) -> torch.Tensor:
    """Scale-row index of each weight row: row // 128; with a gate/up split (w13 whose halves were
    quantised separately) the up rows restart at block `up_block_offset`."""
    index = torch.arange(rows) // FP8_BLOCK
    if first_up_row is not None:
        up = torch.arange(first_up_row, rows)
        index[first_up_row:] = up_block_offset + (up - first_up_row) // FP8_BLOCK
    return index


def dequantize_expert_weight(
    w: torch.Tensor, scale: torch.Tensor, *, gate_up_split: bool = False
) -> torch.Tensor:
    """fp32 weights of one expert from fp8 w [R, C] and its scale: a 0-dim/[1] per-tensor scale,
    [2] (gate rows [0, R/2), up rows [R/2, R)), or a [ceil(R/128), ceil(C/128)] block grid
    ("weight_scale_inv": dequantised = fp8 * scale). gate_up_split: block rows of the up half
    start at block ceil((R/2)/128) (gate and up quantised as separate matrices)."""
    rows, cols = w.shape
    wf = w.float()
    if scale.dim() <= 1:
        per_row = scale.float().reshape(-1)
        if per_row.numel() == 1:
            return wf * per_row
        half = rows // 2
        return torch.cat([wf[:half] * per_row[0], wf[half:] * per_row[1]])
    first_up = rows // 2 if gate_up_split else None
    row_index = _block_rows(rows, first_up, -(-(rows // 2) // FP8_BLOCK)).to(scale.device)
    col_index = (torch.arange(cols) // FP8_BLOCK).to(scale.device)
    return wf * scale.float()[row_index][:, col_index]


def experts_fp8_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    activation: str = "silu",
    num_valid: NumValid | None = None,
) -> torch.Tensor:
    """experts_reference with fp8 e4m3 weights and dynamically quantised activations, in fp32.

    Modes (from the scale shapes, already validated):
    - per-tensor: w13_scale [E] (or [E, 2]: gate, up), w2_scale [E]; x quantised per token
      (one group = the whole row of H), the intermediate per row (one group = I).
    - block (DeepSeek-V3): w13_scale [E, ceil(2I/128), ceil(H/128)] (or [E, 2*ceil(I/128), ...]
      when gate and up were quantised as separate matrices), w2_scale [E, ceil(H/128),
      ceil(I/128)]; x and the intermediate quantised in 1x128 groups.
    Steps per served slot: x row -> quantize_groups_reference -> dequantised fp32 @ dequantised
    w13[e]^T -> activation -> rounded to x's dtype (the kernels store it so) -> quantised again ->
    dequantised fp32 @ dequantised w2[e]^T -> x routing weight -> summed per token in fp32 ->
    rounded to x's dtype once. Padded rows are exact zeros and never read; a non-finite value in a
    valid row's x makes that row's output NaN (its group scale is NaN) and touches no other row.
    """
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    block = w13_scale.dim() == 3
    x_group = FP8_BLOCK if block else hidden
    inter_group = FP8_BLOCK if block else inter
    gate_up_split = block and w13_scale.shape[1] != -(-two_inter // FP8_BLOCK)
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    served = valid_slot_mask(ids, num_experts, num_valid)
    rows, ks = torch.nonzero(served, as_tuple=True)
    experts_of_slots = ids[rows, ks].to(torch.int64)
    for expert in torch.unique(experts_of_slots).tolist():
        pick = experts_of_slots == expert
        token_rows, slot_ks = rows[pick], ks[pick]
        w13_e = dequantize_expert_weight(w13[expert], w13_scale[expert], gate_up_split=gate_up_split)
        w2_e = dequantize_expert_weight(w2[expert], w2_scale[expert])
        xq, xs = quantize_groups_reference(x[token_rows], x_group)
        h = dequantize_groups_reference(xq, xs, x_group) @ w13_e.t()  # [n, 2I]
        act = activation_reference(h[:, :inter], h[:, inter:], activation).to(x.dtype)
        aq, a_scale = quantize_groups_reference(act, inter_group)
        y = dequantize_groups_reference(aq, a_scale, inter_group) @ w2_e.t()  # [n, H]
        out.index_add_(0, token_rows, y * weights[token_rows, slot_ks].float()[:, None])
    return out.to(x.dtype)
