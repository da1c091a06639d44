"""Continuous batching (transformers' `generate_batch`) on patched models: the engine's real-token
count reaches every MoE block as `num_valid` (safemoe.integrations.serving).

CPU (fp32, reference backend): the engine pads every batch the way it does under CUDA graphs or
`torch.compile` (`ModelRunner.pad_inputs`, forced on here since a CPU has no graphs; one test
compiles for real); the patched model generates the stock model's tokens, the health counters show
exactly the rows the engine padded skipped, and NaN written into the padded rows of every MoE
input changes nothing (never routed: 0 non-finite rows; the padded output rows are exact zeros).
GPU (bf16, Triton, CUDA graphs on): the same run, `test_generate_batch_cuda_graphs_bf16`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from helpers import device_skip_reason  # noqa: E402
from safemoe.health import Health  # noqa: E402
from safemoe.integrations.serving import RealTokenTracker, untrack_real_tokens  # noqa: E402
from safemoe.integrations.transformers import patch, patched_blocks, set_num_valid  # noqa: E402
from test_integrations_transformers import config  # noqa: E402  (tiny configs, one per family)

# Families patch() supports, each with the changes its tiny config (test_integrations_transformers.
# config) needs to run in continuous batching; adding a family is one line.
FAMILY_OVERRIDES: dict[str, dict[str, object]] = {
    "qwen3_moe": {},
    # transformers' paged cache (5.17-5.23) has no allocator for linear attention ("Invalid layer type:
    # linear_attention", stock too): Qwen3-Next's MoE blocks (shared expert, sigmoid gate) run here
    # under its full-attention layers only.
    "qwen3_next": {"layer_types": ["full_attention", "full_attention"]},
    # transformers' paged cache (5.17-5.23) sizes K and V by head_dim (= qk_rope_head_dim) while MLA's
    # keys are qk_nope + qk_rope wide: stock DeepSeek-V3 fails in index_copy_ unless qk_nope is 0.
    "deepseek_v3": {"qk_nope_head_dim": 0},
}
SERVING_FAMILIES = list(FAMILY_OVERRIDES)

# Different lengths: with max_batch_tokens=16 the long prompts are prefilled in chunks, and prefill
# and decode steps of different requests share batches.
PROMPTS = [[3, 14, 15, 9, 26], [5, 35, 8, 9, 7, 9, 32, 38, 46, 26, 43], [1, 2], list(range(40, 59)), [7] * 8]
NEW_TOKENS = 5


def build(family: str) -> nn.Module:
    """The tiny random model of test_integrations_transformers.build, with the family's overrides."""
    cfg = config(family)
    for key, value in FAMILY_OVERRIDES[family].items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.1)
    return model


def generation_config(max_new_tokens: int = NEW_TOKENS):
    return transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=-1,
                                         pad_token_id=0)  # fmt: skip


def cb_config(**options):
    """A small ContinuousBatchingConfig, CUDA graphs off unless asked (the CPU tests' models stay on the
    CPU on a GPU machine too); options this transformers version lacks are dropped (5.17 calls the
    page size block_size, 5.23 page_size)."""
    cls = transformers.ContinuousBatchingConfig
    fields = {f.name for f in dataclasses.fields(cls)}
    page = "page_size" if "page_size" in fields else "block_size"
    wanted = {page: 16, "num_blocks": 32, "max_batch_tokens": 16, "q_padding_interval_size": 8,
              "use_cuda_graph": False, **options}  # fmt: skip
    return cls(**{k: v for k, v in wanted.items() if k in fields})


@dataclasses.dataclass
class Steps:
    """(padded T, real tokens) of every forward the engine ran."""

    rows: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def padded(self) -> int:
        return sum(t - real for t, real in self.rows)


def _real_tokens(runner) -> int:
    """The batch's real query-token count, from the engine's host-side bookkeeping (no device read)."""
    io = runner.inputs_and_outputs
    if hasattr(io, "io_pairs"):  # async batching: the pair being computed
        io = io.io_pairs[io.current_pair].host_io
    return int(io.total_seqlen_q)


