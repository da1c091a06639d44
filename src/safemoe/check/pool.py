"""Crash isolation: cases run in spawned worker processes (`safemoe.check.worker`), a few at a time.

A CUDA illegal memory access poisons the process that made it, a segfault kills it, a hang never
returns; `pytest --forked` style isolation cannot survive the first two on CUDA. So jobs (a check,
a backend, a list of case indices) go to worker processes, each started fresh with `spawn`
semantics (a new interpreter, not a fork), fed jobs one after another over stdin. When a worker
dies or stays silent past the timeout, the case it was running is recorded CRASHED (with the exit
status or signal and the last lines it printed), the device is probed from a new process (CUDA),
and the rest of the job goes to a fresh worker; after `max_crashes` crashes of one check on one
backend its remaining cases are recorded crashed without running (each respawn costs seconds).

With a sanitizer command (compute-sanitizer memcheck) every job gets its own process under it, so
its `ERROR SUMMARY` belongs to one backend; an error report printed while a case runs fails that
case.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from safemoe.check.worker import CRASHED, FAILED, PASSED, POISONED_EXIT, PREFIX, CaseResult, WorkerConfig

# compute-sanitizer lines: an error report starts with "========= " and a non-space; details are
# indented; the banner, the summary and the exit notes are not errors.
_SANITIZER_HEADER = re.compile(
    r"^========= (?!ERROR SUMMARY|COMPUTE-SANITIZER|Target application returned|"
    r"Error: process didn't terminate|Warning|Note|LEAK SUMMARY)\S"
)
_SANITIZER_SUMMARY = re.compile(r"^========= ERROR SUMMARY: (\d+) error")
PROBE_CODE = (
    "import torch; x = torch.ones(8, device='cuda').add_(1); torch.cuda.synchronize(); "
    "assert float(x.sum()) == 16.0; print('probe ok')"
)


Item = tuple[str, int]  # (check, case index)


@dataclass
class Job:
    id: int
    backend: str
    items: list[Item]  # cases, in order
    env: dict[str, str | None] = field(default_factory=dict)  # its worker's environment changes (None: unset)

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "backend": self.backend, "items": [list(i) for i in self.items]})


@dataclass
class PoolOptions:
    workers: int
    timeout: float  # seconds a case may run (no event from its worker) before it is a crash
    startup_timeout: float = 180.0  # seconds a fresh worker may take to import everything
    sanitizer: list[str] | None = None  # command prefix running each job's worker
    max_crashes: int = 3
    probe_cuda: bool = False
    deadline: float | None = None  # time.monotonic() after which no case starts (--max-time)


@dataclass
class SanitizerReport:
    errors: int = 0  # sum of ERROR SUMMARY counts
    reports: list[str] = field(default_factory=list)  # "check#case: first line of the report"
    processes: int = 0


def _signal_name(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    if code > 128:  # a shell or sanitizer passing the signal on as 128 + n
        with contextlib.suppress(ValueError):
            return f"exit status {code} ({signal.Signals(code - 128).name}?)"
    return f"exit status {code}"


def worker_command(config: WorkerConfig) -> list[str]:
    return [sys.executable, "-m", "safemoe.check._worker_main", config.to_json()]


def worker_env(extra: dict[str, str | None]) -> dict[str, str]:
    import safemoe

    env = dict(os.environ)
    source = str(Path(safemoe.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = source + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


class _Worker:
    """One worker process and the threads draining its pipes into a line queue."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.lines: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self.tail: collections.deque[str] = collections.deque(maxlen=12)
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,  # its own process group: a timeout kills the sanitizer too
        )
        self._open = 2
        self._lock = threading.Lock()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        for stream, name in ((self.proc.stdout, "out"), (self.proc.stderr, "err")):
            threading.Thread(target=self._drain, args=(stream, name), daemon=True).start()

    def _drain(self, stream: IO[str], name: str) -> None:
        for line in stream:
            self.lines.put((name, line.rstrip("\n")))
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self.lines.put(None)

    def send(self, text: str) -> bool:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return False
        return True

    def close_stdin(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def kill(self, live: set[_Worker] | None = None) -> None:
        if live is not None:
            live.discard(self)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def exit_text(self) -> str:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        code = self.proc.returncode
        text = _signal_name(code) if code is not None else "still running"
        last = [line for line in self.tail if line.strip()]
        return text + (f"; last output: {' | '.join(last[-3:])[:400]}" if last else "")


class Pool:
    """Runs jobs on worker processes; `on_result` gets every CaseResult (from several threads)."""

    def __init__(
        self,
        config: WorkerConfig,
        options: PoolOptions,
        on_result: Callable[[CaseResult], None],
    ) -> None:
        self.config = config
        self.options = options
        self._on_result = on_result
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._pending = 0  # cases without a result yet
        self._next_id = 0
        self._crashes: collections.Counter[tuple[str, str]] = collections.Counter()
        self._probe_lock = threading.Lock()
        self.device_failure: str | None = None
        self._live: set[_Worker] = set()  # killed if the run is interrupted
        self._stopped = False
        self.sanitizer: dict[str, SanitizerReport] = collections.defaultdict(SanitizerReport)

    # -- bookkeeping --------------------------------------------------------------------------
    def _record(self, result: CaseResult) -> None:
        self._on_result(result)
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    def _new_job(self, backend: str, items: list[Item], env: dict[str, str | None]) -> Job:
        with self._cond:
            self._next_id += 1
            return Job(self._next_id, backend, items, env)

    def _past_deadline(self) -> bool:
        if self._stopped:
            return True
        return self.options.deadline is not None and time.monotonic() > self.options.deadline

    def _take(self) -> Job | None:
        with self._cond:
            while not self._queue and self._pending > 0 and not self._past_deadline():
                self._cond.wait(0.5)
            if self._past_deadline():
                return None  # out of time: what is left is not run (the runner counts it)
            return self._queue.popleft() if self._queue else None

    def _crashed(self, job: Job, item: Item, message: str) -> None:
        self._record(CaseResult(item[0], job.backend, item[1], CRASHED, message=message))

    def _skip_rest(self, job: Job, items: list[Item], why: str) -> None:
        for item in items:
            self._crashed(job, item, f"not run: {why}")

    # -- running ------------------------------------------------------------------------------
    def run(self, jobs: list[Job]) -> None:
        with self._cond:
            self._queue.extend(jobs)
            self._pending = sum(len(j.items) for j in jobs)
            self._next_id = max([j.id for j in jobs], default=0)
        threads = [
            threading.Thread(target=self._manage, daemon=True) for _ in range(max(1, self.options.workers))
        ]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:  # Ctrl-C: workers live in their own sessions, so take them down here
            with self._cond:
                self._queue.clear()
                self._stopped = True
            for worker in list(self._live):
                worker.kill()

    def _spawn(self, job: Job) -> _Worker:
        command = worker_command(self.config)
        if self.options.sanitizer:
            command = [*self.options.sanitizer, *command]
        worker = _Worker(command, worker_env(job.env))
        self._live.add(worker)
        return worker

    def _manage(self) -> None:
        worker: _Worker | None = None
        worker_env_key: tuple[tuple[str, str | None], ...] | None = None
        while True:
            job = self._take()
            if job is None:
                break
            if self.device_failure is not None:
                self._skip_rest(
                    job, job.items, f"the device probe failed after a crash ({self.device_failure})"
                )
                continue
            given_up = [
                i for i in job.items if self._crashes[(i[0], job.backend)] >= self.options.max_crashes
            ]
            if given_up:
                for check in dict.fromkeys(i[0] for i in given_up):
                    count = self._crashes[(check, job.backend)]
                    self._skip_rest(
                        job,
                        [i for i in given_up if i[0] == check],
                        f"{check} crashed {count} times on {job.backend}",
                    )
                job.items = [i for i in job.items if i not in given_up]
                if not job.items:
                    continue
            key = tuple(sorted(job.env.items()))
            if worker is not None and (self.options.sanitizer or key != worker_env_key):
                worker.close_stdin()
                worker.kill(self._live)
                worker = None
            if worker is None:
                worker, worker_env_key = self._spawn(job), key
            healthy = self._follow(worker, job)
            if not healthy or self.options.sanitizer:
                if self.options.sanitizer and healthy:
                    worker.close_stdin()
                    self._drain_sanitizer(worker, job)
                worker.kill(self._live)
                worker = None
        if worker is not None:
            worker.close_stdin()
            worker.kill(self._live)

    def _follow(self, worker: _Worker, job: Job) -> bool:
        """Send `job` and read its events. True when the worker finished it and can take more."""
        remaining = list(job.items)
        state: dict[str, Any] = {"in_flight": None, "memcheck": []}
        try:
            return self._read(worker, job, remaining, state)
        except Exception as error:  # never leave cases without a result (the run would hang)
            worker.kill()
            return self._lost(
                job, remaining, state["in_flight"], f"runner error: {type(error).__name__}: {error}"
            )

    def _read(self, worker: _Worker, job: Job, remaining: list[Item], state: dict[str, Any]) -> bool:
        started = worker.proc.poll() is None and worker.send(job.to_json())
        deadline = time.monotonic() + self.options.startup_timeout + self.options.timeout
        while started:
            if self._past_deadline():
                worker.kill()  # out of time: the case in flight and the rest are not run
                return False
            try:
                wait = min(5.0, max(0.0, deadline - time.monotonic()))
                item = worker.lines.get(timeout=wait)
            except queue.Empty:
                if time.monotonic() < deadline:
                    continue
                worker.kill()
                why = f"timed out: no progress in {self.options.timeout:.0f} s"
                return self._lost(job, remaining, state["in_flight"], why)
            if item is None:
                break
            line = item[1]
            if not line.startswith(PREFIX):
                worker.tail.append(line)
                self._sanitizer_line(job, state["in_flight"], line, state["memcheck"])
                continue
            event = json.loads(line[len(PREFIX) :])
            kind = event["event"]
            deadline = time.monotonic() + self.options.timeout
            if kind == "start":
                state["in_flight"], state["memcheck"] = (event["check"], event["case"]), []
            elif kind == "result":
                result = CaseResult(**event["result"])
                found = state["memcheck"]
                if found and result.status in (PASSED, FAILED):
                    more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
                    result.status, result.message = FAILED, f"memcheck: {found[0]}{more}"
                self._record(result)
                if result.status == CRASHED:  # the worker found its context poisoned after the case
                    self._crashes[(result.check, job.backend)] += 1
                with contextlib.suppress(ValueError):
                    remaining.remove((result.check, result.case))
                state["in_flight"] = None
            elif kind == "done":
                return True
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.proc.wait(timeout=10)
        if not remaining:
            return False  # it exited after its last result (a poisoned context): nothing lost
        if worker.proc.returncode == POISONED_EXIT and state["in_flight"] is None:
            self._requeue(job, remaining)  # the worker reported the crash itself
            return False
        return self._lost(job, remaining, state["in_flight"], f"worker died: {worker.exit_text()}")

    def _lost(self, job: Job, remaining: list[Item], in_flight: Item | None, why: str) -> bool:
        """The worker crashed or hung: the case in flight (or the first, if none started) is
        CRASHED; probe the device; requeue the rest, except cases of a check that crashed too often."""
        if in_flight is None and not remaining:
            return False  # every case has its result; the worker just did not say done
        item = in_flight if in_flight is not None else remaining[0]
        self._crashed(job, item, why)
        rest = [i for i in remaining if i != item]
        self._probe()
        key = (item[0], job.backend)
        self._crashes[key] += 1
        if self.device_failure is not None:
            self._skip_rest(job, rest, f"the device probe failed after a crash ({self.device_failure})")
            return False
        if self._crashes[key] >= self.options.max_crashes:
            given_up = [i for i in rest if i[0] == item[0]]
            self._skip_rest(job, given_up, f"{item[0]} crashed {self._crashes[key]} times on {job.backend}")
            rest = [i for i in rest if i[0] != item[0]]
        self._requeue(job, rest)
        return False

    def _requeue(self, job: Job, rest: list[Item]) -> None:
        if rest:
            again = self._new_job(job.backend, rest, job.env)
            with self._cond:
                self._queue.appendleft(again)
                self._cond.notify_all()

    def _probe(self) -> None:
        """After a crash on CUDA: does the device still run a kernel in a fresh process?"""
        if not self.options.probe_cuda or self.device_failure is not None:
            return
        with self._probe_lock:
            try:
                done = subprocess.run(
                    [sys.executable, "-c", PROBE_CODE],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    env=worker_env({}),
                    check=False,
                )
            except subprocess.TimeoutExpired:
                self.device_failure = "the probe timed out"
                return
            if done.returncode != 0 or "probe ok" not in done.stdout:
                last = (done.stderr.strip().splitlines() or [""])[-1][:300]
                self.device_failure = f"{_signal_name(done.returncode)}: {last}"

    # -- compute-sanitizer ----------------------------------------------------------------------
    def _sanitizer_line(self, job: Job, in_flight: Item | None, line: str, memcheck: list[str]) -> None:
        if not self.options.sanitizer or not line.startswith("========= "):
            return
        report = self.sanitizer[job.backend]
        summary = _SANITIZER_SUMMARY.match(line)
        if summary:
            report.errors += int(summary.group(1))
            report.processes += 1
        elif _SANITIZER_HEADER.match(line):
            text = line.removeprefix("========= ").strip()
            where = f"{in_flight[0]}#{in_flight[1]}" if in_flight is not None else "between cases"
            if len(report.reports) < 50:
                report.reports.append(f"{where}: {text}")
            if in_flight is not None:
                memcheck.append(text)

    def _drain_sanitizer(self, worker: _Worker, job: Job) -> None:
        """Read what the sanitizer prints at exit (its ERROR SUMMARY) after the job is done."""
        deadline = time.monotonic() + 60
        while True:
            try:
                item = worker.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if item is None:
                return
            self._sanitizer_line(job, None, item[1], [])


def sanitizer_command() -> list[str] | None:
    """compute-sanitizer memcheck, or None when it is not installed."""
    import shutil

    found = shutil.which("compute-sanitizer")
    if found is None:
        candidates = sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer"))
        found = str(candidates[-1]) if candidates else None
    if found is None:
        return None
    return [found, "--tool", "memcheck", "--print-limit", "20", "--show-backtrace", "no"]


def run_in_process(
    jobs: list[Job],
    run_job: Callable[[dict[str, Any], Callable[[dict[str, Any]], None]], bool],
    on_result: Callable[[CaseResult], None],
    deadline: float | None = None,
) -> None:
    """The same jobs without isolation (--jobs 0): a crash ends the run, but tracebacks are yours."""

    def emit(event: dict[str, Any]) -> None:
        if event["event"] == "result":
            on_result(CaseResult(**event["result"]))

    for job in jobs:
        if deadline is not None and time.monotonic() > deadline:
            return
        payload = json.loads(job.to_json())
        if not run_job(payload, emit):
            return
