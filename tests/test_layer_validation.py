"""One validation of capture layers (eagle_capture.layer_ids.validate): the aux
buffer, the SGLang drop-in (and its plugin, which calls the drop-in's check), the
vLLM plugin's id check, the plugins' start-up check and the probe refuse the same
bad ids with the same message. Every caller here is the product's own function;
the engines' installs that call them run in tests/test_sglang_real.py and
tests/test_vllm_real.py."""

import pytest
import torch

from eagle_capture.buffer import AuxCaptureBuffer
from eagle_capture.integrations.sglang import dropin
from eagle_capture.integrations.vllm import checked
from eagle_capture.layer_ids import startup
from eagle_capture.layer_ids.validate import CaptureLayerError, check_capture_layers
from eagle_capture.probe.target import target_states

N = 8  # the target's decoder layers
PREFIX = "eagle_capture: "


def _message(call) -> str:
    """The refusal's text without the prefix the start-up check's verdicts drop."""
    try:
        call()
    except ValueError as e:
        return str(e).replace(PREFIX, "", 1)
    raise AssertionError("accepted")


def _startup(ids):
    verdict = startup.check("SGLang", ids, N, None)
    if verdict.status != "problem":
        return
    raise ValueError(verdict.text)


# Each caller, told what it knows: the buffer no layer count; the drop-in (SGLang's
# loop on a line capturing the final boundary, embedding refused by default), the
# vLLM plugin (DeepseekV2: id 0 refused) and the probe the layer count; the start-up
# check no layer count, the embedding output refused.
CALLERS = {
    "buffer": lambda ids: AuxCaptureBuffer(4, 16, ids, dtype=torch.float32),
    "drop-in": lambda ids: dropin.check_capture_layers(
        ids, 0, N, False, final_boundary=True, num_layers=N
    ),
    "vLLM plugin": lambda ids: checked.check_layer_ids(ids, N, 0, N, embedding_id=False),
    "start-up check": _startup,
    # The probe keeps each layer once (its readings share layers) and sorts them.
    "probe": lambda ids: target_states(
        None,
        torch.nn.ModuleList(torch.nn.Identity() for _ in range(N)),
        torch.zeros(1, 1, dtype=torch.long),
        ids,
    ),
}

# Bad ids -> the callers that refuse them (the others lack what it takes to know).
CASES = {
    "duplicate": ([2, 2, 5], ("buffer", "drop-in", "vLLM plugin", "start-up check")),
    "negative": ([-1, 3, 5], tuple(CALLERS)),
    "empty": ([], tuple(CALLERS)),
    "not integers": ([2, True, 5], ("buffer", "drop-in", "vLLM plugin", "start-up check")),
    "past the last layer's output": ([2, 4, N + 1], ("drop-in", "vLLM plugin", "probe")),
    "the embedding output": ([0, 4, 5], ("drop-in", "vLLM plugin", "start-up check")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_caller_refuses_with_the_same_message(case):
    ids, callers = CASES[case]
    expected = _message(
        lambda: check_capture_layers(ids, num_layers=N, embedding=False, stage=(0, N))
    )
    messages = {name: _message(lambda: CALLERS[name](list(ids))) for name in callers}
    assert set(messages.values()) == {expected}, messages


def test_the_errors_each_caller_raises():
    """The plugins' policies catch their own class; the rest get the shared one."""
    with pytest.raises(dropin.WrongCaptureLayers, match="more than once"):
        dropin.check_capture_layers([2, 2], 0, N, False)
    with pytest.raises(checked.WrongCaptureLayers, match="more than once"):
        checked.check_layer_ids([2, 2], N, 0, N)
    with pytest.raises(CaptureLayerError, match="more than once"):
        AuxCaptureBuffer(4, 16, [2, 2])
    assert startup.check("vLLM", [2, 2, 5], N, None).status == "problem"


def test_what_each_caller_accepts():
    """The same rules where the caller knows them: the final boundary where the loop
    captures it, the embedding where allowed, this pipeline stage's layers."""
    assert check_capture_layers((5, 2, N)) == [2, 5, N]
    assert (
        dropin.check_capture_layers([2, N], 0, N, False, final_boundary=True, num_layers=N) is None
    )
    with pytest.raises(dropin.WrongCaptureLayers, match=rf"outside 0\.\.{N - 1}"):
        dropin.check_capture_layers([2, N], 0, N, False, num_layers=N)
    assert dropin.check_capture_layers([0, 3], 0, N, True, num_layers=N) is None
    assert checked.check_layer_ids([0, 3, N], N, 0, N, embedding_id=True) == [0, 3, N]
    # The last of two stages (layers 4..7): another stage's layer, and the boundary.
    with pytest.raises(
        checked.WrongCaptureLayers,
        match=r"another pipeline stage \(this rank "
        r"runs layers 4\.\.7\)",
    ):
        checked.check_layer_ids([2, 5, N], N, 4, N)
    assert checked.check_layer_ids([N, 4, 6], N, 4, N) == [4, 6, N]
    # A first stage (0..3) never takes the final boundary.
    with pytest.raises(dropin.WrongCaptureLayers, match="another pipeline stage"):
        dropin.check_capture_layers([2, N], 0, 4, False, final_boundary=True, num_layers=N)
    assert AuxCaptureBuffer(4, 16, [30, 0, 2]).layer_ids == (0, 2, 30)
