"""A fork server for the engine tests: one interpreter imports an engine once, then
forks a process for each scenario run, instead of every run importing it again.

Importing SGLang's model code costs ~11 s of CPU per process on the CI machine (its
module-level imports pull in transformers, torch._dynamo and torch._inductor); the
SGLang tests run ~60 such processes (a scenario process per line, two ranks per TP run,
two or four per DP-attention run). A forked child starts with the imports done and
nothing else: the server imports modules and calls their import-only pre-loaders
(``module:function``), never an engine set-up, a distributed init or a torch op, so the
child is what a fresh ``python -m MODULE ARGS`` would be after its imports (rank 0 of a
TP run forks its TP 1 reference the same way).

    python -m tests.forkserver --socket PATH [--preload MODULE[:FUNCTION] ...]

prints ``READY`` on stdout when the imports are done; each connection then sends one
JSON line ``{"module", "args", "env", "cwd", "log"}`` and gets the child's pid, and
later ``exit N`` when it ends. The child runs in its own process group (a TP rank's
forked TP 1 run is killed with it), with ``env`` as its whole environment and stdout /
stderr in ``log``. :class:`ForkServer` / :class:`Forked` are the pytest side:
``Forked`` has the part of ``subprocess.Popen`` the tests use. The server exits when
the process that started it has gone.

``EAGLE_CAPTURE_TEST_FORKSERVER=0`` makes :func:`start_process` start every run as
a fresh interpreter instead (same code, ~11 s more per process).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

ENABLED_ENV = "EAGLE_CAPTURE_TEST_FORKSERVER"


# ------------------------------------------------------------------ the server


def _child(request: dict) -> None:
    """In the forked child: become ``python -m module args`` with ``env``; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import runpy

        sys.argv = [request["module"], *request["args"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the child's log
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _read_request(conn: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the client closed before its request")
        data += chunk
    return json.loads(data)


def serve(path: str, preload: list[str]) -> None:
    parent = os.getppid()
    for spec in preload:
        module, _, function = spec.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("READY", flush=True)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([server], [], [], 0.2)
        if ready:
            conn, _ = server.accept()
            try:
                request = _read_request(conn)
            except (ConnectionError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for other in children.values():
                    other.close()
                _child(request)
            children[pid] = conn
            conn.sendall(f"{pid}\n".encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()
    for pid in children:  # the tests' process has gone: nobody waits for these
        _kill_group(pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------- the tests' side


class Forked:
    """A process forked by a :class:`ForkServer`: ``pid``, ``returncode``, ``poll``,
    ``wait(timeout)``, ``kill`` as ``subprocess.Popen`` has them."""

    def __init__(
        self, server: "ForkServer", module: str, args: list[str], env: dict, cwd: str, log: str
    ) -> None:
        self.args = [module, *args]
        self.returncode = None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(server.path)
        self._conn.sendall(
            (
                json.dumps(
                    {"module": module, "args": list(args), "env": env, "cwd": cwd, "log": log}
                )
                + "\n"
            ).encode()
        )
        self._buffer = b""
        line = self._line(timeout=60)
        if line is None:
            raise RuntimeError(
                f"the fork server ({server.what}) did not answer: {server.log_tail()}"
            )
        self.pid = int(line)

    def _line(self, timeout):
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:  # the server went away: the child is gone with it or orphaned
                return "exit -9"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout=None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line.split()[1])
            self._conn.close()
        return self.returncode

    def poll(self):
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.returncode is None:
            _kill_group(self.pid)


class ForkServer:
    """``python -m tests.forkserver`` started with ``env`` (the engine's overlay on its
    PYTHONPATH) and ``preload``; :meth:`start` forks runs from it."""

    def __init__(
        self, what: str, env: dict, cwd: str, preload: list[str], timeout_s: float = 600
    ) -> None:
        self.what = what
        self._dir = tempfile.mkdtemp(prefix="eagle_forkserver_")
        self.path = os.path.join(self._dir, "socket")
        self._log = os.path.join(self._dir, "server.log")
        with open(self._log, "w") as log:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.forkserver",
                    "--socket",
                    self.path,
                    *[a for spec in preload for a in ("--preload", spec)],
                ],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if line.strip() != "READY":
            self.close()
            raise RuntimeError(f"the fork server for {what} did not start:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self._log, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def start(self, module: str, args: list[str], env: dict, cwd: str, log: str) -> Forked:
        if self._proc.poll() is not None:
            raise RuntimeError(
                f"the fork server for {self.what} has exited "
                f"({self._proc.returncode}):\n{self.log_tail()}"
            )
        return Forked(self, module, args, env, cwd, log)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc.stdout.close()


def enabled(env=os.environ) -> bool:
    return env.get(ENABLED_ENV, "1") != "0" and hasattr(os, "fork")


def start_process(server, module: str, args: list[str], env: dict, cwd: str, log: str):
    """``python -m module args`` with ``env``, stdout and stderr in ``log``: forked from
    ``server`` when there is one, else a fresh interpreter (``subprocess.Popen``)."""
    if server is not None:
        return server.start(module, args, env, cwd, log)
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        help="MODULE or MODULE:FUNCTION (an import-only pre-loader)",
    )
    args = parser.parse_args(argv)
    serve(args.socket, args.preload)


if __name__ == "__main__":
    main()
