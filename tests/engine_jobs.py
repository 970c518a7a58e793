"""Background runs of the engine tests (real SGLang, real vLLM), started when the
session starts and run while pytest goes through the other tests.

Each engine test module has ``engine_jobs(item) -> [Job, ...]``: the runs (a scenario
process, the ranks of a TP or DP run, ...) a selected test needs. The session fixture
``engine_jobs`` (tests/conftest.py) collects them for every selected test, and a few
worker threads run them, longest first, within a CPU budget (``weight``: the processes
a run keeps busy); a test then waits for its run's result (``EngineJobs.result``), which
moves a run not yet started to the front. A run is a blocking function in a thread
(it starts processes and waits for them); its exception is re-raised in every test that
asks for its result. Deselected tests start nothing.

Shared set-ups go through :func:`once` (each key built by one thread, the others wait).
The overlays of tools/sglang_real_env.sh and vllm_real_env.sh (pip: one at a time) are a
job's ``needs``: a set-up thread builds them, in the order of the jobs that need them,
outside the CPU budget, and a job starts only when its needs are built (a job waiting for
pip would hold slots others could use). The fork servers (tests/forkserver.py, one per
engine line) are started by the first job that forks from them.

``EAGLE_CAPTURE_ENGINE_SLOTS`` sets the budget (default: the CPU count + 1: ranks wait
on their peers much of the time).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

SLOTS_ENV = "EAGLE_CAPTURE_ENGINE_SLOTS"


@dataclass(eq=False)  # identity: two runs of the same priority are different runs
class Job:
    priority: float  # lower runs first (e.g. minus the expected seconds)
    key: str
    run: Callable[[], Any]
    weight: int = 1
    # Set-ups built before the job starts: (key, build) pairs; build() is idempotent
    # (engine_env's builders go through once()).
    needs: tuple = ()


def _by_priority(job: Job) -> float:
    return job.priority


class _Outcome:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value = None
        self.error: BaseException | None = None
        self.started = None
        self.seconds = None


class EngineJobs:
    def __init__(self, slots: int | None = None) -> None:
        if slots is None:
            slots = int(os.environ.get(SLOTS_ENV) or (os.cpu_count() or 2) + 1)
        self.slots = max(1, slots)
        self._free = self.slots
        self._lock = threading.Condition()
        self._queue: list[Job] = []
        self._built: set[str] = set()
        self._jobs: dict[str, Job] = {}
        self._outcomes: dict[str, _Outcome] = {}
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self.cleanups: list[Callable[[], None]] = []
        self._processes: set = set()
        self._born = time.monotonic()

    def track(self, process):
        """``process`` (Popen-like) is killed if still running when the session stops."""
        with self._lock:
            self._processes.add(process)
        return process

    def submit(self, job: Job) -> None:
        with self._lock:
            if job.key in self._jobs:
                return
            self._jobs[job.key] = job
            self._outcomes[job.key] = _Outcome()
            self._queue.append(job)
            self._lock.notify_all()

    def start(self) -> None:
        threads = [
            threading.Thread(target=self._worker, name=f"engine-jobs-{i}", daemon=True)
            for i in range(self.slots)
        ]
        threads.append(
            threading.Thread(target=self._build_needs, name="engine-jobs-setup", daemon=True)
        )
        for t in threads:
            t.start()
        self._threads += threads

    def _ready(self, job: Job) -> bool:
        return all(key in self._built for key, _ in job.needs)

    def _next(self):
        """The first queued job, in priority order, whose set-ups are built, if it fits
        the free slots (a job heavier than the whole budget runs when everything is
        free); None when stopping. While the first one waits for the whole budget to
        come free, and no test waits for it yet, the next ones that fit start instead
        (the slots it waits for would idle until the last running job ends)."""
        with self._lock:
            while True:
                if self._stopping:
                    return None
                ready = [job for job in sorted(self._queue, key=_by_priority) if self._ready(job)]
                for job in ready:
                    need = min(job.weight, self.slots)
                    if need <= self._free:
                        self._queue.remove(job)
                        self._free -= need
                        return job, need
                    if need < self.slots or job.priority == float("-inf"):
                        break  # it waits for a few slots only, or a test waits for it
                self._lock.wait()

    def _build_needs(self) -> None:
        """Build the queued jobs' set-ups one at a time, those of the first job first. A
        failed build counts as built: the job runs, and its own call of the builder
        re-raises the failure in its tests."""
        while True:
            with self._lock:
                todo = [
                    (key, build)
                    for job in sorted(self._queue, key=_by_priority)
                    for key, build in job.needs
                    if key not in self._built
                ]
                if self._stopping or not todo:
                    if self._stopping or all(o.done.is_set() for o in self._outcomes.values()):
                        return
                    self._lock.wait(timeout=1.0)
                    continue
            key, build = todo[0]
            try:
                build()
            except BaseException:  # noqa: BLE001 - re-raised by the job's own call
                pass
            with self._lock:
                self._built.add(key)
                self._lock.notify_all()

    def _worker(self) -> None:
        while True:
            picked = self._next()
            if picked is None:
                return
            job, need = picked
            outcome = self._outcomes[job.key]
            started = time.monotonic()
            outcome.started = started - self._born
            try:
                outcome.value = job.run()
            except BaseException as e:  # noqa: BLE001 - re-raised in the tests that ask
                outcome.error = e
            outcome.seconds = time.monotonic() - started
            with self._lock:
                self._free += need
                self._lock.notify_all()
            outcome.done.set()

    def result(self, key: str, job: Job | None = None):
        """The run's result (waits for it; a run not yet started goes first). ``job``:
        submitted here if the session did not (a test run without the fixture's plan)."""
        if key not in self._jobs:
            if job is None:
                raise KeyError(f"no engine run {key!r} was planned for this session")
            self.submit(job)
        with self._lock:
            queued = self._jobs[key]
            if queued in self._queue:
                queued.priority = float("-inf")
                self._lock.notify_all()
        outcome = self._outcomes[key]
        outcome.done.wait()
        if outcome.error is not None:
            raise outcome.error
        return outcome.value

    def report(self, top: int = 12) -> list[str]:
        """Lines for the terminal summary: when the runs ran, the longest of them."""
        ran = [
            (o.seconds, o.started, k) for k, o in self._outcomes.items() if o.seconds is not None
        ]
        if not ran:
            return []
        end = max(s + b for s, b, _ in ran)
        lines = [
            f"{len(ran)} background engine runs ({self.slots} slots) from "
            f"{min(b for _, b, _ in ran):.0f} s to {end:.0f} s of the session; "
            f"the longest (seconds, started at):"
        ]
        for seconds, started, key in sorted(ran, reverse=True)[:top]:
            failed = " FAILED" if self._outcomes[key].error is not None else ""
            lines.append(f"  {seconds:6.1f}  @{started:5.0f}  {key}{failed}")
        return lines

    def stop(self) -> None:
        """Stop starting runs and undo the set-ups (cleanups: kill running processes,
        close the fork servers)."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
            processes = list(self._processes)
        for process in processes:
            if process.poll() is None:
                process.kill()
                try:
                    process.wait(timeout=30)
                except Exception:  # noqa: BLE001
                    pass
        for cleanup in reversed(self.cleanups):
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - best effort at the session's end
                pass


_ONCE: dict[str, tuple[threading.Lock, list]] = {}
_ONCE_LOCK = threading.Lock()


def once(key: str, build: Callable[[], Any]):
    """``build()`` for ``key`` once per session, whichever thread asks first; the others
    wait for it. A failure is re-raised to every caller."""
    with _ONCE_LOCK:
        lock, box = _ONCE.setdefault(key, (threading.Lock(), []))
    with lock:
        if not box:
            try:
                box.append(("ok", build()))
            except BaseException as e:  # noqa: BLE001
                box.append(("error", e))
        kind, value = box[0]
    if kind == "error":
        raise value
    return value


PIP_LOCK = threading.Lock()  # one pip at a time in the test venv


def run_to_json(jobs, module: str, args: list, env: dict, log, out, timeout_s: float):
    """``python -m module args``, forked by tests/forkserver.py and tracked by ``jobs`` (the
    session's end stops it), killed after ``timeout_s``: (its exit status, its log, the
    JSON it wrote at ``out`` or None)."""
    import json
    import subprocess

    import forkserver

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = jobs.track(forkserver.start_process(None, module, list(args), env, root, str(log)))
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return (
        proc.returncode,
        log.read_text(errors="replace"),
        json.loads(out.read_text()) if out.exists() else None,
    )