@contextmanager
def engine(monkeypatch, *, force_padding: bool) -> Iterator[Steps]:
    """Record (T, real) of every engine step (warmup, CUDA-graph capture and replay included: each
    `compute_batch` runs the forward once); with force_padding, pad batches as CUDA graphs do."""
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    steps = Steps()
    init, compute = ModelRunner.__init__, ModelRunner.compute_batch

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if force_padding:
            self.pad_inputs = True

    def patched_compute(self, model, batch_data):
        steps.rows.append((int(batch_data["input_ids"].shape[-1]), _real_tokens(self)))
        return compute(self, model, batch_data)

    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "__init__", patched_init)
        m.setattr(ModelRunner, "compute_batch", patched_compute)
        yield steps


def generate_batch(model: nn.Module, cb, prompts=PROMPTS) -> list[list[int]]:
    out = model.generate_batch(prompts, generation_config=generation_config(), continuous_batching_config=cb)
    assert len(out) == len(prompts), f"{len(out)} of {len(prompts)} requests finished"
    results = list(out.values())
    assert all(r.error is None for r in results), [r.error for r in results]
    return [list(r.generated_tokens) for r in results]


def poison_padding(model: nn.Module) -> tuple[torch.Tensor, list]:
    """NaN into the rows at or past num_valid of every MoE block's input, and a device counter of
    padded output rows that are not exact zeros. Device ops only (no sync): capturable in a graph."""
    nonzero = torch.zeros((), dtype=torch.int64, device=next(model.parameters()).device)

    def padded_rows(block, x):
        rows = torch.arange(x.numel() // x.shape[-1], device=x.device)
        return rows >= block.state.num_valid  # [T] bool

    def before(block, args):
        (x,) = args
        if block.state.num_valid is None:
            return None
        pad = padded_rows(block, x).view(*x.shape[:-1], 1)
        return (torch.where(pad, torch.full_like(x, math.nan), x),)

    def after(block, args, out):
        if block.state.num_valid is not None:
            y = out[0] if isinstance(out, tuple) else out
            bad = y.reshape(-1, y.shape[-1]).ne(0).any(dim=-1) & padded_rows(block, args[0])
            nonzero.add_(bad.sum())
        return None

    handles = []
    for block in patched_blocks(model):
        handles += [block.register_forward_pre_hook(before), block.register_forward_hook(after)]
    return nonzero, handles


def count_nonfinite_real_inputs(model: nn.Module) -> tuple[torch.Tensor, list]:
    """A device counter of rows below the count that reach a patched block's input non-finite: NaN
    the model upstream of the MoE produced in real rows (safemoe must count each such row once in
    `nonfinite_rows`, and no other). Device ops only: captured with the engine's graphs."""
    seen = torch.zeros((), dtype=torch.int64, device=next(model.parameters()).device)

    def before(block, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        bad = ~torch.isfinite(x).all(dim=-1)
        if block.state.num_valid is not None:
            bad &= torch.arange(x.shape[0], device=x.device) < block.state.num_valid
        seen.add_(bad.sum())

    return seen, [block.register_forward_pre_hook(before) for block in patched_blocks(model)]


def read(health: Health) -> dict[str, int]:
    """The counters once every stream is done (the engine computes on its own CUDA stream)."""
    if health.device.type == "cuda":
        torch.cuda.synchronize()
    return health.read()


def check_serving(family: str, monkeypatch, *, device: str, dtype: torch.dtype, backend: str,
                  force_padding: bool, exact: bool, **cb_options) -> None:
    """Stock run, patched run, patched run with NaN in every padded MoE input row; see the module doc.

    exact: the patched tokens must equal stock's run; otherwise (bf16, other kernels) each one must be
    stock's greedy choice within bf16 noise (teacher-forced), and the exact matches are printed.
    """

    def build_on_device() -> nn.Module:
        return build(family).to(device=device, dtype=dtype)

    cb = cb_config(**cb_options)
    stock = build_on_device()
    with engine(monkeypatch, force_padding=force_padding) as steps:
        try:
            want = generate_batch(stock, cb)
        except AssertionError as exc:  # no safemoe in this run: the engine fails on its own
            # (deepseek_v3 under transformers 5.24: an index_copy_ shape mismatch in its cache)
            pytest.skip(f"{family}: the stock engine fails without safemoe: {str(exc)[:200]}")
    assert steps.padded > 0, f"the engine did not pad: the test would prove nothing ({steps.rows})"

    health = Health(device)
    model = patch(build_on_device(), backend=backend, health=health)
    layers = len(patched_blocks(model))
    upstream, handles = count_nonfinite_real_inputs(model)
    with engine(monkeypatch, force_padding=force_padding) as steps:
        got = generate_batch(model, cb)
    counts = read(health)
    assert counts["padded_rows"] == layers * steps.padded > 0, (counts, steps.rows)
    # Real rows the model made non-finite upstream of the MoE are counted (and sanitised), padded rows
    # never: the count is exactly what reached the blocks' real rows. 0 on the CPU.
    assert counts["nonfinite_rows"] == int(upstream), (counts, int(upstream))
    assert counts["dropped_slots"] == 0, counts
    if int(upstream):
        print(f"{family}: the engine produced {int(upstream)} non-finite real rows before the MoE blocks")
    assert model._safemoe_state.num_valid is None, "the engine's count outlived the forward"
    counts_by_size: dict[int, set[int]] = {}
    for size, real in steps.rows:
        counts_by_size.setdefault(size, set()).add(real)
    # Under CUDA graphs one graph per padded size: replays of one graph saw different counts.
    assert any(len(c) > 1 for c in counts_by_size.values()), counts_by_size

    # NaN in every padded MoE input row (device ops, captured with the graphs): never routed (0
    # non-finite rows), the padded output rows are exact zeros, the real tokens do not move a bit.
    health.reset()
    upstream.zero_()
    nonzero, poison_handles = poison_padding(model)
    with engine(monkeypatch, force_padding=force_padding) as steps:
        poisoned = generate_batch(model, cb)
    for h in handles + poison_handles:
        h.remove()
    counts = read(health)
    assert counts["padded_rows"] == layers * steps.padded > 0, (counts, steps.rows)
    assert counts["nonfinite_rows"] == int(upstream), f"{family}: padded NaN rows were routed: {counts}"
    assert poisoned == got, f"{family}: NaN in padded rows changed real tokens"
    assert int(nonzero) == 0, f"{family}: {int(nonzero)} padded MoE output rows are not zeros"

    if exact:
        assert got == want, f"{family}: tokens differ from stock transformers"
        return
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    print(f"{family}: {same}/{NEW_TOKENS * len(PROMPTS)} tokens equal to stock's continuous-batching run")
    for prompt, tokens in zip(PROMPTS, got, strict=True):  # teacher-forced through the stock model
        seq = torch.tensor([prompt + tokens], device=device)
        logits = stock(seq).logits[0, len(prompt) - 1 : -1].float()  # row i predicts tokens[i]
        chosen = logits.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
        gap = logits.max(dim=-1).values - chosen
        tol = 0.03 * float(logits.abs().max())
        assert bool((gap <= tol).all()), f"{family}: {tokens} not greedy for stock, gaps {gap.tolist()}"


@pytest.mark.parametrize("family", SERVING_FAMILIES)
@torch.no_grad()
def test_generate_batch_skips_padded_rows(family, monkeypatch):
    check_serving(family, monkeypatch, device="cpu", dtype=torch.float32, backend="auto", force_padding=True,
                  exact=True)  # fmt: skip


@pytest.mark.skipif(device_skip_reason("cpu") is not None, reason=str(device_skip_reason("cpu")))
@torch.no_grad()
def test_generate_batch_triton_kernels(monkeypatch):
    """The GPU's code path on the CPU: bf16 through the Triton kernels (interpreter), which load the
    count from the engine's buffer through a pointer (an int32 view at an offset)."""
    check_serving("qwen3_moe", monkeypatch, device="cpu", dtype=torch.bfloat16, backend="triton",
                  force_padding=True, exact=False)  # fmt: skip


@torch.no_grad()
def test_generate_batch_without_padding_counts_nothing(monkeypatch):
    """Eager engine on CPU (no graphs, no compile): batches are not padded, the count is T."""
    want = generate_batch(build("qwen3_moe"), cb_config())
    health = Health()
    model = patch(build("qwen3_moe"), health=health)
    with engine(monkeypatch, force_padding=False) as steps:
        assert generate_batch(model, cb_config()) == want
    assert steps.padded == 0 and steps.rows
    assert health.read()["padded_rows"] == 0


@torch.no_grad()
def test_generate_batch_compiled(monkeypatch):
    """The engine's own torch.compile path (which pads every batch): the hooks are traced with the
    model (aot_eager: dynamo and AOT functionalisation of safemoe's ops, no C++ toolchain)."""
    torch._dynamo.reset()
    want = generate_batch(build("qwen3_moe"), cb_config(), PROMPTS[:3])
    health = Health()
    model = patch(build("qwen3_moe"), health=health)
    # transformers 5.17's engine (the GPU machine's) hands the blocks non-finite real rows of its own
    # here, as under CUDA graphs (issue 16's note): safemoe must count exactly those.
    upstream, handles = count_nonfinite_real_inputs(model)
    compile_config = transformers.CompileConfig(backend="aot_eager", mode="default", dynamic=True)
    with engine(monkeypatch, force_padding=False) as steps:
        got = generate_batch(model, cb_config(varlen_compile_config=compile_config), PROMPTS[:3])
    for handle in handles:
        handle.remove()
    torch._dynamo.reset()
    assert got == want
    assert steps.padded > 0, "the compiled engine did not pad"
    counts = read(health)
    assert counts["padded_rows"] == len(patched_blocks(model)) * steps.padded, (counts, steps.rows)
    assert counts["nonfinite_rows"] == int(upstream), (counts, int(upstream))
    assert model._safemoe_state.num_valid is None


@pytest.mark.parametrize("family", SERVING_FAMILIES)
@torch.no_grad()
def test_plain_generate_and_forward_fall_back_to_all_rows(family):
    stock = build(family)
    ids = torch.tensor([PROMPTS[0], PROMPTS[4][:5]])
    want_tokens = stock.generate(ids, generation_config=generation_config())
    want_logits = stock(ids).logits
    health = Health()
    model = patch(build(family), health=health)
    assert torch.equal(model.generate(ids, generation_config=generation_config()), want_tokens)
    torch.testing.assert_close(model(ids).logits, want_logits, atol=1e-5, rtol=1e-5)
    assert health.read()["padded_rows"] == 0 and model._safemoe_state.num_valid is None


@torch.no_grad()
def test_count_precedence_and_fallbacks():
    health = Health()
    model = patch(build("qwen3_moe"), health=health)
    state, layers = model._safemoe_state, len(patched_blocks(model))
    ids = torch.randint(0, 64, (1, 7))
    cu = torch.tensor([0, 3, 5, 5], dtype=torch.int32)  # 5 real tokens, 2 padded, a fake empty request

    def padded_rows_of(**kwargs) -> int:
        health.reset()
        model(**kwargs)
        return health.read()["padded_rows"]

    assert padded_rows_of(input_ids=ids, cu_seq_lens_q=cu) == layers * 2
    assert state.num_valid is None
    set_num_valid(model, 6)  # explicit count: wins over the engine's
    assert padded_rows_of(input_ids=ids, cu_seq_lens_q=cu) == layers * 1
    assert state.num_valid == 6
    set_num_valid(model, None)
    # No usable count: all rows valid.
    assert padded_rows_of(input_ids=ids) == 0
    assert padded_rows_of(input_ids=ids, cu_seq_lens_q=cu.float()) == 0
    assert padded_rows_of(input_ids=ids, cu_seq_lens_q=cu.to("meta")) == 0  # not the blocks' device
    assert padded_rows_of(input_ids=ids.expand(2, 7), cu_seq_lens_q=cu) == 0  # not one packed row
    assert state.num_valid is None

    # Cleared after a failed forward too.
    def fail(module, args):
        raise RuntimeError("boom")

    handle = patched_blocks(model)[0].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        model(input_ids=ids, cu_seq_lens_q=cu)
    handle.remove()
    assert state.num_valid is None

    # One tracker however often patch() runs; untrack removes it.
    patch(model)
    assert isinstance(model._safemoe_tracker, RealTokenTracker)
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    untrack_real_tokens(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert padded_rows_of(input_ids=ids, cu_seq_lens_q=cu) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("family", SERVING_FAMILIES)
@torch.no_grad()
def test_generate_batch_cuda_graphs_bf16(family, monkeypatch):
    """bf16 on the Triton backend, the engine capturing and replaying CUDA graphs (the count changes
    between replays of one graph): padded rows skipped at every replay (health = what the engine
    padded), padded NaN never read, and every token is the stock model's greedy choice within bf16
    noise.

    Measured on an H100 (transformers 5.17, 2026-11-24): the engine itself hands the MoE blocks 16
    non-finite real rows per layer in these runs (the same in every run, stock tokens unchanged);
    safemoe's non-finite count equals exactly that, which is what the test asserts (it was an xfail
    while `nonfinite_rows == 0` was asserted)."""
    check_serving(family, monkeypatch, device="cuda", dtype=torch.bfloat16, backend="triton",
                  force_padding=False, exact=False, use_cuda_graph=True)  # fmt: skip
