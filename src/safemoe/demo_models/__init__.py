"""The demo's models: Qwen3-MoE configs shipped as JSON next to this file, and how to build and
step them. `safemoe demo` and the bench's `runtime` suite use the same models from here.

- `tiny` (`qwen3_moe_tiny.json`): a small Qwen3-MoE with the layer structure of Qwen3-30B-A3B,
  for CPU runs;
- `gpu` (`qwen3_moe_gpu.json`): Qwen3-30B-A3B dimensions, only a few layers.

Weights are random (`build_model`); transformers is needed (`pip install 'safemoe[hf]'`).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

CONFIGS = {"tiny": "qwen3_moe_tiny.json", "gpu": "qwen3_moe_gpu.json"}


def load_config(name_or_path: str, num_layers: int | None = None) -> Any:
    """A transformers Qwen3MoeConfig from a shipped config name ("tiny", "gpu") or a JSON path."""
    from transformers import Qwen3MoeConfig

    if name_or_path in CONFIGS:
        text = resources.files(__name__).joinpath(CONFIGS[name_or_path]).read_text()
    else:
        text = Path(name_or_path).read_text()
    values = {k: v for k, v in json.loads(text).items() if not k.startswith("_") and k != "model_type"}
    if num_layers is not None:
        values["num_hidden_layers"] = num_layers
    return Qwen3MoeConfig(**values)


def build_model(config: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """A random-initialised Qwen3MoeForCausalLM, created directly on `device` in `dtype`."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model: Any = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype).eval()


def decode_logits(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """One decode step for B one-token sequences: input_ids [B] -> fp32 logits [B, V].

    Runs the decoder layers directly (no KV cache, no mask construction: nothing that could
    synchronise with the host inside a captured graph)."""
    inner = model.model
    hidden = inner.embed_tokens(input_ids[:, None])  # [B, 1, H]
    positions = position_ids[:, None]  # [B, 1]
    position_embeddings = inner.rotary_emb(hidden, positions)
    for layer in inner.layers:
        hidden = layer(
            hidden, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings
        )
    hidden = inner.norm(hidden)
    return model.lm_head(hidden[:, 0]).float()
