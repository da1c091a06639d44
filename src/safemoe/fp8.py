"""fp8 (e4m3) expert weights: quantise bf16/fp16/fp32 experts into the two layouts safemoe runs.

`safemoe.quantize_experts(w13, w2, mode)` -> `(w13_fp8, w2_fp8, w13_scale, w2_scale)`, ready for
`safemoe.experts(x, w13_fp8, w2_fp8, routing, w13_scale=..., w2_scale=...)`:

- mode="per_tensor": one fp32 scale per expert and matrix, w13_scale [E], w2_scale [E];
  activations are then quantised per token at run time.
- mode="block" (DeepSeek-V3): one fp32 scale per 128x128 block, w13_scale [E, ceil(2I/128),
  ceil(H/128)], w2_scale [E, ceil(H/128), ceil(I/128)]; activations in 1x128 groups at run time.

Scales follow the "weight_scale_inv" convention of DeepSeek-V3 / transformers checkpoints:
dequantised = fp8 * scale. Per scale: scale = max(amax, 1e-10) / 448 over the values it covers,
q = round_to_nearest_even(clamp(w / scale, -448, 448)). Weights must be finite (checked: this is
an offline step, so it may sync with the host). Experts are quantised one at a time, so the
temporary fp32 copy is one expert's, not the whole tensor's.
"""

from __future__ import annotations

import torch

from safemoe._checks import check_contiguous, check_tensor
from safemoe.reference import FP8_AMAX_FLOOR, FP8_BLOCK, FP8_DTYPE, FP8_MAX, dequantize_expert_weight

QUANT_MODES = ("per_tensor", "block")
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _quantize_matrix(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's [R, C] matrix -> (fp8 [R, C], fp32 scale: 0-dim, or [ceil(R/128), ceil(C/128)])."""
    rows, cols = w.shape
    wf = w.float()
    if mode == "per_tensor":
        scale = wf.abs().amax().clamp(min=FP8_AMAX_FLOOR) / FP8_MAX
        return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    row_blocks, col_blocks = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(row_blocks * FP8_BLOCK, col_blocks * FP8_BLOCK, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = wf
    blocks = padded.view(row_blocks, FP8_BLOCK, col_blocks, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=FP8_AMAX_FLOOR) / FP8_MAX  # [RB, CB]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(row_blocks * FP8_BLOCK, col_blocks * FP8_BLOCK)[:rows, :cols].contiguous(), scale


def _quantize_stack(name: str, w: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scales = []
    for expert in range(w.shape[0]):
        if not bool(torch.isfinite(w[expert]).all()):
            raise ValueError(
                f"{name} holds NaN or Inf values (expert {expert}); fp8 weights need finite weights"
            )
        q[expert], scale = _quantize_matrix(w[expert], mode)
        scales.append(scale)
    return q, torch.stack(scales).contiguous()


def quantize_experts(
    w13: torch.Tensor, w2: torch.Tensor, mode: str = "per_tensor"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise expert weights to fp8 e4m3: returns (w13_fp8 [E, 2I, H], w2_fp8 [E, H, I],
    w13_scale, w2_scale), scales float32 as described in the module docstring.

    w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I], bf16/fp16/fp32, finite.
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"mode must be one of {QUANT_MODES}, got {mode!r}")
    w13 = check_tensor("w13", w13, dims=3, dtypes=_WEIGHT_DTYPES)
    w2 = check_tensor("w2", w2, dims=3, dtypes=_WEIGHT_DTYPES)
    num_experts, two_inter, hidden = w13.shape
    if two_inter % 2 or two_inter == 0 or tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(
            f"w13 must be [E, 2I, H] and w2 [E, H, I] of the same experts, got {tuple(w13.shape)} and "
            f"{tuple(w2.shape)}"
        )
    check_contiguous("w13", w13)
    check_contiguous("w2", w2)
    w13_q, w13_scale = _quantize_stack("w13", w13, mode)
    w2_q, w2_scale = _quantize_stack("w2", w2, mode)
    return w13_q, w2_q, w13_scale, w2_scale


def dequantize_experts(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantised (fp8 * scale) expert weights in `dtype`, one expert at a time; the scale
    layouts `safemoe.experts` accepts (see `safemoe._checks.check_fp8_experts_args`)."""
    from safemoe._checks import check_fp8_weights

    spec = check_fp8_weights(w13, w2, w13_scale, w2_scale)
    outs = []
    for w, scale, split in ((w13, w13_scale, spec.gate_up_split), (w2, w2_scale, False)):
        outs.append(
            torch.stack(
                [
                    dequantize_expert_weight(w[e], scale[e], gate_up_split=split).to(dtype)
                    for e in range(w.shape[0])
                ]
            )
        )
    return outs[0], outs[1]
