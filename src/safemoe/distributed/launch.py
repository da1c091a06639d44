"""Start a process group of local processes: tests, benchmarks, small single-host jobs.

`spawn(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in `world_size` fresh processes
(start method "spawn": safe with CUDA), each joined to one process group (gloo, or NCCL with rank r
on cuda:r) whose collectives time out after `timeout_s`, so a mismatched collective fails instead
of hanging; the whole group is killed after `join_timeout_s` as a last resort (a collective
captured in a CUDA graph has no watchdog). Returns the ranks' return values in rank order
(they must be picklable).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    result_dir: str,
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # world_size processes share the host's cores
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **kwargs
    )
    try:
        result = fn(rank, world_size, *args)
        path = Path(result_dir) / f"{rank}.pkl"
        path.with_suffix(".tmp").write_bytes(pickle.dumps(result))
        path.with_suffix(".tmp").rename(path)
        # Every rank past its last collective before any tears the group down: a gloo rank whose
        # peer closed its connections mid-teardown aborted ("terminate called without an active
        # exception", SIGABRT) in ~1 of 5 two-rank runs of the ep check on CPU.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and the result on disk: leave without the interpreter's teardown, where gloo's threads
    # still aborted a rank now and then (~1 in 30 runs of the CPU ep family with the barrier).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    join_timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return their results.

    fn must be importable by name (a module-level function). backend: "gloo" (CPU) or "nccl"
    (rank r on cuda:r). timeout_s: the process group's collective timeout. join_timeout_s: kill
    every rank after this long (default 10 x timeout_s) and raise TimeoutError. env: extra
    environment variables for the ranks. A rank that raises makes this raise (torch's
    ProcessRaisedException, with the rank's traceback) after the other ranks are stopped.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        found = torch.cuda.device_count()
        raise RuntimeError(f"nccl with {world_size} ranks needs {world_size} GPUs, found {found}")
    deadline = time.monotonic() + (10 * timeout_s if join_timeout_s is None else join_timeout_s)
    with tempfile.TemporaryDirectory(prefix="safemoe-spawn-") as result_dir:
        context = torch.multiprocessing.start_processes(
            _entry,
            args=(fn, world_size, free_port(), backend, timeout_s, result_dir, args, dict(env or {})),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} spawned ranks still running at the join timeout")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(timeout=10)
        return [pickle.loads((Path(result_dir) / f"{rank}.pkl").read_bytes()) for rank in range(world_size)]
