"""`safemoe soak`: replay one captured MoE step many times with fresh adversarial inputs every
replay, and count contract violations on the device.

One step (captured once in a CUDA graph on a GPU; run eagerly on CPU) draws, on the device:
- a valid count n in [0, T] (a 0-dim device tensor: the graph replays with any count);
- x [T, H]: random rows, about 1 in 8 valid rows poisoned with NaN/+-Inf entries, and every
  padded row (>= n) filled with garbage (NaN, +-Inf, huge values);
- routing ids [T, K] for the experts op: random experts, with duplicates, -1, negative, >= E and
  stale (123456789) ids mixed into valid rows and anything at all in padded rows;
then runs the layer (`MoE`: router + experts) and the experts op on those ids, twice each: the
second time with the padded rows of x (and ids) re-drawn. It adds to a violation counter per
invariant, all on the device (no host sync per replay):

| invariant | what is counted |
|---|---|
| `padded_rows_nonzero` | output rows >= n that are not exact zeros (layer or experts) |
| `padding_leaks` | valid rows whose bits change when only the padding changed |
| `nonfinite_clean_rows` | valid rows with finite x (and served ids) whose output is not finite |
| `route_ids` | layer router: valid rows without K distinct ids in [0, E), padded rows not all -1 |
| `dropped_slots` | experts: health DROPPED_SLOTS differs from the bad ids drawn in valid rows |

After the replays it reads the counters once and compares `torch.cuda.memory_allocated()` before
and after the replays (they must be equal: nothing allocated per replay).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from safemoe.cli import UsageError, int_in, output_file, prepare_output, reports_usage_errors
from safemoe.graphs import warm_up
from safemoe.health import DROPPED_SLOTS, HEALTH_SLOTS
from safemoe.layer import MoE
from safemoe.routing import Routing

INVARIANTS = ("padded_rows_nonzero", "padding_leaks", "nonfinite_clean_rows", "route_ids", "dropped_slots")
STALE_ID = 123456789
# The soak layer: Qwen3-30B-A3B's routing (E=128, K=8) at a small H/I so a replay is cheap.
SHAPES = {"qwen3": (128, 8, 256, 128), "deepseek_v3": (256, 8, 256, 128), "mixtral": (8, 2, 256, 512)}
DEFAULT_REPLAYS = {"cuda": 100_000, "cpu": 300}
DEFAULT_TOKENS = {"cuda": 256, "cpu": 16}  # the reference on CPU loops over experts: keep T small


@dataclass
class SoakReport:
    device: str
    model: str
    max_tokens: int
    replays: int
    graphed: bool
    seconds: float
    violations: dict[str, int]
    memory_before: int
    memory_after: int
    seed: int
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return sum(self.violations.values()) == 0 and self.memory_before == self.memory_after


class _Step:
    """The per-replay work; every tensor it touches is allocated in __init__ (graph-static)."""

    def __init__(self, model: str, max_tokens: int, device: torch.device, seed: int) -> None:
        num_experts, top_k, hidden, inter = SHAPES[model]
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.E, self.K, self.H, self.T = num_experts, top_k, hidden, max_tokens
        torch.manual_seed(seed)
        self.layer = MoE(hidden, inter, num_experts, top_k, dtype=dtype, device=device).eval()
        self.health = torch.zeros(HEALTH_SLOTS, dtype=torch.int64, device=device)
        self.violations = torch.zeros(len(INVARIANTS), dtype=torch.int64, device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.x = torch.empty(max_tokens, hidden, dtype=dtype, device=device)
        self.ids = torch.empty(max_tokens, top_k, dtype=torch.int32, device=device)
        self.weights = torch.empty(max_tokens, top_k, dtype=torch.float32, device=device)
        self.num_valid = torch.zeros((), dtype=torch.int32, device=device)
        self.rows = torch.arange(max_tokens, device=device)
        self.bad_ids = torch.tensor([-1, -7, num_experts, num_experts + 5, STALE_ID], dtype=torch.int32,
                                    device=device)  # fmt: skip
        self.garbage = torch.tensor([math.nan, math.inf, -math.inf, 3.0e38, -3.0e38], dtype=dtype,
                                    device=device)  # fmt: skip

    # -- drawing (device only) --------------------------------------------------------------------
    def _pick(self, table: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        index = torch.randint(0, table.numel(), shape, device=table.device, generator=self.generator)
        return table[index]

    def _draw_padding(self, valid: torch.Tensor) -> None:
        pad = ~valid
        self.x.copy_(torch.where(pad[:, None], self._pick(self.garbage, tuple(self.x.shape)), self.x))
        stale = self._pick(self.bad_ids, tuple(self.ids.shape))
        self.ids.copy_(torch.where(pad[:, None], stale, self.ids))

    def _draw(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen, dev = self.generator, self.x.device
        self.num_valid.copy_(torch.randint(0, self.T + 1, (), device=dev, generator=gen))
        valid = self.rows < self.num_valid
        x = torch.randn(self.x.shape, device=dev, generator=gen).to(self.x.dtype)
        poisoned_row = (torch.rand(self.T, device=dev, generator=gen) < 0.125) & valid
        poison = self._pick(self.garbage[:3], tuple(self.x.shape))
        entry = torch.rand(self.x.shape, device=dev, generator=gen) < 0.05
        self.x.copy_(torch.where(poisoned_row[:, None] & entry, poison, x))
        ids = torch.randint(0, self.E, tuple(self.ids.shape), device=dev, generator=gen, dtype=torch.int32)
        bad = torch.rand(tuple(self.ids.shape), device=dev, generator=gen) < 0.1
        self.ids.copy_(torch.where(bad, self._pick(self.bad_ids, tuple(self.ids.shape)), ids))
        self.weights.copy_(torch.rand(tuple(self.weights.shape), device=dev, generator=gen))
        self._draw_padding(valid)
        return valid, poisoned_row, bad & valid[:, None]

    # -- one replay -----------------------------------------------------------------------------------
    def _count(self, name: str, amount: torch.Tensor) -> None:
        self.violations[INVARIANTS.index(name)] += amount.to(torch.int64)

    def __call__(self) -> None:
        valid, poisoned_row, bad_slots = self._draw()
        clean_row = valid & ~poisoned_row
        dropped_before = self.health[DROPPED_SLOTS].clone()
        routing = Routing(weights=self.weights, ids=self.ids)
        experts_out = self._experts(routing)
        dropped = self.health[DROPPED_SLOTS] - dropped_before
        self._count("dropped_slots", (dropped != bad_slots.sum()).to(torch.int64))
        layer_out = self.layer(self.x, num_valid=self.num_valid)
        weights, ids = self.layer.gate(self.x, self.num_valid)

        for out in (experts_out, layer_out):
            self._count("padded_rows_nonzero", ((out != 0).any(dim=1) & ~valid).sum())
        self._count("nonfinite_clean_rows", ((~torch.isfinite(layer_out)).any(dim=1) & clean_row).sum())
        served_clean = clean_row & ~bad_slots.any(dim=1)
        self._count("nonfinite_clean_rows", ((~torch.isfinite(experts_out)).any(dim=1) & served_clean).sum())
        in_range = ((ids >= 0) & (ids < self.E)).all(dim=1)
        ordered = torch.sort(ids, dim=1).values
        distinct = (ordered[:, 1:] != ordered[:, :-1]).all(dim=1)
        self._count("route_ids", (valid & ~(in_range & distinct)).sum())
        self._count("route_ids", (~valid & (ids != -1).any(dim=1)).sum())
        self._count("route_ids", (~torch.isfinite(weights).all(dim=1) & valid).sum())

        # Only the padding changes: valid rows must keep their bits.
        self._draw_padding(valid)
        again_experts = self._experts(routing)
        again_layer = self.layer(self.x, num_valid=self.num_valid)
        for first, second in ((experts_out, again_experts), (layer_out, again_layer)):
            same = (first.view(torch.int16 if first.element_size() == 2 else torch.int32)
                    == second.view(torch.int16 if second.element_size() == 2 else torch.int32)).all(dim=1)
            self._count("padding_leaks", (valid & ~same).sum())

    def _experts(self, routing: Routing) -> torch.Tensor:
        from safemoe.experts import experts

        return experts(self.x, self.layer.w13, self.layer.w2, routing, num_valid=self.num_valid,
                       health=self.health, workspace=self.layer.workspace)  # fmt: skip


def soak(*, replays: int | None = None, device: str = "auto", model: str = "qwen3",
         max_tokens: int | None = None, seed: int = 0) -> SoakReport:
    """Run the soak (see the module docstring) and return its report."""
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if model not in SHAPES:
        raise ValueError(f"model must be one of {sorted(SHAPES)}, got {model!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: no CUDA device here")
    replays = DEFAULT_REPLAYS[dev.type] if replays is None else replays
    max_tokens = DEFAULT_TOKENS[dev.type] if max_tokens is None else max_tokens
    if replays < 1 or max_tokens < 1:
        raise ValueError(f"replays and max_tokens must be >= 1, got {replays} and {max_tokens}")
    step = _Step(model, max_tokens, dev, seed)
    if dev.type == "cuda":  # one workspace, allocated before capture (no allocation per replay)
        from safemoe.workspace import Workspace

        num_experts, top_k, hidden, inter = SHAPES[model]
        step.layer.set_workspace(Workspace(max_tokens, num_experts, top_k, hidden, inter, step.x.dtype, dev))
    notes: list[str] = []
    with torch.no_grad():
        step()  # warm-up: Triton compilation, cuBLAS workspaces (its counts are part of the total)
        graph = None
        if dev.type == "cuda":
            torch.cuda.synchronize()
            warm_up(step)
            graph = torch.cuda.CUDAGraph()
            graph.register_generator_state(step.generator)
            with torch.cuda.graph(graph):
                step()
            torch.cuda.synchronize()
        memory_before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        start = time.perf_counter()
        # Replays so far: the warm-up (and on a GPU the side-stream warm-up; capture runs nothing).
        for _ in range(max(0, replays - (2 if graph is not None else 1))):
            if graph is not None:
                graph.replay()
            else:
                step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        memory_after = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    counts = step.violations.tolist()  # the one host read
    if graph is None:
        notes.append("eager on CPU (no CUDA graph): the same step and invariants, backend reference")
    return SoakReport(device=str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev), model=model,
                      max_tokens=max_tokens, replays=replays, graphed=graph is not None, seconds=seconds,
                      violations=dict(zip(INVARIANTS, counts, strict=True)), memory_before=memory_before,
                      memory_after=memory_after, seed=seed, notes=notes)  # fmt: skip


# -- the `safemoe soak` subcommand ----------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replays", type=int_in(1), default=None,
                        help="replays (default: 100000 on a GPU, 300 eagerly on CPU)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen3", help="routing shape (E, K)")
    parser.add_argument("--max-tokens", type=int_in(1), default=None,
                        help="T of the captured step (default: 256 on a GPU, 16 on CPU)")
    parser.add_argument("--seed", type=int_in(0), default=0)
    parser.add_argument("--json", type=output_file, default=None, help="also write the report here")


@reports_usage_errors("soak")
def run(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device", "cuda: no CUDA device here")
    if args.json is not None:
        prepare_output(args.json, "soak", "--json")
    report = soak(replays=args.replays, device=args.device, model=args.model, max_tokens=args.max_tokens,
                  seed=args.seed)  # fmt: skip
    verdict = "OK" if report.ok else "VIOLATIONS"
    print(f"safemoe soak: {verdict}: {report.replays} replays of the {report.model} step "
          f"(T={report.max_tokens}) on {report.device} ({'CUDA graph' if report.graphed else 'eager'}), "
          f"{report.seconds:.1f} s")
    for name, count in report.violations.items():
        print(f"  {name:22s} {count}")
    print(f"  memory allocated       before {report.memory_before} B, after {report.memory_after} B")
    for note in report.notes:
        print(f"  note: {note}")
    if args.json is not None:
        payload: dict[str, Any] = asdict(report)
        payload["ok"] = report.ok
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if report.ok else 1
