"""What a family adapter names, and the reading every SGLang decoder layer shares.

A family is the set of SGLang model classes whose layer loop captures the same
way: :class:`Family` says where the captured norms are (each captured layer's
input norm, read through the surface that line's layer calls it through; the
final norm where the family captures the final boundary), which post-attention
norm can take the residual from the slot (the residual-in-slot path), how the model's own capture
is switched off and back on, and what the family does differently that the
fused capture refuses. The mechanism itself (the capturing norms, the state,
the install) knows no family: :mod:`..dropin`, :mod:`..norms`, :mod:`..state`.
"""

from typing import Optional

import torch

__all__ = ["Family", "UnknownFamily"]

NORM_ATTRS = ("weight", "variance_epsilon", "forward_native")


class UnknownFamily(TypeError):
    """A model whose loop no family adapter has been read against."""


class Family:
    """One family's adapter. Subclasses set the class attributes and override
    what their loop does differently; the defaults are the decoder layer most
    SGLang models share (``input_layernorm`` / ``post_attention_layernorm``,
    called directly, through a ``layer_communicator`` (<= 0.5.20) or through the
    ``attn_boundary`` / ``ffn_boundary`` stages (0.5.22+))."""

    name = "?"
    # SGLang's EntryClass names of this family (type(model).__name__).
    architectures: tuple = ()
    # Attributes of a wrapper (a multimodal model) that hold the text causal LM.
    wrappers: tuple = ()
    # Whether the family's decoder layer calls its input norm itself on some line
    # (no communicator, no boundary): the norm is then found by name only, and the
    # completeness check of every eager forward proves the call.
    direct_norm_calls = True
    # The first SGLang line whose loop captures the final boundary (id = the number
    # of layers: the final norm's input); None where none does.
    final_boundary_since: Optional[tuple] = None

    # ---------------------------------------------------------------- the model

    def text_model_of(self, model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
        """The causal LM holding ``.model.layers`` / ``.model.layers_to_capture`` and
        the attribute path to it (the model itself, or one of :attr:`wrappers`)."""
        if _looks_like_causal_lm(model):
            return model, ""
        for attr in self.wrappers:
            inner = getattr(model, attr, None)
            if _looks_like_causal_lm(inner):
                return inner, f".{attr}"
        found = (
            [n for n, child in model.named_children() if _looks_like_causal_lm(child)]
            if isinstance(model, torch.nn.Module)
            else []
        )
        known = ", ".join(["the model itself"] + [f".{a}" for a in self.wrappers])
        if found:
            raise TypeError(
                f"eagle_capture: {type(model).__name__} holds a {self.name} text model "
                f"at .{found[0]}, a wrapper eagle_capture does not know (known: "
                f"{known}); keep SGLang's own capture"
            )
        raise TypeError(
            f"eagle_capture: expected SGLang's {' / '.join(self.architectures)}, got "
            f"{type(model).__name__} (no .model.layers / .model.layers_to_capture)"
        )

    def captures_final_boundary(self, version: Optional[tuple]) -> bool:
        return (
            self.final_boundary_since is not None
            and version is not None
            and version >= self.final_boundary_since
        )

    def captured_norm(self, model: torch.nn.Module, layer_id: int) -> tuple[torch.nn.Module, str]:
        """The norm whose new residual is capture ``layer_id`` and the surface it is
        called through: layer ``layer_id``'s input norm, or the final norm for the
        final boundary (``layer_id == len(model.layers)``)."""
        if layer_id == len(model.layers):
            norm = getattr(model, "norm", None)
            _check_rmsnorm(norm, f"{self.name}'s final norm (model.norm)")
            return norm, "final norm (the final boundary)"
        return self.input_norm(model.layers[layer_id], layer_id)

    def input_norm(self, layer: torch.nn.Module, layer_id: int) -> tuple[torch.nn.Module, str]:
        """The captured layer's input norm and the surface it was found on."""
        norm = getattr(layer, "input_layernorm", None)
        comm = getattr(layer, "layer_communicator", None)
        boundary = getattr(layer, "attn_boundary", None)
        if comm is not None:
            surface = "layer_communicator (SGLang 0.5.9 - 0.5.20)"
            held = getattr(comm, "input_layernorm", None)
        elif boundary is not None:
            surface = "attn_boundary (SGLang 0.5.22 - 0.5.23)"
            held = getattr(getattr(boundary, "plan", None), "norm", None)
        elif self.direct_norm_calls:
            surface, held = f"the {self.name} decoder layer's own call", norm
        else:
            raise TypeError(
                f"eagle_capture: decoder layer {layer_id} ({type(layer).__name__}) "
                f"has neither layer_communicator (SGLang <= 0.5.20) nor "
                f"attn_boundary (SGLang 0.5.22 - 0.5.23): unsupported SGLang version"
            )
        if norm is None or held is not norm:
            raise TypeError(
                f"eagle_capture: layer {layer_id}'s {surface.split()[0]} calls another "
                f"input norm than layer.input_layernorm; unsupported SGLang version"
            )
        _check_rmsnorm(norm, f"layer {layer_id}'s input norm")
        return norm, surface

    def post_attention_norm(
        self, model: torch.nn.Module, layer_id: int
    ) -> Optional[torch.nn.Module]:
        """The captured layer's post-attention norm, if every surface SGLang calls it
        through holds the same RMSNorm, else None (the residual-in-slot path then
        stays off: the final boundary has none)."""
        if layer_id == len(model.layers):
            return None
        layer = model.layers[layer_id]
        norm = getattr(layer, "post_attention_layernorm", None)
        comm = getattr(layer, "layer_communicator", None)
        boundary = getattr(layer, "ffn_boundary", None) or getattr(layer, "mlp_boundary", None)
        if comm is not None:
            held = getattr(comm, "post_attention_layernorm", None)
        elif boundary is not None:
            held = getattr(getattr(boundary, "plan", None), "norm", None)
        elif self.direct_norm_calls:
            held = norm
        else:
            return None
        if norm is None or held is not norm or not all(hasattr(norm, a) for a in NORM_ATTRS):
            return None
        return norm

    # ------------------------------------------------- the model's own capture

    def engine_layers(self, causal_lm: torch.nn.Module) -> list[int]:
        """The layers the model's own capture is set to capture."""
        return list(causal_lm.model.layers_to_capture)

    def engine_capture_off(self, causal_lm: torch.nn.Module) -> None:
        """The model's own capture off: no add / list / packer copy, no aux handed on."""
        causal_lm.model.layers_to_capture = []
        causal_lm.capture_aux_hidden_states = False

    def engine_capture_on(self, causal_lm: torch.nn.Module, layers: list[int]) -> None:
        """The model's own capture back on for ``layers`` (the self-check's switch-back)."""
        causal_lm.model.layers_to_capture = list(layers)
        causal_lm.capture_aux_hidden_states = True

    def refuse(self, causal_lm: torch.nn.Module, layer_ids: list[int]) -> None:
        """Raise ``UnsupportedServer`` for what this family does differently around
        the captured norms in this model (its loop, its quantization)."""


def _looks_like_causal_lm(m) -> bool:
    inner = getattr(m, "model", None)
    return (
        isinstance(m, torch.nn.Module)
        and inner is not None
        and hasattr(inner, "layers")
        and hasattr(inner, "layers_to_capture")
        and hasattr(m, "capture_aux_hidden_states")
    )


def _check_rmsnorm(norm, what: str) -> None:
    if norm is None:
        raise TypeError(f"eagle_capture: {what} is missing")
    for attr in NORM_ATTRS:
        if not hasattr(norm, attr):
            raise TypeError(
                f"eagle_capture: {what} ({type(norm).__name__}) has no {attr!r}: "
                f"not SGLang's RMSNorm"
            )
