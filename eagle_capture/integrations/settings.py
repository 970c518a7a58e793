"""The environment switches every engine plugin reads: one spelling for SGLang's
and vLLM's plugins (the rest they share is :mod:`eagle_capture.integrations.core`)."""

import os

from eagle_capture.integrations.core.errors import PluginError

SWITCH = "EAGLE_CAPTURE"  # 1: the fused capture on; unset / 0: off
ON_PROBLEM = "EAGLE_CAPTURE_ON_PROBLEM"  # refuse (default) | install
VERIFY = "EAGLE_CAPTURE_VERIFY"  # number of eager forwards to self-check
MAX_TOKENS = "EAGLE_CAPTURE_MAX_TOKENS"  # override the derived buffer rows
# SGLang at TP > 1: 1 runs the all-reduce SGLang fuses into a captured layer's
# input norm by eagle_capture (the one kernel or SGLang's all-reduce + the fused
# op, per T); unset / 0: SGLang's fusion and a capture copy.
FUSED_ALLREDUCE = "EAGLE_CAPTURE_FUSED_ALLREDUCE"

__all__ = [
    "FUSED_ALLREDUCE",
    "MAX_TOKENS",
    "ON_PROBLEM",
    "PluginError",
    "SWITCH",
    "VERIFY",
    "fused_allreduce",
    "on_problem",
    "switch_on",
    "verify_forwards",
]


def _on_off(env, name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in ("", "0", "off", "false", "no"):
        return False
    if value in ("1", "on", "true", "yes"):
        return True
    raise PluginError(f"{name}={env.get(name)!r}: expected 1 (on) or 0 (off)")


def switch_on(env=os.environ) -> bool:
    return _on_off(env, SWITCH)


def on_problem(env=os.environ) -> str:
    policy = env.get(ON_PROBLEM, "refuse").strip().lower()
    if policy not in ("refuse", "install"):
        raise PluginError(f"{ON_PROBLEM}={env.get(ON_PROBLEM)!r}: expected refuse or install")
    return policy


def verify_forwards(env=os.environ) -> int:
    raw = env.get(VERIFY, "").strip()
    if not raw:
        return 0
    try:
        n = int(raw)
        if n < 0:
            raise ValueError
    except ValueError:
        raise PluginError(f"{VERIFY}={raw!r}: expected a number of forwards >= 0") from None
    return n


def fused_allreduce(env=os.environ) -> bool:
    return _on_off(env, FUSED_ALLREDUCE)
