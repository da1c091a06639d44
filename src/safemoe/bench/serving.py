"""Serving benchmark: transformers' continuous batching (CUDA graphs on) with stock experts
(`grouped_mm`) and with safemoe (`patch()`), in the same run, on a model with the MoE dimensions of
Qwen3-30B-A3B.

    python -m safemoe.bench.serving --out DIR [--layers 4] [--concurrency 1,8,32,64,128,256] [--quick]

Model: `safemoe.demo_models` `gpu` config (E=128, K=8, H=2048, I=768, 32 q / 4 kv heads, head_dim
128), `--layers` decoder layers (default 4), random weights, bf16. The vocabulary is cut to 32768
(Qwen3's is 151936) to save memory: it changes the lm_head's cost, not the MoE. Two copies of the
same weights: `stock` (transformers' `grouped_mm` experts) and `safemoe` (the copy patched with
`safemoe.integrations.transformers.patch`, one shared `Health`).

Workload, per concurrency level c: c requests submitted together, prompt lengths uniform in
[16, 512], max_new_tokens uniform in [16, 128] (greedy, no EOS: every request generates exactly its
max_new_tokens), random token ids, a fixed seed. Served through the public manager API
(`init_continuous_batching`, `add_request`, `get_result`).

Measured per side and concurrency (timed pass after an untimed warm-up pass of the same workloads
on the same manager, so the engine's graphs are captured before timing):
- tokens/s = generated tokens / host wall time from submitting the requests to the last result;
- per-step latency p50/p99 (ms): CUDA events recorded on the engine's compute stream before and
  after each `ModelRunner.compute_batch` (no host sync in the engine; read after the workload);
- engine padding: (padded T, real tokens) of each step, from the engine's own host bookkeeping.

Checked per side and concurrency (separate, untimed runs, one fresh manager per run with every
request queued before the engine starts, so two runs schedule the same batches):
- `clean` and `nan` runs; in the `nan` run a forward hook on every attention module writes NaN into
  the rows at or past the engine's real-token count (`cu_seq_lens_q[-1]`) of the attention output,
  device ops only, so it is captured in the graphs like the rest of the forward;
- non-finite logit rows (every logit row the engine computes indexes a real token);
- a checksum of the logits' bits (position-weighted sum of the raw bf16 bits of every logit row of
  every step): equal checksums = bitwise-equal logits (up to checksum collisions);
- safemoe's health counters: PADDED_ROWS against layers x (padded T - real) summed over the
  engine's steps (equal = every padded row skipped), NONFINITE_ROWS (valid rows that held NaN);
- generated tokens identical between the clean and the nan run, and equal to stock's.

Nothing is asserted here: a mismatch (padded rows routed, NaN reaching real rows, a side failing)
is reported in the table. Results: `serving.json`, `serving.md` and `serving.png` under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import math
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from safemoe.bench.harness import run_info
from safemoe.cli import Parser, int_in, names_list, output_dir
from safemoe.health import Health

SUITE = "serving"
CONCURRENCY = (1, 8, 32, 64, 128, 256)
QUICK_CONCURRENCY = (1, 32, 256)
PROMPT_LENGTHS = (16, 512)
NEW_TOKENS = (16, 128)
VOCAB = 32768  # Qwen3's 151936 cut to save memory (the lm_head only; the MoE is untouched)
WORKLOAD_TIMEOUT_S = 180.0  # one workload's results must all arrive within this (else reported)


# ----------------------------------------------------------------------------------------------
# Workloads
# ----------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """c requests submitted together. prompts[i] has len in PROMPT_LENGTHS; new_tokens[i] in NEW_TOKENS."""

    concurrency: int
    prompts: list[list[int]]
    new_tokens: list[int]

    @property
    def generated(self) -> int:
        return sum(self.new_tokens)


def make_workloads(
    concurrencies: tuple[int, ...],
    vocab: int,
    *,
    seed: int = 0,
    prompt_lengths: tuple[int, int] = PROMPT_LENGTHS,
    new_tokens: tuple[int, int] = NEW_TOKENS,
) -> list[Workload]:
    """One deterministic workload per concurrency level (token ids in [1, vocab))."""
    rng = random.Random(seed)
    out = []
    for c in concurrencies:
        prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_lengths))] for _ in range(c)]
        out.append(Workload(c, prompts, [rng.randint(*new_tokens) for _ in range(c)]))
    return out


# ----------------------------------------------------------------------------------------------
# Engine steps: (padded T, real tokens, timing) of every ModelRunner.compute_batch
# ----------------------------------------------------------------------------------------------


@dataclass
class Step:
    padded: int  # T the forward ran on (input_ids.shape[-1])
    real: int  # real query tokens of the batch (the engine's host-side total_seqlen_q)
    warmup: bool  # one of the engine's warm-up batches (fake requests)
    start: Any = None  # torch.cuda.Event, or perf_counter seconds on the CPU
    end: Any = None

    def ms(self) -> float:
        if isinstance(self.start, float):
            return (self.end - self.start) * 1e3
        return float(self.start.elapsed_time(self.end))


def _host_io(runner: Any) -> Any:
    io = runner.inputs_and_outputs
    if hasattr(io, "io_pairs"):  # async batching: the pair being computed
        io = io.io_pairs[io.current_pair].host_io
    return io


def _is_warmup(runner: Any) -> bool:
    if getattr(runner, "_safemoe_bench_in_warmup", False):
        return True
    requests = getattr(_host_io(runner), "requests_in_batch", None) or []
    return any(
        str(getattr(getattr(r, "state", None), "request_id", "")).startswith("__warmup") for r in requests
    )


class StepRecorder:
    """Wraps transformers' `ModelRunner.compute_batch` (class-wide, while `active()`) to record every
    step into `steps`. On CUDA the step is bracketed by events on the engine's compute stream (no
    sync: the engine's overlap of host work and compute is kept). `force_padding` pads every batch as
    CUDA graphs do (`pad_inputs`), for CPU runs where the engine would not pad."""

    def __init__(self, force_padding: bool = False) -> None:
        self.steps: list[Step] = []
        self.force_padding = force_padding
        self.available = True
        self.note = ""
        self.engine: dict[str, Any] = {}  # how the engine ran (graphs, async IO, padding), first step seen

    @contextlib.contextmanager
    def active(self) -> Iterator[StepRecorder]:
        try:
            from transformers.generation.continuous_batching.model_runner import ModelRunner
        except ImportError as exc:  # another transformers layout: no per-step numbers
            self.available, self.note = False, f"no ModelRunner ({exc})"
            yield self
            return
        if not hasattr(ModelRunner, "compute_batch"):
            self.available, self.note = False, "ModelRunner has no compute_batch"
            yield self
            return
        recorder = self
        compute, init = ModelRunner.compute_batch, ModelRunner.__init__
        warmup = getattr(ModelRunner, "warmup", None)

        def recorded_compute(runner, model, batch_data):
            stream = getattr(runner.inputs_and_outputs, "compute_stream", None)
            ids = batch_data["input_ids"]
            step = Step(int(ids.shape[-1]), int(_host_io(runner).total_seqlen_q), _is_warmup(runner))
            if not recorder.engine:
                recorder.engine = {
                    "cuda_graph_varlen": getattr(runner, "use_cuda_graph_varlen", None),
                    "cuda_graph_decode": getattr(runner, "use_cuda_graph_decode", None),
                    "pads_batches": getattr(runner, "pad_inputs", None),
                    "io": type(runner.inputs_and_outputs).__name__,
                    "attention": getattr(getattr(model, "config", None), "_attn_implementation", None),
                }
            if ids.device.type == "cuda":
                stream = stream if stream is not None else torch.cuda.current_stream(ids.device)
                step.start, step.end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                step.start.record(stream)
                out = compute(runner, model, batch_data)
                step.end.record(stream)
            else:
                step.start = time.perf_counter()
                out = compute(runner, model, batch_data)
                step.end = time.perf_counter()
            recorder.steps.append(step)
            return out

        def padded_init(runner, *args, **kwargs):
            init(runner, *args, **kwargs)
            runner.pad_inputs = True

        def flagged_warmup(runner, *args, **kwargs):
            runner._safemoe_bench_in_warmup = True
            try:
                return warmup(runner, *args, **kwargs)  # type: ignore[misc]
            finally:
                runner._safemoe_bench_in_warmup = False

        # Class-wide while active (the engine builds its runner inside init_continuous_batching).
        ModelRunner.compute_batch = recorded_compute  # type: ignore[method-assign]
        if self.force_padding:
            ModelRunner.__init__ = padded_init  # type: ignore[method-assign, assignment]
        if warmup is not None:
            ModelRunner.warmup = flagged_warmup  # type: ignore[method-assign, assignment]
        try:
            yield self
        finally:
            ModelRunner.compute_batch = compute  # type: ignore[method-assign]
            ModelRunner.__init__ = init  # type: ignore[method-assign]
            if warmup is not None:
                ModelRunner.warmup = warmup  # type: ignore[method-assign]

    def take(self) -> list[Step]:
        """The steps recorded since the last take (events complete: the caller synced)."""
        steps, self.steps = self.steps, []
        return steps


# ----------------------------------------------------------------------------------------------
# Probes: logits counters and NaN injection, device ops only (captured with the engine's graphs)
# ----------------------------------------------------------------------------------------------

_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def nan_into_padded_rows(
    hidden: torch.Tensor, count: torch.Tensor | int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden with NaN in every row of the flattened tokens at or past `count`, how many rows that is).

    hidden: [..., T, H] (transformers' attention output [1, T, H]); count: the real-token count (a
    0-dim device tensor, the engine's `cu_seq_lens_q[-1]`). No host sync, no data-dependent shape."""
    rows = torch.arange(hidden.shape[-2], device=hidden.device)
    padded = rows >= count  # [T] bool
    poisoned = torch.where(padded[:, None], torch.full_like(hidden, math.nan), hidden)
    return poisoned, padded.sum()


