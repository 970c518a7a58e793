"""Fill vLLM's model-inspection cache (``$VLLM_CACHE_ROOT/modelinfos``) for the
architectures the vLLM runs load, all in this one process.

vLLM inspects a lazily registered architecture (which interfaces its class has:
SupportsEagle3, SupportsPP, ...) in a fresh interpreter the first time it is resolved,
and caches the answer keyed by the module's source: ~10 s per architecture on CPU, paid
again in every run with a cold cache. The runs of tests/test_vllm_real.py share one
cache; this fills it with vLLM's own inspection (its subprocess helper run in-process),
for vLLM's classes and then the plugin's, so that no run pays it.

    python -m tests.vllm_real.modelinfos            # with VLLM_CACHE_ROOT set
"""

from __future__ import annotations

import sys
import time

# The EAGLE-3 drafts the engine runs load (tests/vllm_real/engine.py, acceptance.py).
DRAFTS = ("Eagle3DeepseekV2ForCausalLM", "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def _inspect(registry, archs, module_prefix: str, failed: list) -> list[str]:
    done = []
    for arch in archs:
        model = registry.models.get(arch)
        if model is None or not getattr(model, "module_name", "").startswith(module_prefix):
            continue
        name = f"{model.module_name}:{model.class_name}"
        try:
            model.inspect_model_cls()
        except Exception as e:  # noqa: BLE001 - not importable here (e.g. a VL model's
            failed.append(f"{name} ({type(e).__name__}: {e})")  # torchvision): uncached
            continue
        done.append(name)
    return done


def main() -> int:
    from vllm import ModelRegistry
    from vllm.model_executor.models import registry as vllm_registry
    from vllm.plugins import load_general_plugins

    from eagle_capture.integrations.vllm.plugin import ARCHITECTURES, CHECKED_ARCHITECTURES

    start = time.perf_counter()
    vllm_registry._run_in_subprocess = lambda fn: fn()  # the same inspection, here
    archs = [*ARCHITECTURES, *CHECKED_ARCHITECTURES, *DRAFTS]
    failed: list[str] = []
    done = _inspect(ModelRegistry, archs, "vllm.", failed)  # plugin off: vLLM's classes
    load_general_plugins()  # EAGLE_CAPTURE=1: ours
    done += _inspect(ModelRegistry, archs, "eagle_capture.", failed)
    print(
        f"inspected {len(done)} classes in {time.perf_counter() - start:.1f} s: " + ", ".join(done)
    )
    if failed:
        print("not inspected here (a run that loads one inspects it itself): " + "; ".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
