"""The SGLang adapters against a mirror of exactly the SGLang surface they
touch (tests/sglang_mirror.py): same captures as SGLang's own path, to the bit
on CPU (mirror norm and the ops' CPU path share their fp32 math)."""

import pytest
import torch

import eagle_capture as ec
import sglang_mirror as sg
from conftest import assert_bitwise_equal
from eagle_capture.sglang import install_classic_capture, install_packer_capture

NUM_LAYERS, HIDDEN, VOCAB = 8, 32, 50


def _randomise(model, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.1) + (1 if p.dim() == 1 else 0))
    return model


def _classic(draft_ids):
    model = _randomise(sg.ClassicDeepseekV2ForCausalLM(VOCAB, HIDDEN, NUM_LAYERS))
    model.set_eagle3_layers_to_capture(draft_ids)
    return model


@pytest.mark.parametrize("draft_ids", [[1, 3, 5], None, [2, 4, 6]])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_classic_adapter_equals_sglang_eager(draft_ids, num_tokens):
    ids = torch.randint(0, VOCAB, (num_tokens,))
    reference = _classic(draft_ids)
    expected = reference(ids, None, None)

    fused = _classic(draft_ids)
    buffer = install_classic_capture(fused, max_tokens=16)
    got = fused(ids, None, None)

    assert fused.model.layers_to_capture == []           # no h + r append any more
    assert buffer.layer_ids == tuple(sorted(reference.model.layers_to_capture))
    assert_bitwise_equal(got["hidden_states"], expected["hidden_states"])
    assert_bitwise_equal(got["logits"], expected["logits"])


def test_classic_adapter_hands_back_the_buffer_view():
    model = _classic([1, 3, 5])
    buffer = install_classic_capture(model, max_tokens=16)
    hidden, aux = model.model(torch.arange(5), None, None)
    assert len(aux) == 1 and aux[0].data_ptr() == buffer.aux.data_ptr()
    assert aux[0].shape == (5, 3 * HIDDEN)


def test_classic_adapter_refuses_misuse():
    model = sg.ClassicDeepseekV2ForCausalLM(VOCAB, HIDDEN, NUM_LAYERS)
    with pytest.raises(ValueError, match="set_eagle3_layers_to_capture"):
        install_classic_capture(model, 8)
    model.set_eagle3_layers_to_capture([1, 3, 5])
    install_classic_capture(model, 8)
    with pytest.raises(ValueError, match="already installed"):
        install_classic_capture(model, 8)
    with pytest.raises(ValueError, match="9 tokens but aux has only 8 rows"):
        model(torch.arange(9), None, None)


def test_classic_adapter_refuses_layers_this_pp_stage_does_not_run():
    model = _classic([1, 3, 5])
    model.model.end_layer = 5                               # a stage that ends before layer 6
    with pytest.raises(ValueError, match=r"layers \[6\]"):
        install_classic_capture(model, 8)


def _packer_model(layers_to_capture, seed=0):
    model = _randomise(sg.PackerDeepseekV2Model(VOCAB, HIDDEN, NUM_LAYERS), seed)
    model.layers_to_capture = list(layers_to_capture)
    return model


@pytest.mark.parametrize("layers_to_capture", [[2, 4, 6], [0, 3, 7], [1, 2]])
@pytest.mark.parametrize("shared_buffer", [False, True])
def test_packer_adapter_equals_sglang_packer(layers_to_capture, shared_buffer, monkeypatch):
    num_tokens = 6
    ids = torch.randint(0, VOCAB, (num_tokens,))

    def batch():
        if not shared_buffer:
            return sg.ForwardBatch()
        # The CUDA-graph runner's shared buffer, reused across batches.
        return sg.ForwardBatch(torch.full((num_tokens, len(layers_to_capture) * HIDDEN),
                                          float("nan")))

    ref_hidden, ref_aux = _packer_model(layers_to_capture)(ids, None, batch())
    model = _packer_model(layers_to_capture)
    assert install_packer_capture(model) == NUM_LAYERS
    appends = []
    original_append = sg.AuxHiddenStatePacker.append
    monkeypatch.setattr(sg.AuxHiddenStatePacker, "append",
                        lambda self, x: (appends.append(1), original_append(self, x)))
    fb = batch()
    hidden, aux = model(ids, None, fb)
    # Only layer 0 (no residual yet: the embedding) goes through SGLang's append copy.
    assert len(appends) == (1 if 0 in layers_to_capture else 0)
    assert_bitwise_equal(aux, ref_aux)
    assert_bitwise_equal(hidden, ref_hidden)
    if shared_buffer:
        assert aux.data_ptr() == fb.aux_hidden_states_buffer.data_ptr()


def test_packer_adapter_keeps_finalize_count_check():
    model = _packer_model([2, 4, 6])
    install_packer_capture(model)
    model.layers_to_capture = [2, 4, 6, 9]                  # a layer the loop never reaches
    with pytest.raises(RuntimeError, match="captured 3 of 4"):
        model(torch.arange(4), None, sg.ForwardBatch())


def test_packer_adapter_defers_to_sglang_when_told():
    model = _packer_model([2, 4, 6])
    install_packer_capture(model, when=lambda fb: False)
    ref = _packer_model([2, 4, 6])
    ids = torch.arange(5)
    assert_bitwise_equal(model(ids, None, sg.ForwardBatch())[1],
                         ref(ids, None, sg.ForwardBatch())[1])
    # Installing twice wraps nothing more.
    assert install_packer_capture(model) == 0


def test_classic_adapter_patches_the_norm_the_layer_really_calls():
    """SGLang's decoder layer runs its input norm through layer_communicator,
    which holds its own reference: the buffer must be written every step (here
    poisoned in between), not left stale."""
    ids = torch.randint(0, VOCAB, (6,))
    expected = _classic([1, 3, 5])(ids, None, None)["hidden_states"]
    model = _classic([1, 3, 5])
    buffer = install_classic_capture(model, max_tokens=16)
    for layer in (2, 4, 6):
        assert model.model.layers[layer].layer_communicator.input_layernorm is \
            model.model.layers[layer].input_layernorm
    for _ in range(2):
        buffer.aux.fill_(float("nan"))
        assert_bitwise_equal(model(ids, None, None)["hidden_states"], expected)


def test_classic_adapter_refuses_a_norm_path_that_skips_the_capture():
    """With the fused all-reduce + RMSNorm path the capturing norm's forward is not
    called: an error, never a stale buffer."""
    model = _classic([1, 3, 5])
    for layer in model.model.layers:
        layer.layer_communicator.allreduce_fusion = True
    install_classic_capture(model, max_tokens=16)
    with pytest.raises(RuntimeError, match="only 0 of the 3 captured layers"):
        model(torch.arange(4), None, None)


def test_packer_adapter_falls_back_to_sglangs_capture_on_another_norm_path():
    ids = torch.randint(0, VOCAB, (5,))
    ref = _packer_model([2, 4, 6])
    model = _packer_model([2, 4, 6])
    for m in (ref, model):
        for layer in m.layers:
            layer.layer_communicator.allreduce_fusion = True
    install_packer_capture(model)
    ref_hidden, ref_aux = ref(ids, None, sg.ForwardBatch())
    hidden, aux = model(ids, None, sg.ForwardBatch())
    assert_bitwise_equal(aux, ref_aux)
    assert_bitwise_equal(hidden, ref_hidden)
