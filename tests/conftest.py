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

from helpers import DEVICES, device_param, in_test_shard, parse_test_shard  # after TRITON_INTERPRET


def pytest_addoption(parser):
    parser.addoption(
        "--test-shard", default=None, metavar="K/N",
        help="run the K-th of N disjoint parts of the collected tests (a stable hash of each test id), "
        "so N runs cover the suite once: the GPU suite takes longer than one device call",
    )  # fmt: skip


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

    shard = config.getoption("--test-shard")
    if shard is not None:
        try:
            part = parse_test_shard(shard)
        except ValueError as error:
            raise pytest.UsageError(f"--test-shard: {error}") from None
        kept, dropped = [], []
        for item in items:
            (kept if in_test_shard(item.nodeid, part) else dropped).append(item)
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept

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
