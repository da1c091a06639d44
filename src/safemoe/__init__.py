"""safemoe: Mixture-of-Experts inference kernels that never crash and never leak NaN under
CUDA-graph batch padding. See docs/contract.md for the contract every op keeps."""

from safemoe._triton import configure_interpreter

# Must run before anything imports triton (see safemoe._triton).
configure_interpreter()

from safemoe.experts import experts  # noqa: E402
from safemoe.health import HEALTH_SLOTS, new_health_tensor  # noqa: E402
from safemoe.layer import moe  # noqa: E402
from safemoe.routing import Routing, route  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "HEALTH_SLOTS",
    "Routing",
    "__version__",
    "experts",
    "moe",
    "new_health_tensor",
    "route",
]
