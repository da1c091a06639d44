"""Peer implementations: what `safemoe bench` measures safemoe against (side by side in the same
run) and what `safemoe check` holds to the same contract (its `torch`, `vllm`, `sglang` and
`flashinfer` backends).

- torch, the way Hugging Face models route and run experts: `torch_route` (softmax/sigmoid + topk
  + renormalise; DeepSeek-V3's grouped selection with its correction bias), `compiled_torch_route`
  (the same under torch.compile), `hf_experts_loop` (the per-expert eager loop of HF's MoE
  blocks), `grouped_mm_experts` (sort slots by expert, then torch's grouped GEMM, as transformers'
  "grouped_mm" experts implementation does).
- vLLM, SGLang and FlashInfer ops when those libraries are importable; otherwise the adapter raises
  `PeerUnavailable` saying so (recorded as unavailable, never as passed).

The torch peers are our own code following the published algorithms; they keep the peers' own
behaviour (no NaN sanitising unless `nan_to_num=True`, torch.topk tie order, int64 ids as
torch.topk returns them) because that behaviour is what is being compared.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from safemoe.reference import activation_reference
from safemoe.route_config import RouteConfig


class PeerUnavailable(RuntimeError):
    """The peer's library is not installed here, or its API is not one this adapter knows."""


def _import_or_unavailable(module: str, peer: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise PeerUnavailable(f"{peer}: not installed ({module} cannot be imported: {exc})") from exc


def _call_peer(peer: str, what: str, call: Callable[[], Any]) -> Any:
    """Run a library op; an API this adapter does not know (renamed, new signature) is unavailable."""
    try:
        return call()
    except (AttributeError, TypeError) as exc:
        raise PeerUnavailable(f"{peer}: {what} API not recognised ({type(exc).__name__}: {exc})") from exc


# ----------------------------------------------------------------------------------------------
# Routing peers
# ----------------------------------------------------------------------------------------------


def torch_route(
    logits: torch.Tensor,
    config: RouteConfig | int,
    *,
    bias: torch.Tensor | None = None,
    nan_to_num: bool = False,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager torch routing as HF models do it. Returns (weights [T, K] float32, ids [T, K] int64).

    config: the routing whole (a `RouteConfig`), or top_k with its options as keywords, as
    `safemoe.route` takes it. bias: [E] selection bias. There is no num_valid: like an engine
    without it, the peer routes every row, padding included.

    softmax (Qwen3-MoE, Mixtral): p = softmax(fp32 logits); top-k of p; optionally divide by the
    K-sum. sigmoid (DeepSeek-V3): s = sigmoid(fp32 logits); selection scores s + bias; with groups,
    a group scores the sum of its top-2 (its max with group_score="max"), the best topk_group
    groups are kept (others -inf), top-k among them; weights are the unbiased s, divided by
    (sum + 1e-20) when renormalising. Weights are finally scaled. `nan_to_num` runs
    torch.nan_to_num on the logits first (NaN -> 0, +-Inf -> the dtype's finite extremes), the
    common patch against NaN rows.
    """
    return _torch_route(logits, RouteConfig.of(config, options), bias, nan_to_num)


def _torch_route(
    logits: torch.Tensor, config: RouteConfig, bias: torch.Tensor | None, nan_to_num: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    top_k = config.top_k
    if nan_to_num:
        logits = torch.nan_to_num(logits)
    if config.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    else:  # sigmoid (RouteConfig admits no other)
        scores = logits.float().sigmoid()  # [T, E]
    select = scores if bias is None else scores + bias.float()
    num_tokens, num_experts = logits.shape
    if config.grouped:
        n_group, topk_group = config.n_group, config.topk_group
        assert n_group is not None and topk_group is not None
        group_size = num_experts // n_group
        grouped = select.view(num_tokens, n_group, group_size)
        best = 1 if config.group_score == "max" else 2  # DeepSeek-V2 scores a group by its max
        group_scores = grouped.topk(min(best, group_size), dim=-1).values.sum(dim=-1)  # [T, n_group]
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = (
            group_mask.unsqueeze(-1).expand(-1, n_group, group_size).reshape(num_tokens, num_experts)
        )
        select = select.masked_fill(expert_mask == 0, float("-inf"))
        ids = torch.topk(select, k=top_k, dim=-1, sorted=False).indices  # [T, K] int64
        weights = scores.gather(1, ids)
        if config.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        if bias is None:
            weights, ids = torch.topk(scores, top_k, dim=-1)  # [T, K] float32, int64
        else:
            ids = torch.topk(select, top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        if config.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights, ids


@functools.cache
def _compiled_route() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    # dynamic=False: one specialised graph per shape, as a serving engine's captured buckets use.
    # The config's fields are guarded on: one graph per routing config, too.
    return torch.compile(_torch_route, dynamic=False)


def compiled_torch_route(
    logits: torch.Tensor,
    config: RouteConfig | int,
    *,
    bias: torch.Tensor | None = None,
    nan_to_num: bool = False,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch_route` under torch.compile (inductor fuses the elementwise and topk glue)."""
    return _compiled_route()(logits, RouteConfig.of(config, options), bias, nan_to_num)


def _vllm_route_op(module: Any, logits: torch.Tensor, config: RouteConfig, bias: torch.Tensor | None) -> Any:
    """vLLM: `fused_topk` (its CUDA topk_softmax) for plain softmax, `grouped_topk` otherwise."""
    if config.n_group is None and bias is None and config.scoring == "softmax":
        return module.fused_topk(logits, logits, config.top_k, config.renormalize)
    return module.grouped_topk(
        logits,
        logits,
        config.top_k,
        config.renormalize,
        num_expert_group=config.n_group or 1,
        topk_group=config.topk_group or 1,
        scoring_func=config.scoring,
        routed_scaling_factor=config.routed_scaling_factor,
        e_score_correction_bias=bias,
    )


def _sglang_route_op(
    module: Any, logits: torch.Tensor, config: RouteConfig, bias: torch.Tensor | None
) -> Any:
    """SGLang: `fused_topk` for plain softmax, `biased_grouped_topk` / `grouped_topk` otherwise."""
    if config.n_group is None and bias is None and config.scoring == "softmax":
        return module.fused_topk(logits, logits, config.top_k, config.renormalize)
    groups = (config.n_group or 1, config.topk_group or 1)
    scale = {"routed_scaling_factor": config.routed_scaling_factor}
    if bias is not None:
        return module.biased_grouped_topk(
            logits, logits, bias, config.top_k, config.renormalize, *groups, **scale
        )
    return module.grouped_topk(logits, logits, config.top_k, config.renormalize, *groups, **scale)


def _library_route(
    peer: str,
    module_name: str,
    op: Callable[[Any, torch.Tensor, RouteConfig, torch.Tensor | None], Any],
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A `torch_route`-shaped adapter around a library's routing op (the library's dtypes kept)."""

    def route(
        logits: torch.Tensor,
        config: RouteConfig | int,
        *,
        bias: torch.Tensor | None = None,
        nan_to_num: bool = False,
        **options: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        config = RouteConfig.of(config, options)
        module = _import_or_unavailable(module_name, peer)
        if nan_to_num:
            logits = torch.nan_to_num(logits)
        out = _call_peer(peer, "routing", lambda: op(module, logits, config, bias))
        return out[0], out[1]

    route.__name__ = f"{peer}_route"
    route.__doc__ = f"{peer}'s routing ops ({module_name}); same arguments as `torch_route`."
    return route


vllm_route = _library_route("vllm", "vllm.model_executor.layers.fused_moe", _vllm_route_op)
sglang_route = _library_route("sglang", "sglang.srt.layers.moe.topk", _sglang_route_op)


# ----------------------------------------------------------------------------------------------
# Expert peers
# ----------------------------------------------------------------------------------------------


def hf_experts_loop(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """HF-style eager loop over the experts that got a token (host syncs: time it eagerly).

    One-hot mask [E, K, T], the hit experts found with nonzero() (a host sync), then per expert:
    gather its tokens, gate/up linear, gated activation, down linear, scale by the routing
    weight, index_add into the output. Math in x's dtype, as the HF modules run it.
    """
    num_experts = w13.shape[0]
    out = torch.zeros_like(x)  # [T, H]
    with torch.no_grad():
        mask = F.one_hot(ids.long(), num_classes=num_experts).permute(2, 1, 0)  # [E, K, T]
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in hit[:, 0].tolist():
        slot_k, token = torch.where(mask[expert])
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(activation_reference(gate, up, activation), w2[expert])  # [n, H]
        y = y * weights[token, slot_k, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def _grouped_mm_op() -> tuple[Callable[..., torch.Tensor], str] | None:
    """torch.nn.functional.grouped_mm (torch >= 2.10) or torch._grouped_mm, whichever exists."""
    op = getattr(F, "grouped_mm", None)
    if op is not None:
        return op, "torch.nn.functional.grouped_mm"
    op = getattr(torch, "_grouped_mm", None)
    if op is not None:
        return op, "torch._grouped_mm"
    return None


def grouped_mm_available() -> str | None:
    """Name of the grouped GEMM op this torch has, None when it has none."""
    found = _grouped_mm_op()
    return None if found is None else found[1]


def grouped_mm_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Experts through torch's grouped GEMM, the way transformers' grouped_mm path runs them.

    Sort the T*K slots by expert, gather x rows in that order, per-expert counts with histc on the
    device (bincount would sync for its output size) and their cumsum as group end offsets, then
    grouped_mm(x_sorted, w13^T) -> activation -> grouped_mm(., w2^T), scale by the slot weights
    and scatter-add back to tokens (fp32 accumulation). No host sync: graph-capturable when the
    grouped GEMM is. Ids must be in [0, E) (the peer has no sentinel handling).
    """
    found = _grouped_mm_op()
    if found is None:
        raise PeerUnavailable("torch grouped_mm: this torch has neither F.grouped_mm nor torch._grouped_mm")
    grouped_mm = found[0]
    num_tokens, top_k = ids.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    flat_ids = ids.reshape(-1)  # [T*K]
    sorted_ids, order = torch.sort(flat_ids)  # [T*K]
    token_of_slot = order // top_k  # [T*K] int64
    x_sorted = x[token_of_slot]  # [T*K, H]
    # histc takes int input on CUDA (deterministic mode) and only float input on CPU.
    hist_in = sorted_ids.int() if x.device.type == "cuda" else sorted_ids.float()
    counts = torch.histc(hist_in, bins=num_experts, min=0, max=num_experts - 1)  # [E]
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # [E] group end offsets
    h = grouped_mm(x_sorted, w13.transpose(-2, -1), offs=offsets)  # [T*K, 2I]
    act = activation_reference(h[:, :inter], h[:, inter:], activation).to(x.dtype)  # [T*K, I]
    y = grouped_mm(act, w2.transpose(-2, -1), offs=offsets)  # [T*K, H]
    y = y.float() * weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of_slot, y)
    return out.to(x.dtype)


def _triton_fused_experts(peer: str, module_name: str) -> Callable[..., torch.Tensor]:
    """An adapter for a vLLM-style Triton `fused_experts(x, w1, w2, topk_weights, topk_ids, ...)`,
    whose w1 = [E, 2I, H] (gate rows then up rows) and w2 = [E, H, I] are our layout."""

    def fused_experts(
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        activation: str = "silu",
    ) -> torch.Tensor:
        module = _import_or_unavailable(module_name, peer)
        ids32 = ids.to(torch.int32)
        return _call_peer(
            peer,
            "fused_experts",
            lambda: module.fused_experts(x, w13, w2, weights, ids32, activation=activation),
        )

    fused_experts.__name__ = f"{peer}_fused_experts"
    fused_experts.__doc__ = f"{peer}'s Triton fused_experts ({module_name})."
    return fused_experts


vllm_fused_experts = _triton_fused_experts("vllm", "vllm.model_executor.layers.fused_moe")
sglang_fused_experts = _triton_fused_experts("sglang", "sglang.srt.layers.moe.fused_moe_triton.fused_moe")


def flashinfer_fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """FlashInfer's CUTLASS fused MoE. Its fc1 holds up rows before gate rows, so w13's halves are
    swapped on every call here; a real integration would swap once at load (time it accordingly)."""
    module = _import_or_unavailable("flashinfer.fused_moe", "flashinfer")
    if activation != "silu":
        raise PeerUnavailable(f"flashinfer adapter: only silu is wired up, got {activation!r}")
    inter = w13.shape[1] // 2
    fc1 = torch.cat([w13[:, inter:], w13[:, :inter]], dim=1)
    ids32, weights32 = ids.to(torch.int32), weights.float()
    out = _call_peer(
        "flashinfer",
        "cutlass_fused_moe",
        lambda: module.cutlass_fused_moe(x, ids32, weights32, fc1, w2, x.dtype, quant_scales=[]),
    )
    return out[0] if isinstance(out, (list, tuple)) else out


# ----------------------------------------------------------------------------------------------
# Availability
# ----------------------------------------------------------------------------------------------

_LIBRARY_PEERS = {
    "vllm": "vllm.model_executor.layers.fused_moe",
    "sglang": "sglang.srt.layers.moe.topk",
    "flashinfer": "flashinfer.fused_moe",
}


def peer_status() -> dict[str, str]:
    """'available' or why not, for each peer library (and torch's grouped GEMM)."""
    status = {"torch grouped_mm": grouped_mm_available() or "unavailable: no grouped_mm in this torch"}
    for name, module in _LIBRARY_PEERS.items():
        try:
            _import_or_unavailable(module, name)
        except PeerUnavailable as exc:
            status[name] = str(exc)
        else:
            status[name] = "available"
    return status
