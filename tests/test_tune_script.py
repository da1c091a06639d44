"""scripts/tune_experts.py: the GPU tuner's planning code runs here (it is only ever run on a GPU
machine, so a stale import there surfaced only on the device: 2026-11-24)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from safemoe.configs import BLOCK_M_CHOICES, ExpertsConfig

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "tune_experts.py"


def _load():
    spec = importlib.util.spec_from_file_location("tune_experts", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_candidate_plans_cover_every_shape_and_bucket():
    tune = _load()
    for name, (num_experts, top_k, _, _) in tune.SHAPES.items():
        for num_tokens in (1, 8, 256, 8192):
            plan = tune.candidate_plan(num_tokens, num_experts, top_k)
            assert plan, (name, num_tokens)
            assert all(isinstance(c, ExpertsConfig) and c.block_m in BLOCK_M_CHOICES for c in plan)
            assert {c.gemm1.tma for c in plan} == {False, True}, f"{name} T={num_tokens}: TMA not searched"
