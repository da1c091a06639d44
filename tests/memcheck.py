"""Small CUDA cases under compute-sanitizer memcheck, in one command (not a test module).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python3 tests/memcheck.py
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/memcheck.py --graphs

Runs the router's small cases (`test_router.memcheck_cases`, also `python3 tests/test_router.py`)
and, through pytest in this process, the cuda variants of the cases marked `memcheck` in
test_experts.py, test_experts_fp8.py and test_dispatch.py (`-m "memcheck and gpu"`). The caching
allocator would hide out-of-bounds accesses inside its large blocks, so the first pass turns it
off; CUDA-graph capture needs it, so the cases named *graph* run only in a second pass with
--graphs. Exit status 1 when a case failed (memcheck adds its own errors via --error-exitcode).
These replace the drivers of the former tests/gpu/ files (`python3 tests/gpu/test_router_gpu.py`,
`pytest tests/gpu/test_experts_gpu.py -k small`, `pytest tests/gpu/test_experts_fp8_gpu.py -k
"small and not graph"`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MODULES = ("test_experts.py", "test_experts_fp8.py", "test_dispatch.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", action="store_true",
                        help="only the CUDA-graph cases (run without PYTORCH_NO_CUDA_MEMORY_CACHING)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(TESTS), str(TESTS.parent / "src")]  # a checkout, nothing installed

    import pytest
    import torch

    if not torch.cuda.is_available():
        print("memcheck: needs a CUDA GPU; nothing run")
        return 0
    failed = 0
    if not args.graphs:
        import test_router

        failed += test_router.memcheck_cases()
    rc = pytest.main([*(str(TESTS / name) for name in MODULES), "-m", "memcheck and gpu",
                      "-k", "graph" if args.graphs else "not graph", "-q", "-p", "no:cacheprovider",
                      *args.pytest_args])
    print(f"memcheck: router cases failed {failed}, pytest exit status {int(rc)}")
    return 1 if failed or rc not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) else 0


if __name__ == "__main__":
    sys.exit(main())
