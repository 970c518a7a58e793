"""What the SGLang and vLLM integrations share, written once: the errors a plugin
raises (:mod:`.errors`), the capture state every engine's capturing norms share --
the buffer, the rows each captured layer stored, the overflow buffer of an oversized
eager forward, the residual left in a slot, the self-check's bookkeeping
(:mod:`.state`) --, the self-check's tolerance (:mod:`.selfcheck`) and the loggers
and rank a log line names (:mod:`.log`). The environment switches are
:mod:`eagle_capture.integrations.settings`; which capture layers are valid is
:mod:`eagle_capture.layer_ids.validate`. Nothing here imports an engine."""
