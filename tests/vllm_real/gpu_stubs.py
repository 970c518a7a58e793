"""vLLM's CUDA extensions stood in, for vLLM's own Python on the GPU machine
(tools/gpu/gpu_vllm_real.sh makes this every process's ``sitecustomize``: vLLM
inspects models in a subprocess). Import it before vLLM.

vLLM's CUDA platform and attention utilities import its extension modules at
module level; the model gpu_scenarios.py runs calls none of them (attention is
stood in, custom ops run native, the IR norm on ``native``).
"""

import sys
import types

import torch


def _stand_in_cuda_extensions() -> None:
    """vLLM's CUDA extension modules, which its CUDA platform and attention
    utilities import at module level, as empty modules: the model run here calls
    none of them (attention is stood in, custom ops run native)."""

    def never(name):
        def call(*args, **kwargs):
            raise RuntimeError(f"{name}: vLLM's CUDA extension is not on this machine")

        return call

    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    fa = types.ModuleType("vllm.vllm_flash_attn")
    for name in (
        "compile_flash_attn_varlen_func_from_specs",
        "flash_attn_varlen_func",
        "get_scheduler_metadata",
        "fa_version_unsupported_reason",
    ):
        setattr(fa, name, never(f"vllm.vllm_flash_attn.{name}"))
    fa.FA2_AVAILABLE = fa.FA3_AVAILABLE = False
    fa.is_fa_version_supported = lambda *args, **kwargs: False
    sys.modules.setdefault("vllm.vllm_flash_attn", fa)

    # torch.ops._C (vLLM's op library, not loaded): the capability queries vLLM
    # makes at import answer "not supported"; other ops can be looked up (layers
    # keep a handle at construction) but raise when called; the fake kernels
    # vLLM registers for them are skipped (the ops do not exist).
    class _Op:
        def __init__(self, name):
            self.name = name

        def __getattr__(self, overload):  # .default, .out, ...
            if overload.startswith("__"):
                raise AttributeError(overload)
            return self

        def __call__(self, *args, **kwargs):
            if "support" in self.name:
                return False
            raise RuntimeError(f"torch.ops._C.{self.name}: vLLM's CUDA ops are not on this machine")

    class _Namespace:
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Op(name)

    torch.ops._C = _Namespace()
    register_fake = torch.library.register_fake

    def register_fake_unless_vllm_c(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("_C::"):
            return (lambda fn: fn) if not args else None
        return register_fake(op, *args, **kwargs)

    torch.library.register_fake = register_fake_unless_vllm_c


_stand_in_cuda_extensions()
