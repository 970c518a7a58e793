"""What every engine test process needs, built once per session (tests/engine_jobs.py's
``once``): the overlays (tools/sglang_real_env.sh, tools/vllm_real_env.sh; cached
under .cache across sessions), the environment the engine processes run with, and one
fork server per SGLang line (tests/forkserver.py) that has imported SGLang's model code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import forkserver
from engine_jobs import PIP_LOCK, once

ROOT = Path(__file__).resolve().parents[1]

# What a forked SGLang child has imported: the stubs, then SGLang's set-up, model and
# batch modules (tests/sglang_real/tp_scenarios.py's pre-loader, import-only), and the
# scenario modules' own imports.
SGLANG_PRELOAD = [
    "tests.sglang_real.tp_scenarios:_preimport",
    "tests.sglang_real.harness",
    "tests.sglang_real.plugin_scenarios",
]
# Runs with an all-to-all MoE backend (DeepEP): SGLang's DeepEP dispatcher records at its
# import whether deep_ep imports, so those runs fork from a server that stubbed it first.
SGLANG_PRELOAD_DEEPEP = ["tests.sglang_real.stubs:install_deep_ep", *SGLANG_PRELOAD]

_SERVERS: list = []
# The environment as the session started: runs start from background threads while
# other tests may monkeypatch os.environ (EAGLE_CAPTURE_*), which must not leak into them.
BASE_ENV = dict(os.environ)


def _overlay(script: str, version: str) -> str:
    def build():
        env = dict(BASE_ENV, PY=sys.executable)
        with PIP_LOCK:
            setup = subprocess.run(
                ["bash", script, version],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=1200,
            )
        assert setup.returncode == 0, f"set-up ({script} {version}) failed:\n{setup.stderr[-3000:]}"
        return setup.stdout.strip().splitlines()[-1]

    return once(f"overlay {script} {version}", build)


def sglang_needs(version: str) -> tuple:
    """A job's ``needs`` (tests/engine_jobs.py) for SGLang ``version``: its overlay."""
    return ((f"overlay sglang {version}", lambda: _overlay("tools/sglang_real_env.sh", version)),)


def vllm_needs(version: str) -> tuple:
    return ((f"overlay vllm {version}", lambda: _overlay("tools/vllm_real_env.sh", version)),)


def sglang_env(version: str) -> dict:
    """The environment of a process running SGLang ``version``'s real code: its overlay
    first on the path, the ops' torch path for CPU tensors, bytecode cached under
    .cache/pycache (the overlay is installed without it)."""
    env = dict(BASE_ENV, PY=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join([_overlay("tools/sglang_real_env.sh", version), str(ROOT)])
    env.pop("TRITON_INTERPRET", None)  # CPU tensors take the ops' torch path
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(ROOT / ".cache" / "pycache")
    return env


def vllm_overlay(version: str) -> str:
    return _overlay("tools/vllm_real_env.sh", version)


def sglang_server(version: str, deepep: bool = False):
    """This line's fork server (None with EAGLE_CAPTURE_TEST_FORKSERVER=0: every run a
    fresh interpreter)."""
    if not forkserver.enabled(BASE_ENV):
        return None
    what = f"sglang {version}" + (" (deep_ep stubbed)" if deepep else "")

    def build():
        server = forkserver.ForkServer(
            what,
            sglang_env(version),
            str(ROOT),
            SGLANG_PRELOAD_DEEPEP if deepep else SGLANG_PRELOAD,
        )
        _SERVERS.append(server)
        return server

    return once(f"forkserver {what}", build)


def start_sglang(version: str, module: str, args: list[str], log: Path):
    """``python -m module args`` on SGLang ``version``: forked from its server (the
    DeepEP one for ``--moe-a2a-backend deepep``)."""
    deepep = "--moe-a2a-backend" in args and args[args.index("--moe-a2a-backend") + 1] == "deepep"
    return forkserver.start_process(
        sglang_server(version, deepep), module, list(args), sglang_env(version), str(ROOT), str(log)
    )


VLLM_PRELOAD = [
    "vllm",
    "vllm.plugins",
    "vllm.config",
    "vllm.model_executor.models.deepseek_v2",
    "tests.vllm_real.harness",
]


def vllm_server(version: str, env: dict):
    """A fork server that has imported vLLM (``env``: the runs' common environment; each
    run's own is applied when it is forked). None with EAGLE_CAPTURE_TEST_FORKSERVER=0."""
    if not forkserver.enabled(BASE_ENV):
        return None

    def build():
        server = forkserver.ForkServer(f"vllm {version}", env, str(ROOT), VLLM_PRELOAD)
        _SERVERS.append(server)
        return server

    return once(f"forkserver vllm {version}", build)


def close_servers() -> None:
    while _SERVERS:
        _SERVERS.pop().close()