def logits_bits_checksum(logits: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of the raw bits of `logits` (int64, 0-dim): bit-exact equality test."""
    flat = logits.detach().reshape(-1)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1
    return (bits * weights).sum()


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer (transformers' `layers[i].self_attn`)."""
    found = (getattr(m, "self_attn", None) for m in model.modules())
    return [m for m in found if isinstance(m, nn.Module)]


class Probes:
    """Counters on one model: non-finite logit rows, logits checksum, and (inject_nan) NaN written into
    the padded rows of every attention output. The real-token count is the engine's
    `cu_seq_lens_q[-1]`, read by a pre-hook on the model (as safemoe's tracker reads it)."""

    def __init__(self, model: nn.Module, *, inject_nan: bool) -> None:
        device = next(model.parameters()).device
        self.nonfinite_logit_rows = torch.zeros((), dtype=torch.int64, device=device)
        self.checksum = torch.zeros((), dtype=torch.int64, device=device)
        self.injected_rows = torch.zeros((), dtype=torch.int64, device=device)
        self._count: torch.Tensor | None = None
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, always_call=True),
        ]
        if inject_nan:
            self._handles += [m.register_forward_hook(self._inject) for m in attention_modules(model)]

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cu = kwargs.get("cu_seq_lens_q")
        ok = isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() > 0
        self._count = cu[-1] if ok and isinstance(cu, torch.Tensor) else None
        return None

    def _after(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._count = None
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor):
            rows = logits.detach().reshape(-1, logits.shape[-1])
            self.nonfinite_logit_rows.add_((~torch.isfinite(rows)).any(dim=-1).sum())
            self.checksum.add_(logits_bits_checksum(rows))
        return None

    def _inject(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self._count is None:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        poisoned, rows = nan_into_padded_rows(hidden, self._count)
        self.injected_rows.add_(rows)
        return (poisoned, *output[1:]) if isinstance(output, tuple) else poisoned

    def read(self) -> dict[str, int]:
        return {
            "nonfinite_logit_rows": int(self.nonfinite_logit_rows),
            "logits_checksum": int(self.checksum),
            "nan_rows_injected": int(self.injected_rows),
        }

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ----------------------------------------------------------------------------------------------
# The engine, through its public manager API (argument names checked: 5.17 and 5.23 differ)
# ----------------------------------------------------------------------------------------------


def _accepted(fn: Callable, **kwargs: Any) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def cb_config(
    *,
    cuda_graphs: bool,
    max_batch_tokens: int,
    num_blocks: int,
    max_requests: int,
    page: int,
    q_padding_interval: int | None = None,
) -> Any:
    """A ContinuousBatchingConfig with the fields this transformers has (5.17 calls page_size block_size)."""
    import dataclasses

    import transformers

    cls = transformers.ContinuousBatchingConfig
    fields = {f.name for f in dataclasses.fields(cls)}
    wanted: dict[str, Any] = {
        "page_size" if "page_size" in fields else "block_size": page,
        "num_blocks": num_blocks,
        "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": max_requests,
        "use_cuda_graph": cuda_graphs,
        "allow_block_sharing": False,  # the timed pass repeats the warm-up's prompts: no prefix-cache hits
    }
    if q_padding_interval is not None:
        wanted["q_padding_interval_size"] = q_padding_interval
    return cls(**{k: v for k, v in wanted.items() if k in fields})


def generation_config() -> Any:
    import transformers

    return transformers.GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS[1], eos_token_id=-1, pad_token_id=0
    )


