import os

# The Triton interpreter must be chosen before triton is imported (see safemoe._triton); on a GPU
# machine the kernels are compiled instead.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest

from helpers import DEVICES, device_param  # after TRITON_INTERPRET is settled


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "memcheck: small CUDA cases also run under compute-sanitizer (see tests/memcheck.py)"
    )


# Modules that run `safemoe check` / `safemoe bench` in-process. On CUDA they try to capture peers
# that cannot be captured (torch eager routing, transformers' loops); a capture that fails leaves
# torch's default CUDA generator flagged mid-capture, and every later `torch.randn(..., device=
# "cuda")` in the process raises "Offset increment outside graph capture" (seen on an H100 once
# the per-op modules' cuda cases ran after them). They run last; the kernels' own tests first.
_RUN_LAST = ("test_check_cli.py", "test_check_matrix.py", "test_bench_harness.py", "test_demo.py")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        items.sort(key=lambda item: item.path.name in _RUN_LAST)  # stable: order kept otherwise
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=[device_param(name) for name in DEVICES])
def device(request) -> str:
    """Where a Triton test runs: "cpu" under the Triton interpreter (CUDA-less machines), "cuda"
    compiled on a GPU; the one this machine cannot run is skipped with the reason. Tests whose
    shapes differ per device parametrise "device" themselves with helpers.by_device."""
    return request.param
