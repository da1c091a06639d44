"""scripts/heuristic_eval.py: its rules and summary run here (the script itself times on a GPU)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from safemoe.configs import BLOCK_M_CHOICES, ExpertsConfig, heuristic_config, heuristic_fp8_config

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load():
    sys.path.insert(0, str(SCRIPTS))  # the script imports tune_experts beside it
    try:
        spec = importlib.util.spec_from_file_location("heuristic_eval", SCRIPTS / "heuristic_eval.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def test_every_rule_gives_a_config_for_every_shape_and_bucket():
    """Each rule is a function of the shapes alone and returns a valid config with the tree's
    BLOCK_M (the rules differ in tiles, not in the M-block the dispatch layout uses), on every
    shape the script times."""
    evaluation = _load()
    for name in evaluation.DEFAULT_SHAPES.split(","):
        num_experts, top_k, hidden, inter = evaluation.SHAPES[name]
        for tokens in (1, 2, 8, 64, 256, 512, 1024, 4096, 16384):
            tree = heuristic_config(tokens, num_experts, hidden, inter, top_k, torch.bfloat16)
            for label, rule in evaluation.RULES.items():
                cfg = rule(tokens, num_experts, hidden, inter, top_k)
                where = (label, name, tokens)
                assert isinstance(cfg, ExpertsConfig) and cfg.block_m in BLOCK_M_CHOICES, where
                assert cfg.block_m == tree.block_m, where
    assert set(evaluation.DEFAULT_RULES.split(",")) <= set(evaluation.RULES)
    assert set(evaluation.UNTABLED) <= set(evaluation.DEFAULT_SHAPES.split(","))


def test_previous_rule_is_the_heuristic_before_the_twenty_first_session():
    """The frozen copy the runs compare with: no PDL, no TMA, 128-column prefill tiles."""
    previous = _load()._previous
    decode = previous(8, 128, 2048, 768, 8)
    tiles = (decode.block_m, decode.gemm1.block_n, decode.gemm1.block_k, decode.gemm1.num_stages)
    assert tiles == (16, 32, 128, 4)
    prefill = previous(8192, 128, 2048, 768, 8)
    assert (prefill.gemm1.block_n, prefill.gemm2.block_n, prefill.gemm1.num_stages) == (128, 128, 3)
    for cfg in (decode, prefill):
        assert not cfg.pdl and not cfg.gemm1.tma and not cfg.gemm2.tma and not cfg.gemm1.interleave
    assert not prefill.few and previous(1024, 128, 2048, 768, 8).few  # 64 rows an expert: a decode bucket


def test_summary_ratios_per_regime():
    """Geometric mean and worst of rule / table, and of rule / the best rule at each point; a
    point without the table (an untabled shape) counts only against the best rule."""
    evaluation = _load()

    def row(block_m: int, us: dict[str, float]) -> dict[str, object]:
        return {"configs": {"tree": {"block_m": block_m}}, "us": us}

    rows = [row(16, {"table": 10.0, "tree": 11.0, "previous": 12.0}),
            row(16, {"table": 20.0, "tree": 20.0, "previous": 18.0}),
            row(128, {"tree": 5.0, "previous": 10.0})]
    lines = evaluation.summarise(rows, ["tree", "previous"])
    cells = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in lines[2:]}
    tree16 = [c.strip() for c in cells[("block_m 16", "tree")].strip("|").split("|")]
    assert math.isclose(float(tree16[2]), math.sqrt(1.1 * 1.0), abs_tol=5e-4) and tree16[3] == "1.100"
    assert tree16[4] == "2" and tree16[7] == "2"
    assert math.isclose(float(tree16[5]), math.sqrt(1.0 * 20 / 18), abs_tol=5e-4)
    previous128 = [c.strip() for c in cells[("block_m 128", "previous")].strip("|").split("|")]
    assert previous128[2:5] == ["-", "-", "0"] and previous128[5] == "2.000"
    assert evaluation.summarise(rows, ["tree"], "padded_us")[2:] == []  # no padded times: no rows


def test_fp8_rules_give_configs_for_every_shape_and_bucket():
    """The fp8 rules, bound to a mode by select_rules, return valid configs on every shape: the
    tree is heuristic_fp8_config, every rule but the frozen previous one keeps the tree's BLOCK_M,
    and block mode's K steps stay inside one 128-wide scale group."""
    evaluation = _load()
    for quant in ("per_tensor", "block"):
        rules = evaluation.select_rules("tree,previous,prev_tiles,no_swap", quant)
        assert list(rules) == ["tree", "previous", "prev_tiles", "no_swap"]
        for name in evaluation.DEFAULT_SHAPES.split(","):
            num_experts, top_k, hidden, inter = evaluation.SHAPES[name]
            for tokens in (1, 8, 64, 256, 512, 1024, 2048, 8192):
                tree = heuristic_fp8_config(tokens, num_experts, hidden, inter, top_k, quant)
                for label, rule in rules.items():
                    cfg = rule(tokens, num_experts, hidden, inter, top_k)
                    where = (quant, label, name, tokens)
                    assert isinstance(cfg, ExpertsConfig), where
                    if label != "previous":
                        assert cfg.block_m == tree.block_m, where
                    if quant == "block":
                        assert max(cfg.gemm1.block_k, cfg.gemm2.block_k) <= 128, where
                    if label == "no_swap":
                        assert not cfg.gemm1.swap_ab and not cfg.gemm2.swap_ab, where
                assert rules["tree"](tokens, num_experts, hidden, inter, top_k).block_m == tree.block_m


