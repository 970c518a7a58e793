"""The engine tests' machinery on its own: the background runs (tests/engine_jobs.py),
the fork server (tests/forkserver.py) and the failure summary of a TP / DP run
(tests/test_sglang_real_tp.py's ``summary``). A bug here would fail or hide the
real-engine tests, so each behaviour they rely on is checked without an engine."""

import threading
import time

import pytest

import forkserver
from engine_jobs import EngineJobs, Job, once


def test_runs_go_longest_first_and_a_result_waits_for_its_run():
    order, gate = [], threading.Event()
    jobs = EngineJobs(slots=1)
    jobs.submit(Job(-1, "short", lambda: order.append("short") or "s"))
    jobs.submit(Job(-9, "long", lambda: (gate.wait(5), order.append("long"))[1] or "l"))
    jobs.start()
    gate.set()
    assert jobs.result("short") == "s" and jobs.result("long") == "l"
    assert order == ["long", "short"]
    assert any("long" in line for line in jobs.report())
    jobs.stop()


def test_lighter_runs_start_while_a_run_waits_for_every_slot():
    """A run heavier than the budget waits for every slot; the runs after it that fit
    start meanwhile, unless a test already waits for the heavy one."""
    order, gate, light_ran = [], threading.Event(), threading.Event()
    jobs = EngineJobs(slots=2)
    jobs.submit(Job(-9, "first", lambda: (gate.wait(5), order.append("first"))))
    jobs.submit(Job(-8, "heavy", lambda: order.append("heavy"), weight=4))
    jobs.submit(Job(-1, "light", lambda: (order.append("light"), light_ran.set())))
    jobs.start()
    assert light_ran.wait(5), "the light run did not start beside the first one"
    assert order == ["light"]
    gate.set()
    jobs.result("heavy")
    assert order == ["light", "first", "heavy"]
    jobs.stop()

    order, gate, first_ran = [], threading.Event(), threading.Event()
    jobs = EngineJobs(slots=2)
    jobs.submit(Job(-9, "first", lambda: (first_ran.set(), gate.wait(5), order.append("first"))))
    jobs.start()
    assert first_ran.wait(5)
    jobs.submit(Job(float("-inf"), "heavy", lambda: order.append("heavy"), weight=4))  # awaited
    jobs.submit(Job(-1, "light", lambda: order.append("light")))
    time.sleep(0.3)
    assert order == []  # nothing jumps ahead of a run a test waits for
    gate.set()
    jobs.result("light")
    assert order == ["first", "heavy", "light"]
    jobs.stop()


def test_a_run_waits_for_its_set_up_and_a_failure_reaches_every_test():
    built = []
    jobs = EngineJobs(slots=2)

    def overlay():
        time.sleep(0.2)
        built.append("overlay")

    def needs_it():
        assert built == ["overlay"], "started before its set-up was built"
        return "ran"

    def broken():
        raise RuntimeError("scenario X broke")

    jobs.submit(Job(0, "needs", needs_it, needs=(("overlay", overlay),)))
    jobs.submit(Job(0, "broken", broken))
    jobs.start()
    assert jobs.result("needs") == "ran"
    for _ in range(2):  # every test reading the run gets the run's own error
        with pytest.raises(RuntimeError, match="scenario X broke"):
            jobs.result("broken")
    with pytest.raises(KeyError, match="no engine run 'nothing'"):
        jobs.result("nothing")
    jobs.stop()


def test_once_builds_once_and_repeats_its_failure():
    calls = []
    assert once("test_engine_jobs ok", lambda: calls.append(1) or 7) == 7
    assert once("test_engine_jobs ok", lambda: calls.append(1) or 8) == 7
    assert calls == [1]
    for _ in range(2):
        with pytest.raises(ValueError, match="no overlay"):
            once("test_engine_jobs bad", lambda: (_ for _ in ()).throw(ValueError("no overlay")))


@pytest.mark.skipif(not forkserver.enabled({}), reason="needs os.fork")
def test_fork_server_runs_a_module_with_its_environment(tmp_path):
    import os

    from engine_env import ROOT

    (tmp_path / "probe.py").write_text(
        "import os, sys\nprint('ARGS', sys.argv[1:], "
        "os.environ['PROBE'])\nsys.exit(int(sys.argv[1]))\n"
    )
    (tmp_path / "hang.py").write_text("import time\ntime.sleep(600)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    server = forkserver.ForkServer("test", env, str(ROOT), ["json"])
    try:
        run_env = dict(env, PROBE="yes")  # a run's own environment, applied at the fork
        ok = server.start("probe", ["0"], run_env, str(tmp_path), str(tmp_path / "ok.log"))
        assert ok.wait(timeout=60) == 0
        assert "ARGS ['0'] yes" in (tmp_path / "ok.log").read_text()
        bad = server.start("probe", ["3"], run_env, str(tmp_path), str(tmp_path / "bad.log"))
        assert bad.wait(timeout=60) == 3
        hang = server.start("hang", [], run_env, str(tmp_path), str(tmp_path / "hang.log"))
        assert hang.poll() is None
        hang.kill()
        assert hang.wait(timeout=60) == -9
    finally:
        server.close()


def test_a_broken_fork_server_says_why():
    from engine_env import ROOT

    with pytest.raises(RuntimeError, match="(?s)did not start.*no_such_module"):
        forkserver.ForkServer(
            "broken",
            {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
            str(ROOT),
            ["no_such_module"],
            timeout_s=120,
        )


def test_a_tp_failure_names_the_process_and_the_scenario():
    from test_sglang_real_tp import summary

    run = {
        "rank0": {
            "returncode": 1,
            "log_tail": "UserWarning: import noise\n",
            "json": {
                "tp2_setup": {"ok": True},
                "plugin_tp2": {
                    "ok": False,
                    "detail": "AssertionError: aux differs",
                    "traceback": "Traceback ... plugin_tp2",
                },
            },
        },
        "rank1": {
            "returncode": -9,
            "log_tail": "warn: x\nRuntimeError: peer closed\n",
            "json": None,
        },
        "tp1": {"returncode": 0, "log_tail": "", "json": {"reference_tp1": {"ok": True}}},
        "seconds": 3.0,
    }
    text = summary(run)
    assert "rank0: exit 1, plugin_tp2 failed: AssertionError: aux differs" in text
    assert "rank1: exit -9, wrote no results" in text and "RuntimeError: peer closed" in text
    assert "import noise" not in text and "warn: x" not in text
    assert "tp1: exit 0, all its scenarios ok" in text


def test_engine_tests_are_marked_and_ordered_last(request):
    items = request.session.items
    marked = [i for i, item in enumerate(items) if item.get_closest_marker("engines")]
    if marked:
        assert marked == list(range(len(items) - len(marked), len(items)))