class Engine:
    """One continuous-batching manager of `model`."""

    def __init__(self, model: nn.Module, cb: Any, *, warmup: bool) -> None:
        self.model = model
        init = model.init_continuous_batching
        gen = generation_config()
        if "continuous_batching_config" not in _accepted(init, continuous_batching_config=cb):  # type: ignore[arg-type]
            gen.continuous_batching_config = (
                cb  # older transformers: the config travels in the generation config
            )
        self.manager = init(**_accepted(init, generation_config=gen, continuous_batching_config=cb))  # type: ignore[operator, arg-type]
        if warmup and hasattr(self.manager, "warmup"):
            self.manager.warmup()
        self.started = False
        self._round = 0

    def _add(self, workload: Workload, tag: str) -> list[str]:
        ids = [f"{tag}_{i}" for i in range(len(workload.prompts))]
        add = self.manager.add_request
        for rid, prompt, n in zip(ids, workload.prompts, workload.new_tokens, strict=True):
            got = add(**_accepted(add, input_ids=prompt, request_id=rid, max_new_tokens=n))
            if got is None and self.started:
                raise RuntimeError(f"the manager refused request {rid}")
        return ids

    def serve(self, workload: Workload) -> tuple[list[list[int]], float]:
        """Generated tokens per request (in workload order) and the wall seconds from submission to
        the last result. Before the first serve the requests are queued, then the engine started:
        its batches are the same in every run (the check runs serve once per manager). Not
        `manager.pause()` for later serves: 5.17 may lack it and it waits without a time limit."""
        self._round += 1
        tag = f"w{self._round}"
        start = time.perf_counter()
        ids = self._add(workload, tag)  # later serves: added while the engine runs, as a server gets them
        if not self.started:
            self.manager.start()
            self.started = True
        wanted, results = set(ids), dict[str, Any]()
        deadline = start + WORKLOAD_TIMEOUT_S
        while len(results) < len(ids):
            if time.perf_counter() > deadline:
                raise TimeoutError(
                    f"{len(results)} of {len(ids)} requests done after {WORKLOAD_TIMEOUT_S:.0f} s"
                )
            result = self.manager.get_result(timeout=1)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError(f"the generation thread stopped ({len(results)} of {len(ids)} done)")
                continue
            finished = getattr(result, "is_finished", None)
            if result.request_id in wanted and (finished is None or finished()):
                if getattr(result, "error", None):
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                results[result.request_id] = result
        wall = time.perf_counter() - start
        return [list(results[rid].generated_tokens) for rid in ids], wall

    def close(self) -> None:
        with contextlib.suppress(Exception):
            stop = self.manager.stop
            stop(**_accepted(stop, block=True, timeout=30))
        with contextlib.suppress(Exception):
            if hasattr(self.manager, "destroy"):
                self.manager.destroy()
        with contextlib.suppress(Exception):
            destroy = getattr(self.model, "destroy_cached_continuous_batching_manager", None)
            if destroy is not None:
                destroy()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