def test_fp8_previous_rule_is_the_heuristic_before_the_twenty_second_session():
    """The frozen copy: a block of the mean rows (16 rows an expert -> 16, 32 -> 32), no swapped
    product, PDL on every block under 128 rows whatever T."""
    previous = _load()._fp8_previous
    assert previous(256, 128, 2048, 768, 8, "block").block_m == 16  # 16 rows an expert
    assert previous(512, 128, 2048, 768, 8, "block").block_m == 32  # 32 rows
    assert previous(1024, 128, 2048, 768, 8, "block").block_m == 64
    decode = previous(8, 128, 2048, 768, 8, "per_tensor")
    assert (decode.gemm1.block_n, decode.gemm1.block_k, decode.gemm1.num_stages) == (32, 128, 6)
    assert not decode.gemm1.swap_ab and decode.pdl
    assert previous(4096, 512, 2048, 512, 10, "block").pdl  # 80 rows: PDL although T > 1024
    assert not previous(8192, 128, 2048, 768, 8, "block").pdl


def test_select_rules_defaults_and_unknown_labels():
    """The defaults per mode, the tree always first, an unknown label named in the error."""
    evaluation = _load()
    assert list(evaluation.select_rules(None, None)) == evaluation.DEFAULT_RULES.split(",")
    assert list(evaluation.select_rules(None, "block")) == evaluation.DEFAULT_FP8_RULES.split(",")
    assert list(evaluation.select_rules("previous", None)) == ["tree", "previous"]
    with pytest.raises(SystemExit, match="no_swap"):
        evaluation.select_rules("no_swap", None)  # an fp8 rule without --quant
    with pytest.raises(SystemExit, match="wide_k"):
        evaluation.select_rules("wide_k", "block")


def test_peer_summary_ratios_per_regime():
    """Each rule's (and the table's) time over torch grouped_mm's at the same point, per regime;
    points without a peer time (fp8 runs, a torch without grouped_mm) are left out."""
    evaluation = _load()
    peer = evaluation.PEER
    def row(block_m: int, us: dict[str, float], peer_us: float | None) -> dict[str, object]:
        return {"configs": {"tree": {"block_m": block_m}}, "us": us,
                **({"peer_us": {peer: peer_us}} if peer_us else {})}

    rows = [row(16, {"table": 10.0, "tree": 12.0}, 20.0), row(16, {"table": 20.0, "tree": 20.0}, 10.0),
            row(128, {"tree": 5.0}, None)]
    lines = evaluation.peer_summary(rows, ["tree"])
    cells = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in lines[2:]}
    assert set(cells) == {("block_m 16", "table"), ("block_m 16", "tree")}
    tree = [c.strip() for c in cells[("block_m 16", "tree")].strip("|").split("|")]
    assert math.isclose(float(tree[2]), math.sqrt(0.6 * 2.0), abs_tol=5e-4)
    assert tree[3:] == ["2.000", "2"]


