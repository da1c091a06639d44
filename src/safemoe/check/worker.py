"""Running cases: one case in this process (`run_case`), and the worker process the runner spawns.

`python -m safemoe.check._worker_main CONFIG_JSON` reads jobs (one JSON object per line: a check, a
backend and case indices) from stdin and writes one event per line to stdout, each prefixed with
`PREFIX`: `ready`, then per case `start` and `result`, then `done` per job. Anything else on stdout
(compute-sanitizer's reports, a backend's prints) is passed through for the runner to read. After
every case on CUDA the device is probed (synchronise, a tiny kernel): a failing probe means the
context is poisoned (an illegal memory access is sticky), so the case is reported crashed and the
worker exits with `POISONED_EXIT` for the runner to start a fresh one.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from safemoe.check.adapters import BROKEN, NOT_BUILT, Adapter, make_adapter
from safemoe.check.registry import CASES, Case, CaseContext, CheckFailure, NotApplicable, all_cases, label

PREFIX = "@@safemoe-check "
POISONED_EXIT = 3
PASSED, FAILED, CRASHED, NA = "passed", "failed", "crashed", "n/a"
STATUSES = (PASSED, FAILED, CRASHED, NA)


@dataclass
class CaseResult:
    check: str
    backend: str
    case: int  # index in the check's parameter grid
    status: str  # passed, failed, crashed, n/a
    params: str = ""
    seconds: float = 0.0
    message: str = ""
    repro: str = ""

    @property
    def family(self) -> str:
        return self.check.split(".", 1)[0]


@dataclass
class WorkerConfig:
    device: str
    seed: int
    scale: int
    plugins: list[str]

    def to_json(self) -> str:
        return json.dumps(asdict(self))


# The plugins this process imported, in order: cases that start processes of their own (the ep
# family's ranks) import them there too.
LOADED_PLUGINS: list[str] = []


def load_plugin(spec: str) -> None:
    """Import a plugin: a path to a .py file, or a module name. It registers backends (and checks)."""
    if spec not in LOADED_PLUGINS:
        LOADED_PLUGINS.append(spec)
    path = Path(spec)
    if spec.endswith(".py") or path.is_file():
        name = f"safemoe_check_plugin_{abs(hash(str(path.resolve())))}"
        if name in sys.modules:
            return
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"cannot load plugin file {spec}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]  # a plugin that failed is not loaded: the next attempt runs it again
            raise
    else:
        importlib.import_module(spec)


def _where(error: BaseException) -> str:
    """file:line of the innermost frame of what a case raised (the crash site, not the check)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or isinstance(error, CheckFailure):
        return ""
    frame = frames[-1]
    return f" (at {Path(frame.filename).name}:{frame.lineno})"


def static_status(case: Case, adapter: Adapter, device: torch.device) -> tuple[str, str] | None:
    """(status, reason) when every case of `case` on `adapter` is decided without running it."""
    if case.cuda_only and device.type != "cuda":
        return NA, "needs CUDA"
    status = adapter.status_of(case.ops)
    if status.state == NOT_BUILT:
        return NA, status.detail
    if status.state == BROKEN:
        return FAILED, status.detail
    return None


def run_case(
    case: Case, adapter: Adapter, index: int, params: dict[str, Any], *, seed: int, scale: int
) -> CaseResult:
    """Run one case in this process; exceptions of the backend are failures, NotApplicable n/a."""
    result = CaseResult(case.name, adapter.name, index, PASSED, label(params))
    decided = static_status(case, adapter, adapter.device)
    if decided is not None:
        result.status, result.message = decided
        return result
    ctx = CaseContext(
        api=adapter, device=adapter.device, seed=seed, scale=scale, case_name=case.name, index=index
    )
    start = time.perf_counter()
    try:
        case.fn(ctx, **params)
    except NotApplicable as error:
        result.status, result.message = NA, str(error)
    except Exception as error:  # a backend that raises breaks the contract like a wrong value
        text = str(error) if isinstance(error, CheckFailure) else f"raised {type(error).__name__}: {error}"
        result.status, result.message = FAILED, text.strip().splitlines()[0][:500] + _where(error)
    result.seconds = time.perf_counter() - start
    return result


def probe_device(device: torch.device) -> str | None:
    """None when the device still works, else what went wrong (CUDA only; CPU has nothing to poison)."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        value = torch.ones(8, device=device).add_(1).sum()
        if float(value) != 16.0:
            return f"device probe computed {float(value)} instead of 16"
    except Exception as error:
        return f"device probe failed: {type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
    return None


def indexed_device(device: torch.device) -> torch.device:
    """CUDA tensors report `cuda:0`, never a bare `cuda`: give the device its index so outputs can be
    compared with it (a bare `cuda` made every check fail on the H200 run of 2026-11-21)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Runner:
    """Cases of jobs in this process, with adapters and parameter grids cached."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = indexed_device(torch.device(config.device))
        self.adapters: dict[str, Adapter] = {}
        self.grids: dict[str, list[dict[str, Any]]] = {}

    def adapter(self, name: str) -> Adapter:
        if name not in self.adapters:
            self.adapters[name] = make_adapter(name, self.device)
        return self.adapters[name]

    def grid(self, check: str) -> list[dict[str, Any]]:
        if check not in self.grids:
            self.grids[check] = CASES[check].grid(self.config.scale, self.device)
        return self.grids[check]

    def run_job(self, job: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> bool:
        """Run a job's cases ([check, index] items on one backend), emitting events; False when the
        device is poisoned (the caller must stop: nothing more can run in this process)."""
        adapter = self.adapter(job["backend"])
        for check, index in job["items"]:
            emit({"event": "start", "job": job["id"], "check": check, "case": index})
            result = run_case(
                CASES[check],
                adapter,
                index,
                self.grid(check)[index],
                seed=self.config.seed,
                scale=self.config.scale,
            )
            problem = probe_device(self.device)
            if problem is not None:
                ended = f"{result.status}: {result.message}" if result.message else result.status
                result.status, result.message = CRASHED, f"{problem} (after the case, which ended {ended})"
            emit({"event": "result", "job": job["id"], "result": asdict(result)})
            if problem is not None:
                return False
        if self.device.type == "cuda":  # bound what 12 workers' caching allocators keep between jobs
            torch.cuda.empty_cache()
        emit({"event": "done", "job": job["id"]})
        return True


def setup(config: WorkerConfig) -> None:
    """Process-wide settings every case runs under (also used in-process by the runner)."""
    if config.device == "cpu":
        # The shapes are tiny; on a busy small machine torch's spinning worker threads made the
        # reference up to 50x slower (12 s instead of 0.2 s for one case on 2 cores).
        torch.set_num_threads(1)
    # The Triton interpreter evaluates masked-out lanes too (exp of -FLT_MAX - FLT_MAX, ...) and
    # numpy warns about it; transformers warns about experts implementations on CPU.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    warnings.filterwarnings("ignore", category=UserWarning)
    for plugin in config.plugins:
        load_plugin(plugin)
    all_cases()  # register the built-in checks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = WorkerConfig(**json.loads(argv[0]))
    out = sys.stdout

    def emit(event: dict[str, Any]) -> None:
        out.write(PREFIX + json.dumps(event) + "\n")
        out.flush()

    setup(config)
    runner = Runner(config)
    emit({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        if not runner.run_job(json.loads(line), emit):
            return POISONED_EXIT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
