"""Expert parallelism over torch.distributed (NCCL on GPUs, gloo on CPU). See docs/distributed.md.

- `EPMoE`: an MoE layer whose E experts are split into contiguous blocks of E / world per rank;
  each rank routes its own tokens, sends the token rows to the ranks owning their experts with
  all-to-all, computes its local experts, sends the results back and combines them.
- `ep_experts`: the same exchange as a function of (x, local weights, routing with global ids).
- `common_bucket` / `pad_to_common_bucket`: data-parallel padding to the largest batch of any
  rank, agreed with an all_reduce(MAX) on the device.
- `spawn`: start a process group of N local processes (tests, benchmarks), collectives with a
  timeout so a bug fails instead of hanging.

Kept as a submodule (`import safemoe.distributed`): importing it touches torch.distributed only.
"""

from safemoe.distributed.bucket import common_bucket, pad_to_common_bucket
from safemoe.distributed.ep import MODES, EPLayout, EPMoE, ep_experts
from safemoe.distributed.launch import free_port, spawn

__all__ = [
    "MODES",
    "EPLayout",
    "EPMoE",
    "common_bucket",
    "ep_experts",
    "free_port",
    "pad_to_common_bucket",
    "spawn",
]
