"""The environment switches every engine plugin reads, and the self-check's
tolerance: one spelling for SGLang's and vLLM's plugins."""

import os

import torch

SWITCH = "EAGLE_CAPTURE"                    # 1: the fused capture on; unset / 0: off
ON_PROBLEM = "EAGLE_CAPTURE_ON_PROBLEM"     # refuse (default) | install
VERIFY = "EAGLE_CAPTURE_VERIFY"             # number of eager forwards to self-check
MAX_TOKENS = "EAGLE_CAPTURE_MAX_TOKENS"     # override the derived buffer rows
# SGLang at TP > 1: 1 runs the all-reduce SGLang fuses into a captured layer's
# input norm by eagle_capture (the one kernel or SGLang's all-reduce + the fused
# op, per T); unset / 0: SGLang's fusion and a capture copy.
FUSED_ALLREDUCE = "EAGLE_CAPTURE_FUSED_ALLREDUCE"

# Normed-output tolerance of the live self-check, per dtype: the residual (the
# capture) must be bit-exact; the normed output may differ from the engine's own
# norm kernel by rsqrt / reduction-order rounding (FlashInfer vs ours: 1 ulp on
# ~6e-6 of the elements at T = 4096, H200; vLLM's native norm rounds x * rstd to
# bf16 before the weight multiply, ours rounds once), so allow a few ulps.
VERIFY_NORM_RTOL = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 2.0 ** -20}


class PluginError(RuntimeError):
    """The plugin cannot hook this engine, or one of its settings is malformed."""


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
