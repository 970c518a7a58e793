"""The shared core of the SGLang and vLLM integrations (eagle_capture.integrations.core):
one set of errors, one capture state both engines' states extend, one self-check
tolerance, engine-free. The engines' own use of it runs against their real code in
tests/test_sglang_real.py and tests/test_vllm_real.py."""

import subprocess
import sys

import pytest
import torch

from eagle_capture.buffer import AuxCaptureBuffer
from eagle_capture.integrations import settings
from eagle_capture.integrations.core import errors, selfcheck
from eagle_capture.integrations.core import state as core
from eagle_capture.integrations.sglang import dropin, server_modes
from eagle_capture.integrations.sglang import state as sglang_state
from eagle_capture.integrations.vllm import checked
from eagle_capture.integrations.vllm import state as vllm_state


def test_one_class_per_error():
    """A user's ``except`` and the plugins' policies see the same class whichever engine
    raised it."""
    assert (
        dropin.WrongCaptureLayers
        is sglang_state.WrongCaptureLayers
        is checked.WrongCaptureLayers
        is errors.WrongCaptureLayers
    )
    assert dropin.UnsupportedServer is server_modes.UnsupportedServer is errors.UnsupportedServer
    assert settings.PluginError is errors.PluginError
    assert issubclass(errors.WrongCaptureLayers, ValueError)


def test_both_states_extend_the_core():
    assert issubclass(sglang_state.CaptureState, core.CaptureState)
    assert issubclass(vllm_state.CaptureState, core.CaptureState)
    assert sglang_state.SlotResidual is vllm_state.SlotResidual is core.SlotResidual


def _buffer(rows=4):
    return AuxCaptureBuffer(rows, 8, [5, 2], dtype=torch.float32)


def test_overflow_buffer_reused_per_size():
    state = core.CaptureState(_buffer())
    first, new = state.buffer_of(9, None)
    assert new and first.max_tokens == 9 and first.layer_ids == (2, 5)
    assert state.buffer_of(9, first) == (first, False)
    second, new = state.buffer_of(7, first)
    assert new and second.max_tokens == 7 and state.overflow_forwards == 2


def test_completeness_and_self_check_bookkeeping():
    state = core.CaptureState(_buffer())
    assert state.incomplete({2: 3, 5: 3}, 3) == {}
    assert state.incomplete({2: 3}, 3) == {5: None}
    assert state.incomplete({2: 3, 5: 1}, 3) == {5: 1}
    state.start_verify(2)
    state.verify_mismatches.append("layer 2: off")
    assert state.take_verified_forward() == ["layer 2: off"]
    assert (state.verify_left, state.verified_forwards, state.verify_mismatches) == (1, 1, [])
    state.switch_back()
    assert state.disabled and state.verify_left == 0


def test_vllm_state_overflow_and_completeness():
    """vLLM's state on the core: an oversized eager forward gets its own buffer, the
    next fitting one is back in the persistent buffer; a layer that stored nothing is
    named."""
    state = vllm_state.CaptureState(
        _buffer(), norm_fp32_sum=True, provider="native", compiled=False
    )
    state.begin(6)
    assert state.active is not state.buffer and state.overflow_forwards == 1
    state.begin(4)
    assert state.active is state.buffer
    state.stored_rows = {2: 4}
    with pytest.raises(RuntimeError, match=r"stored \{5: None\} rows"):
        state.check_complete(4)
    compiled = vllm_state.CaptureState(_buffer(), True, "native", compiled=True)
    with pytest.raises(ValueError, match="cannot take a buffer of its own"):
        compiled.begin(5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_tolerance_per_dtype(dtype):
    """The normed output may be a rounding off the engine's norm, never more; a NaN is
    always a mismatch."""
    ref = torch.linspace(-4, 4, 64).to(dtype)
    rtol = selfcheck.norm_rtol(dtype)
    assert not selfcheck.beyond_rounding(ref.clone(), ref)
    one_ulp = torch.nextafter(ref.float(), torch.full_like(ref.float(), 10)).to(dtype)
    assert not selfcheck.beyond_rounding(one_ulp, ref)
    off = ref.clone()
    off[3] += 4 * rtol * (1 + ref[3].abs().float().item())
    assert selfcheck.beyond_rounding(off, ref)
    nan = ref.clone()
    nan[0] = float("nan")
    assert selfcheck.beyond_rounding(nan, ref)


def test_the_core_imports_no_engine():
    """Both plugins load in every engine process: the shared core (and the vLLM state
    on it) must import neither engine."""
    code = (
        "import sys\n"
        "import eagle_capture.integrations.core.errors, eagle_capture.integrations.core.log\n"
        "import eagle_capture.integrations.core.selfcheck, eagle_capture.integrations.core.state\n"
        "import eagle_capture.integrations.settings, eagle_capture.integrations.vllm.state\n"
        "import eagle_capture.integrations.sglang.state\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'vllm'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
