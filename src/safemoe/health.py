"""Layout of the health counter tensor.

A health tensor is an int64 device tensor of `HEALTH_SLOTS` elements that kernels add to with
atomics, never reading it back to the host, so it works inside a captured CUDA graph and
accumulates across replays. Pass the same tensor to every op of a layer (or of a whole model)
and read it whenever convenient.

| slot | name | counts |
|---|---|---|
| 0 | `NONFINITE_ROWS` | valid router rows that held at least one NaN or +-Inf logit |
| 1 | `DROPPED_SLOTS` | (token, k) slots of valid rows whose expert id was outside [0, E) and was dropped |
| 2 | `PADDED_ROWS` | rows at or past `num_valid` seen by the router (each call adds T - num_valid) |
| 3 | `EP_OVERFLOW_SLOTS` | expert parallelism, capacity mode: slots not sent, their peer was full |
| 4..7 | reserved | kept zero for later counters |
"""

from __future__ import annotations

import torch

NONFINITE_ROWS = 0
DROPPED_SLOTS = 1
PADDED_ROWS = 2
EP_OVERFLOW_SLOTS = 3
HEALTH_SLOTS = 8

SLOT_NAMES = {
    NONFINITE_ROWS: "nonfinite_rows",
    DROPPED_SLOTS: "dropped_slots",
    PADDED_ROWS: "padded_rows",
    EP_OVERFLOW_SLOTS: "ep_overflow_slots",
}


def new_health_tensor(device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed health tensor (int64, `HEALTH_SLOTS` elements)."""
    return torch.zeros(HEALTH_SLOTS, dtype=torch.int64, device=device)


def check_health(health: torch.Tensor | None, device: torch.device) -> None:
    if health is None:
        return
    if not isinstance(health, torch.Tensor):
        raise TypeError(f"health must be a torch.Tensor or None, got {type(health).__name__}")
    if health.dtype != torch.int64 or health.dim() != 1 or health.numel() < HEALTH_SLOTS:
        raise ValueError(
            f"health must be an int64 tensor of at least {HEALTH_SLOTS} elements, "
            f"got {health.dtype=} {tuple(health.shape)=}"
        )
    if health.device != device:
        raise ValueError(f"health must be on {device}, got {health.device}")
    if not health.is_contiguous():
        raise ValueError("health must be contiguous")


class Health:
    """A health tensor with a readable face: pass `.tensor` (or the `Health` itself, where an op
    takes `health=`) to the ops of every layer, replay graphs as often as needed, then `.read()`.

    The kernels only ever add to `.tensor` on the device; `.read()` is the one host sync, made
    when the caller chooses (after a step, at the end of a benchmark), never inside a forward.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.tensor = new_health_tensor(device)

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def read(self) -> dict[str, int]:
        """Counter values by name (see SLOT_NAMES); copies the tensor to the host (syncs)."""
        values = self.tensor.tolist()
        return {name: int(values[slot]) for slot, name in SLOT_NAMES.items()}

    def reset(self) -> None:
        """Zero every counter in place (the tensor a captured graph holds stays the same)."""
        self.tensor.zero_()

    def __repr__(self) -> str:
        return f"Health(device={self.device})"
