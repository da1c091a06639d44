"""Serving engines: the real-token count of each batch reaches every patched MoE block as `num_valid`.

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda")
    patch(model)                                       # installs the tracker below (track_real_tokens)
    model.generate_batch(prompts, continuous_batching_config=ContinuousBatchingConfig(use_cuda_graph=True))

What the engine passes. transformers' continuous batching (`generate_batch`,
`ContinuousBatchingManager`, `transformers serve`; checked against 5.17 and 5.23) flattens the
scheduled requests into one row of query tokens, `input_ids` [1, T], real tokens first. Under CUDA
graphs or `torch.compile` it pads T up to a multiple of `q_padding_interval_size` (a power of two on
the decode fast path) and pads the request list with empty requests, so `cu_seq_lens_q`, the
cumulative query lengths it passes to the model forward, plateaus: its last entry is the number of
real tokens, never the padded T. `cu_seq_lens_q` is a slice of a static int32 buffer on the model's
device (`ContinuousBatchingIOs.cumulative_seqlens_q`) that the engine rewrites before every step;
its length depends only on the padded T (the graph key), so a captured graph always reads the same
element, which holds the current step's count at every replay.

What safemoe does. A forward pre-hook on the module `patch()` was given (the top-level model) reads
`cu_seq_lens_q` from the forward's keyword arguments and puts `cu_seq_lens_q[-1]`, a 0-dim view of
the engine's own buffer (no copy, no `.item()`, no host sync), into the model's shared
`PaddingState.num_valid` for the duration of that forward; a forward hook (`always_call`, so also
after an exception) clears it. Every patched block passes it to `safemoe.MoE`, whose kernels load it
on the device and clamp it to [0, T]: rows at or past it are never routed or computed, come out as
exact zeros, and are counted in the `PADDED_ROWS` health slot (T - count per block per step).

- CUDA graphs: the captured kernels read the engine's buffer element at replay, so the count follows
  every step without Python running.
- `torch.compile`: the hooks are traced with the model; `cu_seq_lens_q[-1]` is a graph op on a
  graph input, and setting/clearing the Python attribute is a side effect dynamo replays.
- An engine that does not pad (no graphs, no compile): the count is T, nothing is skipped.
- No count (plain `generate`, `model(...)`, a `cu_seq_lens_q` that is not a 1-D integer tensor, a
  batch of more than one row): `num_valid` stays None, every row is valid, as before.

Precedence: a count set explicitly with `set_num_valid(model, n)` (not None) wins over the engine's
count for every forward until `set_num_valid(model, None)`; the tracker only ever writes a state
that is None, and only clears what it wrote.

Limits:
- The count says "the first n rows of the flattened input are real". That is how transformers' engine
  lays out a batch; an engine that interleaves padding, or passes `cu_seq_lens_q` describing
  something else, must call `set_num_valid` itself.
- One device: if a patched block's weights are not on the device of `cu_seq_lens_q` (a model split
  over GPUs with `device_map`, offloaded weights), the tracker passes no count (all rows valid, as
  before) rather than a tensor on the wrong device. It remembers one parameter per block; after
  re-dispatching a patched model over several devices, call `track_real_tokens(model)` again.
- Only the MoE blocks skip padded rows; attention, norms and dense MLPs still compute them (the
  engine discards their outputs). The MoE never reads them, so whatever they hold (NaN from
  attention over an empty slot) cannot reach a router or an address.
- One count per model object: two engines driving the same model object from two threads at once
  would share it (transformers runs one generation thread per manager).
- vLLM and SGLang do not call a transformers forward; they need their own glue around `safemoe.MoE`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Keyword arguments of a model forward that carry the cumulative query lengths of a packed batch
# (transformers continuous batching, 5.17-5.23); the first one present is used.
COUNT_KWARGS: tuple[str, ...] = ("cu_seq_lens_q",)

_INT_DTYPES = (torch.int32, torch.int64)


class RealTokenTracker:
    """The pair of hooks `track_real_tokens` installs on a model; `remove()` takes them off.

    state: the object every patched block reads `num_valid` from (a `PaddingState`).
    """

    def __init__(self, model: nn.Module, state: Any) -> None:
        self.state = state
        self._mine: torch.Tensor | None = None  # the count this tracker wrote into the state
        self._blocks: list[nn.Module] = []
        self._params: list[torch.Tensor] = []  # one parameter per block: where it runs
        self.refresh(model)
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, always_call=True),
        ]

    def refresh(self, model: nn.Module) -> None:
        """Find the modules that read `state` (their devices are checked at each forward)."""
        self._blocks = [m for m in model.modules() if getattr(m, "state", None) is self.state]
        self._refresh_params()

    def _refresh_params(self) -> None:
        firsts = (next(block.parameters(), None) for block in self._blocks)
        self._params = [p for p in firsts if p is not None]

    def _on(self, device: torch.device) -> bool:
        """Whether every block runs on `device`. A few µs: one cached parameter per block; looked up
        again (a parameter replaced since, e.g. by quantize_) before saying no."""
        if all(p.device == device for p in self._params):
            return True
        self._refresh_params()
        return all(p.device == device for p in self._params)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def count(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The real-token count of this forward as a 0-dim device tensor, or None (all rows valid)."""
        cu = next((kwargs[k] for k in COUNT_KWARGS if kwargs.get(k) is not None), None)
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() == 0:
            return None
        if cu.dtype not in _INT_DTYPES:
            return None
        rows = kwargs.get("input_ids")
        if rows is None:
            rows = kwargs.get("inputs_embeds")
        if rows is None and args and isinstance(args[0], torch.Tensor):
            rows = args[0]
        if isinstance(rows, torch.Tensor) and rows.dim() >= 2 and rows.shape[0] != 1:
            return None  # not one packed row of tokens: the count would not describe the flattened rows
        if not self._on(cu.device):
            return None
        return cu[-1]  # a view: reads the engine's buffer when the kernels run (graph replays too)

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        current = self.state.num_valid
        if current is not None and current is not self._mine:
            return None  # set explicitly with set_num_valid: the user's count wins
        count = self.count(args, kwargs)
        self.state.num_valid = count
        self._mine = count
        return None

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._mine is not None and self.state.num_valid is self._mine:
            self.state.num_valid = None
        self._mine = None
        return None


def track_real_tokens(model: nn.Module, state: Any = None) -> RealTokenTracker:
    """Install (once) the hooks that pass a serving engine's real-token count to every patched block.

    `patch()` calls this; call it yourself only for a model whose blocks read another shared state
    (any object with a `num_valid` attribute). Idempotent: a second call refreshes the list of
    blocks and returns the same tracker.
    """
    if state is None:
        state = getattr(model, "_safemoe_state", None)
        if state is None:
            raise ValueError(f"{type(model).__name__} is not patched by safemoe (call patch(model) first)")
    tracker = getattr(model, "_safemoe_tracker", None)
    if isinstance(tracker, RealTokenTracker) and tracker.state is state and tracker._handles:
        tracker.refresh(model)
        return tracker
    if isinstance(tracker, RealTokenTracker):
        tracker.remove()
    tracker = RealTokenTracker(model, state)
    model.__dict__["_safemoe_tracker"] = tracker
    return tracker


def untrack_real_tokens(model: nn.Module) -> None:
    """Remove the hooks `track_real_tokens` installed (the engine's count is no longer read)."""
    tracker = model.__dict__.pop("_safemoe_tracker", None)
    if isinstance(tracker, RealTokenTracker):
        tracker.remove()
