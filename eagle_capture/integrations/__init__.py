"""Serving-engine integrations of the fused capture, each in a folder of its own
(:mod:`.sglang`, :mod:`.vllm`, split alike: plugin, state, norms, install, sizing),
on what they share (:mod:`.core`: errors, capture state, self-check tolerance,
loggers; :mod:`.settings`: the environment switches), the core ops and the
layer-id library."""