def test_fitted_table_few_only_where_the_fit_changes_the_tiles():
    """--table-few fit times a table entry with its few-slot tiles fitted into its launches only
    where that changes them: no few-slot path, the bucket's own tiles, or tiles already within the
    entry's shared memory give None."""
    evaluation = _load()
    main = heuristic_config(256, 64, 2048, 1024, 8, torch.bfloat16)  # 64-row blocks (GEMM2: 96 KB)
    decode = heuristic_config(2, 64, 2048, 1024, 8, torch.bfloat16)  # 256-wide K, 3 stages (120 KB)
    fitted = evaluation.fitted_table_few(decode, main)
    assert fitted is not None and fitted.gemm2.num_stages == 2 and fitted.gemm1 == decode.gemm1
    assert evaluation.fitted_table_few(None, main) is None
    assert evaluation.fitted_table_few(main, main) is None
    assert evaluation.fitted_table_few(fitted, main) is None


def test_table_few_variants_only_where_a_way_changes_the_launches():
    """--table-few times a table entry's few-slot path fitted, as the fused launch (buckets above 16
    rows whose tiles are not fused yet) or left out, each only where it changes the launches; an
    unknown way is refused by name."""
    evaluation = _load()
    main = heuristic_config(256, 64, 2048, 1024, 8, torch.bfloat16)  # 64-row blocks
    decode = heuristic_config(2, 64, 2048, 1024, 8, torch.bfloat16)
    ways = ["fit", "fused", "none", "light"]
    variants = evaluation.table_few_variants(decode, main, ways)
    assert set(variants) == {"table_fit_few", "table_fused_few", "table_no_few", "table_light_few"}
    light = variants["table_light_few"][1]
    assert variants["table_light_few"][0] == main and (light.gemm1.block_k, light.gemm2.block_k) == (128, 128)
    assert "table_light_few" not in evaluation.table_few_variants(light, main, ways)  # already light
    assert variants["table_fit_few"] == (main, evaluation.fitted_table_few(decode, main))
    assert variants["table_fused_few"] == (main, dataclasses.replace(decode, fused=True))
    assert variants["table_no_few"] == (dataclasses.replace(main, few=False), None)
    assert evaluation.table_few_variants(None, main, ways) == {}  # no few-slot path
    assert evaluation.table_few_variants(decode, decode, ways) == {}  # the bucket's own tiles
    already = dataclasses.replace(decode, fused=True)
    assert "table_fused_few" not in evaluation.table_few_variants(already, main, ways)
    decode_bucket = heuristic_config(64, 64, 2048, 1024, 8, torch.bfloat16)  # 16-row tiles
    assert decode_bucket.block_m == 16
    assert "table_fused_few" not in evaluation.table_few_variants(decode, decode_bucket, ways)
    with pytest.raises(ValueError, match="--table-few"):
        evaluation.table_few_variants(decode, main, ["fast"])


def test_light_few_tiles_are_the_tiles_run_5_timed():
    """The few-slot tiles the library compiles into an untabled 64-row launch (`light_few_tiles`)
    are, on every shape run 5 of 2026-12-02 timed, the previous heuristic's decode tiles that it
    timed there (tree_light_inner); the other rules' ways differ from them."""
    evaluation = _load()
    for name in ("olmoe", "qwen2moe", "qwen3", "deepseek", "gptoss", "mixtral", "phimoe", "glm45air"):
        e, k, h, i = evaluation.SHAPES[name]
        buckets = [t for t in (64, 128, 256, 512, 1024, 2048)
                   if evaluation._tree(t, e, h, i, k).block_m == 64]
        assert buckets, name
        for t in buckets:
            cfg = evaluation._tree(t, e, h, i, k)
            library = evaluation._few(evaluation._tree, t, e, h, i, k, cfg)
            timed = evaluation._few(evaluation._previous, t, e, h, i, k, cfg, way="decode")
            assert (library.gemm1, library.gemm2, library.programs_per_sm) == (
                timed.gemm1, timed.gemm2, timed.programs_per_sm), (name, t)
            decode = evaluation._few(evaluation._tree, t, e, h, i, k, cfg, way="decode")
            assert decode.gemm2.block_k == 256 and not decode.fused, (name, t)
            fused = evaluation._few(evaluation._tree, t, e, h, i, k, cfg, way="fused")
            assert fused.fused and fused.gemm2 == evaluation._tree(
                evaluation.few_slots_bucket(k), e, h, i, k).gemm2, (name, t)
