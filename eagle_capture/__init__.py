"""eagle-capture: the capture side of EAGLE-3 speculative decoding.

An EAGLE-3 draft reads the target's hidden states at three layers, concatenated
``[T, 3*H]``. eagle-capture writes each captured state straight into its slot of one
preallocated buffer, inside the add + RMSNorm (and, under tensor parallelism, the
all-reduce) the layer already runs, and checks that the draft gets the layers it was
trained on.

* ``ops/`` (:mod:`eagle_capture.ops`: the four ops, their checks, their launcher and
  the op table) over the Triton kernels in ``kernels/``, and the aux buffer
  (:mod:`eagle_capture.buffer`): what every other part builds on;
* ``parallel/``: tensor-parallel capture and the all-reduce fused with it;
* ``integrations/``: the plugins that switch the capture on inside the engines' model
  code (``EAGLE_CAPTURE=1``), with start-up checks -- ``core/`` (what both share, no
  engine imported: capture state, self-check tolerance, errors, loggers),
  ``sglang/`` (SGLang's plugin, and the drop-in it installs, one adapter per model
  family) and ``vllm/`` (vLLM's plugin and the capturing model classes it registers);
* ``layer_ids/``: which layers a draft gets on each engine release, read from the
  engines' code (``eagle-capture doctor``);
* ``probe/``: which layers a draft was trained on, measured (``eagle-capture probe``);
* ``cli/``: the ``eagle-capture`` command line (also ``python -m eagle_capture``);
* ``testing/``: references, the reference loop, benchmark timers -- never imported by
  the product.

The ops and the buffer load on first use (``eagle_capture.add_capture``, ``import
eagle_capture.ops``), which is when the ``torch.ops.eagle_capture`` ops are registered:
importing the package itself loads neither torch nor Triton, so the doctor starts in a
fraction of the time and runs where they are not installed. No device is queried until a
kernel is launched.
"""

import importlib

__version__ = "0.2.0"

# Public name -> the submodule that defines it, imported on first access (PEP 562).
_LAZY = {
    "AuxCaptureBuffer": "buffer",
    "add_capture": "ops",
    "add_rmsnorm_capture": "ops",
    "add_rmsnorm_into_slot": "ops",
    "add_rmsnorm_out": "ops",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
