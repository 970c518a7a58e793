"""End to end: the fused capture inside an SGLang-style DeepseekV2 loop equals
SGLang's eager capture, and equals what the draft was trained on -- HF
transformers' output_hidden_states for the draft's ids (training/serving skew).

The tests' tiny random-init DeepSeek-V3 (eagle_capture.testing.models: MLA
attention, yarn rope, MoE after the first dense layer); no downloads.
"""

import pytest
import torch
import transformers  # noqa: E402  (a test dependency: scripts/setup_env.sh installs it)

from conftest import HAS_CUDA, assert_bitwise_equal
from eagle_capture.layer_ids.plan import CapturePlanError, build_plan, specforge_default_ids
from eagle_capture.testing.models import tiny_deepseek_v3_config
from eagle_capture.testing.reference_loop import SGLangDeepseekLoop, hf_training_capture


def tiny_deepseek(num_layers: int, dtype=torch.float32, device="cpu", seed=0):
    torch.manual_seed(seed)
    config = tiny_deepseek_v3_config(num_layers, vocab_size=97, first_k_dense_replace=1)
    config._attn_implementation = "sdpa"
    model = transformers.DeepseekV3Model(config).to(dtype=dtype, device=device).eval()
    # Random init leaves the norms at 1 and the router biases at 0: perturb them so a
    # wrong weight or a skipped norm shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def input_ids(num_tokens, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (1, num_tokens), generator=g).to(device)


CASES = [  # (num_layers, draft ids or None for defaults, tokens)
    (6, [1, 2, 3], 5),
    (8, None, 17),
    (9, specforge_default_ids(9), 33),
    (12, [0, 5, 9], 3),  # output of layer 0 = input to layer 1
]


@pytest.mark.parametrize("num_layers,draft_ids,num_tokens", CASES)
def test_fused_equals_training_side_fp32(num_layers, draft_ids, num_tokens):
    model = tiny_deepseek(num_layers)
    ids = input_ids(num_tokens)
    plan = build_plan(draft_ids, num_layers)  # SpecForge convention: ids = outputs
    loop = SGLangDeepseekLoop(model)
    _, fused = loop.forward(ids, plan.layers_to_capture, capture="fused")
    trained_ids = [s.output_of_layer for s in plan.slots]
    expected = hf_training_capture(model, ids, trained_ids)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_eager_capture_bitwise(dtype):
    """Same inputs, same kernels for the layers' norms: the only difference is
    where the capture is stored, so the buffers are equal to the bit (bf16 too:
    the stored value is the one rounding of h + r in both)."""
    model = tiny_deepseek(8, dtype=dtype)
    ids = input_ids(11)
    loop = SGLangDeepseekLoop(model)
    layers = [2, 4, 6]
    h_eager, eager = loop.forward(ids, layers, capture="eager")
    h_fused, fused = loop.forward(ids, layers, capture="fused")
    assert_bitwise_equal(fused, eager)
    assert_bitwise_equal(h_fused, h_eager)


def test_embedding_capture_at_layer_0_is_the_embedding_output():
    model = tiny_deepseek(6)
    ids = input_ids(4)
    plan = build_plan([0, 2, 3], 6, convention="input", allow_embedding=True)
    _, fused = SGLangDeepseekLoop(model).forward(ids, plan.layers_to_capture)
    torch.testing.assert_close(fused[:, :64], model.embed_tokens(ids)[0], rtol=0, atol=0)


def test_the_users_scenario_on_a_61_layer_target():
    """ids [-1, 2, 30] are refused with the explanation; [2, 30, 58] under the
    SGLang <= 0.5.12 rule captures HF hidden_states[3, 31, 59] -- what the
    draft was trained on (the outputs of layers 2, 30, 58)."""
    with pytest.raises(CapturePlanError, match="embedding output.*47%"):
        build_plan([-1, 2, 30], 61, sglang_version="0.5.12")
    plan = build_plan([2, 30, 58], 61, sglang_version="0.5.12")
    assert [s.hf_hidden_states_index for s in plan.slots] == [3, 31, 59]
    model = tiny_deepseek(61)
    ids = input_ids(6)
    _, fused = SGLangDeepseekLoop(model).forward(ids, plan.layers_to_capture)
    torch.testing.assert_close(
        fused, hf_training_capture(model, ids, [2, 30, 58]), rtol=1e-5, atol=1e-5
    )
    # The same config on SGLang >= 0.5.13 is shifted by one layer: not what was trained.
    late = build_plan([2, 30, 58], 61, sglang_version="0.5.13")
    _, shifted = SGLangDeepseekLoop(model).forward(ids, late.layers_to_capture)
    assert not torch.allclose(shifted, fused, rtol=1e-3, atol=1e-3)
    assert any("0.5.12" in w and "0.5.13" in w for w in late.warnings)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_fused_loop_on_gpu_equals_training_side():
    model = tiny_deepseek(9, device="cuda")
    ids = input_ids(40, device="cuda")
    plan = build_plan(specforge_default_ids(9), 9)
    h_eager, eager = SGLangDeepseekLoop(model).forward(ids, plan.layers_to_capture, capture="eager")
    h_fused, fused = SGLangDeepseekLoop(model).forward(ids, plan.layers_to_capture)
    assert_bitwise_equal(fused, eager)
    expected = hf_training_capture(model, ids, [s.output_of_layer for s in plan.slots])
    torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-4)