@dataclass
class SideResult:
    """One side (stock or safemoe) on one workload. Fields are None when not measured."""

    tokens_per_s: float | None = None
    wall_s: float | None = None
    steps: int = 0
    step_ms_p50: float | None = None
    step_ms_p99: float | None = None
    engine_padded_rows: int | None = None  # sum over steps of (padded T - real), timed pass
    nonfinite_logit_rows: dict[str, int] = field(default_factory=dict)  # by run: clean, nan
    nan_rows_injected: int | None = None
    tokens_identical_under_nan: bool | None = None
    logits_bitwise_identical_under_nan: bool | None = None
    health: dict[str, dict[str, int]] = field(default_factory=dict)  # safemoe, by run: timed, clean, nan
    expected_padded_rows: dict[str, int] = field(default_factory=dict)  # layers x engine padding, by run
    errors: list[str] = field(default_factory=list)


@dataclass
class Row:
    concurrency: int
    requests: int
    prompt_tokens: int
    generated_tokens: int
    stock: SideResult
    safemoe: SideResult
    tokens_equal_to_stock: float | None = None  # fraction of safemoe's generated tokens equal to stock's

    @property
    def speedup(self) -> float | None:
        a, b = self.stock.tokens_per_s, self.safemoe.tokens_per_s
        return None if not a or not b else b / a

    @property
    def padded_rows_skipped(self) -> bool | None:
        """Every padded row skipped in every run with padding: health PADDED_ROWS = layers x padding."""
        s = self.safemoe
        if not s.expected_padded_rows:
            return None
        return all(
            s.health.get(run, {}).get("padded_rows") == want for run, want in s.expected_padded_rows.items()
        )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def _error(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def _record_timing(side: SideResult, steps: list[Step]) -> None:
    real = [s for s in steps if not s.warmup]
    side.steps = len(real)
    if real:
        times = [s.ms() for s in real]
        side.step_ms_p50 = statistics.median(times)
        side.step_ms_p99 = _percentile(times, 99)
        side.engine_padded_rows = sum(s.padded - s.real for s in real)


def timed_pass(
    model: nn.Module,
    workloads: list[Workload],
    cb: Any,
    recorder: StepRecorder,
    results: list[SideResult],
    *,
    health: Health | None,
    layers: int,
    log: Callable[[str], None],
) -> None:
    """Warm-up pass (untimed: the engine's graphs are captured) then the timed pass, one manager."""
    device = next(model.parameters()).device
    engine = None
    try:
        engine = Engine(model, cb, warmup=True)
        for workload in workloads:
            engine.serve(workload)
        _sync(device)
        recorder.take()
        for workload, side in zip(workloads, results, strict=True):
            if health is not None:
                health.reset()
                _sync(device)  # the engine computes on its own stream
            try:
                tokens, wall = engine.serve(workload)
            except Exception as exc:
                side.errors.append(f"timed: {_error(exc)}")
                log(f"  c={workload.concurrency}: {side.errors[-1]}")
                raise
            _sync(device)
            side.wall_s = wall
            side.tokens_per_s = sum(len(t) for t in tokens) / wall
            steps = recorder.take()
            _record_timing(side, steps)
            if health is not None:
                side.health["timed"] = health.read()
                side.expected_padded_rows["timed"] = layers * sum(s.padded - s.real for s in steps)
            log(f"  c={workload.concurrency}: {side.tokens_per_s:.0f} tok/s, step p50 {side.step_ms_p50} ms")
    except Exception as exc:
        for side in results:
            if side.tokens_per_s is None and not side.errors:  # the workloads not measured
                side.errors.append(f"timed: {_error(exc)}")
        traceback.print_exc()
    finally:
        if engine is not None:
            engine.close()
        recorder.take()


def check_run(
    model: nn.Module,
    workload: Workload,
    cb: Any,
    recorder: StepRecorder,
    side: SideResult,
    run: str,
    *,
    health: Health | None,
    layers: int,
) -> tuple[list[list[int]], int] | None:
    """One fresh manager, requests queued before it starts; probes (NaN injection when run == "nan")
    captured with the graphs. Returns (tokens, logits checksum), or None when it failed."""
    device = next(model.parameters()).device
    probes = Probes(model, inject_nan=run == "nan")
    engine = None
    if health is not None:
        health.reset()
    _sync(device)  # counters zeroed before the engine's stream adds to them
    recorder.take()
    try:
        engine = Engine(model, cb, warmup=False)
        tokens, _ = engine.serve(workload)
        _sync(device)
        engine.close()
        engine = None
        _sync(device)
        counts = probes.read()
        steps = recorder.take()
        side.nonfinite_logit_rows[run] = counts["nonfinite_logit_rows"]
        if run == "nan":
            side.nan_rows_injected = counts["nan_rows_injected"]
        if health is not None:
            side.health[run] = health.read()
            side.expected_padded_rows[run] = layers * sum(s.padded - s.real for s in steps)  # all it ran
        return tokens, counts["logits_checksum"]
    except Exception as exc:
        side.errors.append(f"{run}: {_error(exc)}")
        traceback.print_exc()
        return None
    finally:
        probes.remove()
        if engine is not None:
            engine.close()
        with contextlib.suppress(Exception):
            _sync(device)
        recorder.take()


def _is_fatal(error: str) -> bool:
    return "TimeoutError" in error or "CUDA error" in error or "AcceleratorError" in error


def check_pass(
    model: nn.Module,
    workloads: list[Workload],
    cb: Any,
    recorder: StepRecorder,
    results: list[SideResult],
    *,
    health: Health | None,
    layers: int,
    log: Callable[[str], None],
) -> list[list[list[int]] | None]:
    """Clean and NaN-injected runs of every workload; returns the clean tokens per workload."""
    clean_tokens: list[list[list[int]] | None] = []
    for workload, side in zip(workloads, results, strict=True):
        fatal = [e for r in results for e in r.errors if _is_fatal(e)]
        if fatal:  # a hung engine or a broken CUDA context: the next runs would only repeat it
            side.errors.append(f"checks skipped after: {fatal[0]}")
            clean_tokens.append(None)
            continue
        clean = check_run(model, workload, cb, recorder, side, "clean", health=health, layers=layers)
        poisoned = check_run(model, workload, cb, recorder, side, "nan", health=health, layers=layers)
        clean_tokens.append(clean[0] if clean else None)
        if clean and poisoned:
            side.tokens_identical_under_nan = clean[0] == poisoned[0]
            side.logits_bitwise_identical_under_nan = clean[1] == poisoned[1]
        log(
            f"  c={workload.concurrency}: tokens identical under NaN: {side.tokens_identical_under_nan}, "
            f"logits bitwise: {side.logits_bitwise_identical_under_nan}, non-finite logit rows "
            f"{side.nonfinite_logit_rows}, health {side.health}"
        )
    return clean_tokens


def _set_experts_implementation(model: nn.Module, name: str) -> None:
    """transformers reads config._experts_implementation at every experts forward."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = name


@dataclass
class Report:
    info: dict[str, Any]
    settings: dict[str, Any]
    rows: list[Row]

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for row in self.rows:
            data = asdict(row)
            data["speedup"] = row.speedup
            data["padded_rows_skipped"] = row.padded_rows_skipped
            rows.append(data)
        return {"suite": SUITE, **self.info, "settings": self.settings, "rows": rows}


def run_serving(
    *,
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    concurrencies: tuple[int, ...],
    cuda_graphs: bool,
    max_batch_tokens: int,
    page: int = 256,
    seed: int = 0,
    prompt_lengths: tuple[int, int] = PROMPT_LENGTHS,
    new_tokens: tuple[int, int] = NEW_TOKENS,
    force_padding: bool = False,
    q_padding_interval: int | None = None,
    backend: str = "auto",
    log: Callable[[str], None] = print,
    checkpoint: Callable[[Report], None] | None = None,
) -> Report:
    """Build the two models, run the timed and the check passes for both sides; see the module doc.
    checkpoint(report) is called after each phase (the report so far: results survive a time limit)."""
    from safemoe.demo_models import build_model
    from safemoe.integrations.transformers import patch, patched_blocks

    workloads = make_workloads(
        concurrencies, config.vocab_size, seed=seed, prompt_lengths=prompt_lengths, new_tokens=new_tokens
    )
    per_request = math.ceil((prompt_lengths[1] + new_tokens[1]) / page)
    num_blocks = max(concurrencies) * per_request + 16  # every request's cache fits at once, + headroom
    cb = cb_config(
        cuda_graphs=cuda_graphs,
        max_batch_tokens=max_batch_tokens,
        num_blocks=num_blocks,
        max_requests=max(concurrencies),
        page=page,
        q_padding_interval=q_padding_interval,
    )

    stock = build_model(config, device, dtype, seed)
    _set_experts_implementation(stock, "grouped_mm" if device.type == "cuda" else "eager")
    patched = copy.deepcopy(stock)
    health = Health(device)
    patch(patched, backend=backend, health=health)
    layers = len(patched_blocks(patched))

    rows = [
        Row(w.concurrency, len(w.prompts), sum(map(len, w.prompts)), w.generated, SideResult(), SideResult())
        for w in workloads
    ]
    settings = {
        "model": f"Qwen3-MoE, {config.num_hidden_layers} layers, E={config.num_experts}, "
        f"K={config.num_experts_per_tok}, H={config.hidden_size}, I={config.moe_intermediate_size}, "
        f"{config.num_attention_heads} q / {config.num_key_value_heads} kv heads x {config.head_dim}, "
        f"vocab {config.vocab_size}",
        "dtype": str(dtype).removeprefix("torch."),
        "cuda_graphs": cuda_graphs,
        "force_padding": force_padding,
        "stock_experts": getattr(stock.config, "_experts_implementation", None),
        "safemoe_backend": backend,
        "prompt_lengths": list(prompt_lengths),
        "new_tokens": list(new_tokens),
        "max_batch_tokens": max_batch_tokens,
        "num_blocks": num_blocks,
        "page": page,
        "seed": seed,
        "step_timing": "CUDA events around ModelRunner.compute_batch on the compute stream"
        if device.type == "cuda"
        else "perf_counter around ModelRunner.compute_batch",
        "engine": {},
        "phases_s": {},
        "transformers": __import__("transformers").__version__,
    }
    report = Report(run_info(device), settings, rows)
    recorder = StepRecorder(force_padding=force_padding)
    began = time.perf_counter()

    def phase_done(name: str) -> None:
        settings["phases_s"][name] = round(time.perf_counter() - began, 1)
        settings["engine"] = recorder.engine or {"note": recorder.note or "no engine step recorded"}
        if checkpoint is not None:
            checkpoint(report)

    with recorder.active():
        for name, model, side_health in (("stock", stock, None), ("safemoe", patched, health)):
            log(f"{name}: timed pass (after an untimed warm-up pass)")
            sides = [getattr(r, name) for r in rows]
            timed_pass(model, workloads, cb, recorder, sides, health=side_health, layers=layers, log=log)
            phase_done(f"{name} timed")
        # safemoe's checks first: NaN in stock's padded rows may break its engine (or the device).
        log("safemoe: clean and NaN-injected runs")
        got = check_pass(
            patched, workloads, cb, recorder, [r.safemoe for r in rows], health=health, layers=layers, log=log
        )
        phase_done("safemoe checks")
        log("stock: clean and NaN-injected runs")
        want = check_pass(
            stock, workloads, cb, recorder, [r.stock for r in rows], health=None, layers=layers, log=log
        )
    for row, a, b in zip(rows, got, want, strict=True):
        if a is not None and b is not None:
            pairs = [(x, y) for ga, gb in zip(a, b, strict=True) for x, y in zip(ga, gb, strict=False)]
            row.tokens_equal_to_stock = sum(x == y for x, y in pairs) / max(1, len(pairs))
    if not recorder.available:
        log(f"per-step numbers unavailable: {recorder.note}")
    phase_done("stock checks")
    return report


# ----------------------------------------------------------------------------------------------
# Output: printed table, JSON, markdown, PNG
# ----------------------------------------------------------------------------------------------

HEADER = [
    "c",
    "gen tok",
    "stock tok/s",
    "safemoe tok/s",
    "x",
    "stock p50/p99 ms",
    "safemoe p50/p99 ms",
    "non-finite logit rows stock (clean/nan)",
    "safemoe (clean/nan)",
    "padded rows (health/expected)",
    "skipped",
    "safemoe nonfinite_rows (nan)",
    "safemoe same tokens / logits bits under NaN",
    "stock same tokens / logits bits under NaN",
    "= stock",
    "errors",
]


def _f(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _yn(value: bool | None) -> str:
    return "n/a" if value is None else ("yes" if value else "NO")


def table_rows(report: Report) -> list[list[str]]:
    body = []
    for r in report.rows:
        s, m = r.stock, r.safemoe
        padded = (
            " ".join(
                f"{run}:{m.health.get(run, {}).get('padded_rows', 'n/a')}/{want}"
                for run, want in m.expected_padded_rows.items()
            )
            or "n/a"
        )
        body.append(
            [
                str(r.concurrency),
                str(r.generated_tokens),
                _f(s.tokens_per_s, 0),
                _f(m.tokens_per_s, 0),
                _f(r.speedup, 2),
                f"{_f(s.step_ms_p50, 2)}/{_f(s.step_ms_p99, 2)}",
                f"{_f(m.step_ms_p50, 2)}/{_f(m.step_ms_p99, 2)}",
                f"{s.nonfinite_logit_rows.get('clean', 'n/a')}/{s.nonfinite_logit_rows.get('nan', 'n/a')}",
                f"{m.nonfinite_logit_rows.get('clean', 'n/a')}/{m.nonfinite_logit_rows.get('nan', 'n/a')}",
                padded,
                _yn(r.padded_rows_skipped),
                str(m.health.get("nan", {}).get("nonfinite_rows", "n/a")),
                f"{_yn(m.tokens_identical_under_nan)} / {_yn(m.logits_bitwise_identical_under_nan)}",
                f"{_yn(s.tokens_identical_under_nan)} / {_yn(s.logits_bitwise_identical_under_nan)}",
                _f(None if r.tokens_equal_to_stock is None else 100 * r.tokens_equal_to_stock, 1) + "%",
                "; ".join([f"stock {e}" for e in s.errors] + [f"safemoe {e}" for e in m.errors]),
            ]
        )
    return body


def title(report: Report) -> str:
    return (
        f"safemoe serving bench on {report.info.get('device')} ({report.info.get('date')}): "
        f"{report.settings['model']}, {report.settings['dtype']}, CUDA graphs "
        f"{'on' if report.settings['cuda_graphs'] else 'off'}"
    )


def print_report(report: Report) -> None:
    body = table_rows(report)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title(report))
        for line in [HEADER, *body]:
            print(" | ".join(line))
        return
    table = Table(title=title(report))
    for name in HEADER:
        table.add_column(name, overflow="fold")
    for line in body:
        table.add_row(*line)
    Console(width=250).print(table)


def markdown(report: Report) -> str:
    lines = [f"# {title(report)}", ""]
    lines += [f"- {k}: {v}" for k, v in report.settings.items()]
    lines += ["", "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += [
        "| " + " | ".join(cell.replace("|", "/") for cell in line) + " |" for line in table_rows(report)
    ]
    lines += [
        "",
        "tok/s: generated tokens / wall from submission to the last result (timed pass, after a "
        "warm-up pass). p50/p99: per engine step (compute_batch), ms. Padded rows: safemoe's health "
        "PADDED_ROWS / layers x the engine's padding, per run (timed, clean, nan). nan: NaN written "
        "into the padded rows of every attention output.",
        "",
    ]
    return "\n".join(lines)


def plot(report: Report, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"plot skipped ({path.name}): matplotlib is not installed")
        return None
    xs = [r.concurrency for r in report.rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for name, color in (("stock", "C0"), ("safemoe", "C1")):
        sides = [getattr(r, name) for r in report.rows]
        tps = [s.tokens_per_s if s.tokens_per_s is not None else math.nan for s in sides]
        left.plot(xs, tps, marker="o", color=color, label=name)
        p50 = [s.step_ms_p50 if s.step_ms_p50 is not None else math.nan for s in sides]
        p99 = [s.step_ms_p99 if s.step_ms_p99 is not None else math.nan for s in sides]
        right.plot(xs, p50, marker="o", color=color, label=f"{name} p50")
        right.plot(xs, p99, marker="x", linestyle="--", color=color, label=f"{name} p99")
    for ax, ylabel in ((left, "generated tokens/s"), (right, "step latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title(report), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(report: Report, out_dir: Path, *, final: bool = True) -> None:
    """serving.json and serving.md; when final, also the printed table and serving.png."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{SUITE}.json").write_text(json.dumps(report.to_dict(), indent=1, default=str) + "\n")
    (out_dir / f"{SUITE}.md").write_text(markdown(report))
    if final:
        print_report(report)
        plot(report, out_dir / f"{SUITE}.png")


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _concurrency(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in names_list(text))
    except ValueError:
        values = ()
    if not values or any(v < 1 or v > 4096 for v in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated integers in [1, 4096], got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m safemoe.bench.serving", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=output_dir, default=Path("bench-out/serving"), help="results directory")
    parser.add_argument("--layers", type=int_in(1, 48), default=4, help="decoder layers (default 4)")
    parser.add_argument(
        "--concurrency",
        type=_concurrency,
        default=None,
        help=f"concurrency levels (default {','.join(map(str, CONCURRENCY))})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"concurrency {','.join(map(str, QUICK_CONCURRENCY))} unless --concurrency is given",
    )
    parser.add_argument(
        "--max-batch-tokens", type=int_in(16), default=2048, help="engine token budget per step"
    )
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run the engine eagerly (no padding)")
    parser.add_argument("--seed", type=int_in(0), default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the serving bench needs a CUDA GPU; nothing run (this machine has no CUDA device).")
        return 0
    from safemoe.demo_models import load_config

    config = load_config("gpu", args.layers)
    config.vocab_size = VOCAB
    concurrencies = args.concurrency or (QUICK_CONCURRENCY if args.quick else CONCURRENCY)
    report = run_serving(
        config=config,
        device=torch.device("cuda", torch.cuda.current_device()),
        dtype=torch.bfloat16,
        concurrencies=concurrencies,
        cuda_graphs=not args.no_cuda_graphs,
        max_batch_tokens=args.max_batch_tokens,
        seed=args.seed,
        checkpoint=lambda partial: write_report(partial, args.out, final=False),
    )
    write_report(report, args.out)
    failed = any(r.stock.errors or r.safemoe.errors for r in report.rows)
    return 1 if failed and all(r.safemoe.tokens_per_s is None for r in report.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
