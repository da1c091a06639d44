"""Hand-made fp8 checkpoints of transformers models, for the tests and scripts/models_coverage.py.

Not part of safemoe's API. transformers' fp8 quantizer (`FineGrainedFP8Config`) refuses to run
without a GPU, so on CPU the fp8 experts of a checkpoint are made here the way DeepSeek-V3's are:
e4m3 weights and float32 `scale_inv` (dequantised = fp8 * scale_inv) per 128x128 block, partial
edge blocks included, or one scale per expert and projection (`block_size=None`). The module that
holds them is transformers' own `FP8Experts`, made as its quantizer's module swap makes it
(`fp8_experts_like`); the reference a test compares with is the model with these weights
dequantised, run stock.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from safemoe.numerics import FP8_BLOCK, FP8_DTYPE


def quantize_blocks(w: torch.Tensor, bn: int = FP8_BLOCK,
                    bk: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (e4m3 [..., N, K], float32 scale_inv [..., ceil(N/bn), ceil(K/bk)]) as
    DeepSeek-V3's checkpoints are made: per block, scale_inv = amax / 448, partial edge blocks."""
    *lead, n, k = w.shape
    rb, cb = -(-n // bn), -(-k // bk)
    padded = w.new_zeros(*lead, rb * bn, cb * bk, dtype=torch.float32)
    padded[..., :n, :k] = w.float()
    tiles = padded.view(*lead, rb, bn, cb, bk)
    scale = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / torch.finfo(FP8_DTYPE).max
    q = (tiles / scale[..., :, None, :, None]).to(FP8_DTYPE).view(*lead, rb * bn, cb * bk)
    return q[..., :n, :k].contiguous(), scale


def row_blocks_scale(scale: torch.Tensor, pieces: list[int], n: int) -> torch.Tensor:
    """scale [..., len(pieces), C] -> [..., n, C]: scale row i repeated pieces[i] times."""
    parts = [scale[..., i : i + 1, :].expand(*scale.shape[:-2], size, scale.shape[-1])
             for i, size in enumerate(pieces)]
    out = torch.cat(parts, dim=-2)
    assert out.shape[-2] == n, (out.shape, n)
    return out


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor,
                      row_blocks: list[int] | None = None) -> torch.Tensor:
    """fp8 [..., N, K] * its scale_inv, in float32; row_blocks: the rows each scale row covers
    when the rows were quantised in separate matrices (gate and up apart, or one scale per
    matrix), else row // 128."""
    n, k = q.shape[-2:]
    if row_blocks is None:
        rows = scale.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :]
    else:
        rows = row_blocks_scale(scale, row_blocks, n)
    columns = FP8_BLOCK if scale.shape[-1] > 1 or k <= FP8_BLOCK else k  # one column block: per tensor
    return q.float() * rows.repeat_interleave(columns, dim=-1)[..., :k]


def fill_fp8_experts(module: nn.Module, w13: torch.Tensor, w2: torch.Tensor, *, split: bool = False,
                     ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I] into an `FP8Experts`
    module (its Parameters replaced) and return the dequantised (w13, w2), float32.

    The module's `block_size` says how: None, one scale per expert and projection ([E, 2, 1] for
    gate and up, [E, 1, 1] for down); else 128x128 blocks, gate_up as one [2I, H] matrix
    (ceil(2I/128) scale rows, the shape transformers' quantizer makes) or, split, gate and up
    quantised apart as DeepSeek-style checkpoints ship them (2 * ceil(I/128) rows). ue8m0:
    power-of-two scales stored as float8_e8m0fnu. The scale shapes are checked against the ones
    transformers allocated for the module."""
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    pieces: list[int] | None
    if module.block_size is None:
        (qg, sg), (qu, su) = (quantize_blocks(w, inter, hidden) for w in (w13[:, :inter], w13[:, inter:]))
        q13, s13, pieces = torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1), [inter, inter]
        (q2, s2), pieces2 = quantize_blocks(w2, hidden, inter), [hidden]
    else:
        if split:
            (qg, sg), (qu, su) = quantize_blocks(w13[:, :inter]), quantize_blocks(w13[:, inter:])
            q13, s13 = torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1)
            pieces = [min(FP8_BLOCK, inter - i) for i in range(0, inter, FP8_BLOCK)] * 2
        else:
            (q13, s13), pieces = quantize_blocks(w13), None
        (q2, s2), pieces2 = quantize_blocks(w2), None
    if ue8m0:
        s13, s2 = (torch.exp2(torch.ceil(torch.log2(s))) for s in (s13, s2))
    for name, scale in (("gate_up_proj_scale_inv", s13), ("down_proj_scale_inv", s2)):
        allocated = tuple(getattr(module, name).shape)
        if tuple(scale.shape) != allocated:
            raise ValueError(f"{name}: quantised scales {tuple(scale.shape)}, FP8Experts holds {allocated} "
                             f"(block_size={module.block_size}, split={split})")
    stored = [s.to(torch.float8_e8m0fnu) if ue8m0 else s for s in (s13, s2)]
    for attr, value in (("gate_up_proj", q13), ("down_proj", q2), ("gate_up_proj_scale_inv", stored[0]),
                        ("down_proj_scale_inv", stored[1])):
        setattr(module, attr, nn.Parameter(value, requires_grad=False))
    return dequantize_blocks(q13, s13, pieces), dequantize_blocks(q2, s2, pieces2)


def fp8_experts_like(experts: nn.Module, config: Any, block_size: tuple[int, int] | None = None) -> nn.Module:
    """An empty `FP8Experts` (dynamic activation scales, float32 scale_inv) for an experts module,
    made as transformers' quantizer makes it (`replace_with_fp8_linear`, modules named
    `*.experts`): its class wrapped by `use_experts_implementation` over the FP8 experts interface,
    the source's has_gate/has_bias, the experts' config. Raises what transformers raises (biases)."""
    from transformers.integrations import finegrained_fp8 as fp8
    from transformers.integrations.moe import use_experts_implementation

    has_gate = getattr(experts, "has_gate", True)
    has_bias = getattr(experts, "has_bias", False)
    cls = use_experts_implementation(experts_class=fp8.FP8Experts,
                                     experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS, has_bias=has_bias,
                                     has_gate=has_gate)
    module: nn.Module = cls(config=getattr(experts, "config", config), block_size=block_size,
                            has_bias=has_bias, has_gate=has_gate)
    return module


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error |got - want| / |want|, in float32."""
    return float((got.float() - want.float()).norm() / want.float().norm())
