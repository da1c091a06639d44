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


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
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
