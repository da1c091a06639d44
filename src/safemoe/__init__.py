"""safemoe: Mixture-of-Experts inference kernels that never crash and never leak NaN under
CUDA-graph batch padding. See docs/contract.md for the contract every op keeps."""

from safemoe._triton import configure_interpreter

# Must run before anything imports triton (see safemoe._triton).
configure_interpreter()

from safemoe.experts import experts  # noqa: E402
from safemoe.fp8 import dequantize_experts, quantize_experts  # noqa: E402
from safemoe.graphs import CUDAGraphRunner  # noqa: E402
from safemoe.health import HEALTH_SLOTS, Health, new_health_tensor  # noqa: E402
from safemoe.layer import MoE, moe  # noqa: E402
from safemoe.padding import zero_padding_  # noqa: E402
from safemoe.route_config import RouteConfig  # noqa: E402
from safemoe.routing import Routing, route  # noqa: E402
from safemoe.workspace import Workspace, workspace_bytes  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "HEALTH_SLOTS",
    "CUDAGraphRunner",
    "Health",
    "MoE",
    "RouteConfig",
    "Routing",
    "Workspace",
    "__version__",
    "dequantize_experts",
    "experts",
    "moe",
    "new_health_tensor",
    "quantize_experts",
    "route",
    "workspace_bytes",
    "zero_padding_",
]
