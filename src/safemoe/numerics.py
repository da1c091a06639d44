"""Numeric constants of the contract, in one place: the spec (`reference.py`), the argument checks
and the kernels import them from here (kernels wrap them in `tl.constexpr`)."""

from __future__ import annotations

import torch

# Largest finite float32: NaN logits become -FLT_MAX, +-Inf become +-FLT_MAX (sanitised in registers).
FLT_MAX = float(torch.finfo(torch.float32).max)
# The id of an unused slot: padded rows' ids, padding positions of the expert-sorted layout.
SENTINEL = -1

# gpt-oss's clamped SwiGLU: alpha and limit as in its released model code.
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0

# fp8 (e4m3) expert weights and activations.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_BLOCK = 128  # DeepSeek-V3 block: 128x128 weight blocks, 1x128 activation groups
# A group whose largest |value| is below this is scaled as if it were this (an all-zero group
# would otherwise divide by a zero scale); the floor vLLM's per-token-group quantiser uses.
FP8_AMAX_FLOOR = 1e-10
