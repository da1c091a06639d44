"""Debug (GPU machine, transformers 5.17): which engine steps of tests/test_serving.py's compiled
continuous-batching run make safemoe's health count non-finite valid rows, and whether the same
steps eager do. CPU tensors; prints per step (T, real tokens, +nonfinite_rows, +padded_rows).

    PYTHONPATH=src:tests python3 scripts/debug/serving_compiled_nonfinite.py
"""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.generation.continuous_batching.model_runner import ModelRunner

from safemoe.health import Health
from safemoe.integrations.transformers import patch
from test_serving import PROMPTS, build, cb_config, generate_batch


def run(compiled: bool) -> None:
    torch._dynamo.reset()
    health = Health()
    model = patch(build("qwen3_moe"), health=health)
    compute = ModelRunner.compute_batch
    lines = []

    def traced(self, model_, batch_data):
        before = health.read()
        out = compute(self, model_, batch_data)
        after = health.read()
        ids = batch_data["input_ids"]
        io = self.inputs_and_outputs
        real = int(io.total_seqlen_q) if hasattr(io, "total_seqlen_q") else -1
        lines.append((int(ids.shape[-1]), real, after["nonfinite_rows"] - before["nonfinite_rows"],
                      after["padded_rows"] - before["padded_rows"]))
        return out

    options = {}
    if compiled:
        options["varlen_compile_config"] = transformers.CompileConfig(backend="aot_eager", mode="default",
                                                                      dynamic=True)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ModelRunner, "compute_batch", traced)
        tokens = generate_batch(model, cb_config(**options), PROMPTS[:3])
    print(f"compiled={compiled}: tokens {tokens}")
    for t, real, bad, padded in lines:
        print(f"  T={t:3d} real={real:3d} +nonfinite={bad:3d} +padded={padded:3d}")


if __name__ == "__main__":
    print(transformers.__version__, torch.__version__)
    run(False)
    run(True)
