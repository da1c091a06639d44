"""scripts/models_coverage.py's two added columns: the GPU-log parser (synthetic pytest lines, and
its test ids against tests/test_integrations_transformers.py's families) and the fp8 cell on one
family (qwen3_moe, tiny: ~2 s), with a negative control."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import load_script

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.finegrained_fp8")

coverage = load_script("models_coverage")

LOG = """\
......F.s                                                 [100%]
=================================== FAILURES ===================================
_______________________ test_patched_models_bf16[jetmoe] _______________________

    def test_patched_models_bf16(family):
>       assert_close(got, want)
E           AssertionError: jetmoe logits 93/1152 elements differ (atol=0.1, rtol=0.03); worst:
E             at (2, 38): actual -0.306641 expected -1.375
=========================== short test summary info ============================
PASSED tests/test_integrations_transformers.py::test_patched_models_bf16[qwen3_moe]
PASSED tests/test_integrations_transformers.py::test_patched_models_bf16[deepseek_v3]
PASSED tests/test_integrations_transformers.py::test_patched_models_bf16[kimi_k2]
PASSED tests/test_integrations_transformers.py::test_patched_models_bf16[minimax_m3]
PASSED tests/test_fp8_checkpoints.py::test_quantizer_fp8_model_patched_matches_dequantized[qwen3_moe]
SKIPPED [1] tests/test_integrations_transformers.py:190: transformers 5.17.0 has no BeamForCausalLM
SKIPPED [1] tests/test_fp8_checkpoints.py:438: needs a CUDA device
FAILED tests/test_integrations_transformers.py::test_patched_models_bf16[jetmoe]
1 failed, 5 passed, 2 skipped in 3.00s
"""


def test_gpu_log_cells():
    log = coverage.parse_gpu_log(LOG, "hf_models_gpu_NVIDIA-H100_2026-11-24.txt")
    assert (log.device, log.date, log.versions) == ("H100", "2026-11-24", "transformers 5.17.0")
    cell = coverage.gpu_cell
    assert cell(log, "qwen3_moe") == "bf16 patch: passed (H100, 2026-11-24)"
    assert cell(log, "deepseek_v3") == "bf16 patch: passed (H100, 2026-11-24; test ids deepseek_v3, kimi_k2)"
    assert cell(log, "minimax_m3_vl") == "bf16 patch: passed (H100, 2026-11-24; test id minimax_m3)"
    assert cell(log, "jetmoe") == ("bf16 patch: failed (H100, 2026-11-24): AssertionError: jetmoe logits "
                                   "93/1152 elements differ (atol=0.1, rtol=0.03)")
    assert cell(log, "mixtral") == "not in the GPU tests"
    assert cell(None, "qwen3_moe") == "not in the GPU tests"
    # a skip line names the class, not the test id: found by the class's models/ folder (in the
    # installed transformers: 5.17 on the GPU machine has no beam folder to find it by)
    if importlib.util.find_spec("transformers.models.beam") is not None:
        assert cell(log, "beam") == ("bf16 patch: skipped (H100, 2026-11-24): transformers 5.17.0 has no "
                                     "BeamForCausalLM")
    # tests that are not per-family GPU tests of the table do not count
    assert [r.test for r in log.results["qwen3_moe"]] == ["test_patched_models_bf16"]


def test_gpu_test_ids_map_to_their_model_folder():
    """Every family id of the GPU test maps (GPU_ALIASES, else itself) to the models/ folder of the
    model class it builds, where the installed transformers has that class."""
    from test_integrations_transformers import SPECS

    checked = 0
    for test_id, spec in SPECS.items():
        cls = getattr(transformers, spec.model, None)
        if cls is None:
            folder = coverage._class_family(spec.model)
            if folder is None:
                continue
        else:
            folder = cls.__module__.split(".")[2]
        assert coverage.GPU_ALIASES.get(test_id, test_id) == folder, (test_id, spec.model, folder)
        checked += 1
    assert checked >= 40
    assert set(coverage.GPU_ALIASES) <= set(SPECS)


@pytest.fixture(scope="module")
def qwen3_moe():
    stock = coverage.build("qwen3_moe", "eager")
    model = coverage.build("qwen3_moe", "safemoe")
    model.load_state_dict(stock.state_dict())
    return stock, model


def test_fp8_cell(qwen3_moe):
    cell = coverage.check_fp8(*qwen3_moe)
    assert cell.startswith("yes (patch, experts; max error 0."), cell
    error = float(cell.rsplit(" ", 1)[1].rstrip(")"))
    assert 0.0 < error <= coverage.FP8_TOL


def test_fp8_cell_sees_wrong_scales(qwen3_moe, monkeypatch):
    """Negative control: the fp8 experts hold scales 1.5x the ones their reference was
    dequantised with; both modes must miss, each with the error it measured."""
    import safemoe.testing

    fill = safemoe.testing.fill_fp8_experts

    def wrong(module, w13, w2, **kwargs):
        out = fill(module, w13, w2, **kwargs)
        with torch.no_grad():
            module.gate_up_proj_scale_inv.mul_(1.5)
        return out

    monkeypatch.setattr(safemoe.testing, "fill_fp8_experts", wrong)
    cell = coverage.check_fp8(*qwen3_moe)
    assert cell.startswith("no: patch: relative error"), cell
    assert "; experts: relative error" in cell and f"> {coverage.FP8_TOL} vs the dequantised experts" in cell


def test_fp8_cell_names_why():
    """A layout transformers' FP8Experts cannot hold (experts with biases) is a miss with its reason."""
    gpt_oss = coverage.build("gpt_oss", "eager")
    cell = coverage.check_fp8(gpt_oss, gpt_oss)
    assert cell == "no: GptOssExperts has biases: transformers' FP8Experts has none"


def test_table_from_saved_rows(tmp_path):
    """--from-json renders an earlier run's rows with a GPU log: counts and cells as given."""
    import json

    rows = [coverage.Row("qwen3_moe", "Qwen3MoeExperts", "yes", "yes", 1.0,
                         fp8="yes (patch, experts; max error 0.046)"),
            coverage.Row("mixtral", "MixtralExperts", "yes", "no: why", 1.0,
                         fp8="patch only (max error 0.047); experts: x")]
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps({"date": "2026-11-24", "versions": "transformers 5.23.0", "minutes": 3.0,
                                 "jobs": 2, "rows": [vars(r) for r in rows]}))
    log = tmp_path / "hf_models_gpu_NVIDIA-H100_2026-11-24.txt"
    log.write_text(LOG)
    out = tmp_path / "models.md"
    assert coverage.main(["--from-json", str(saved), "--gpu-log", str(log), "--out", str(out)]) == 0
    text = out.read_text()
    assert ("| qwen3_moe | Qwen3MoeExperts | yes | yes | yes (patch, experts; max error 0.046) | "
            "bf16 patch: passed (H100, 2026-11-24) |") in text
    assert ("| mixtral | MixtralExperts | yes | no: why | patch only (max error 0.047); experts: x | "
            "not in the GPU tests |") in text
    assert ("2 families; patch: 2 pass; experts_implementation=\"safemoe\": 1 pass; fp8: patch 2, "
            "experts_implementation 1, both 1; bf16 patch passed on GPU: 1.") in text
    assert "on 2026-11-24, transformers 5.23.0" in text and "This run took 3 min" in text
    assert "jetmoe: bf16 patch: failed" in text  # in the log, not a row of the table
