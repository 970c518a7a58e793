"""vLLM integration: the plugin (``vllm.general_plugins``, :mod:`.plugin`), the
capturing model classes it registers (:mod:`.model`: DeepseekV2 / DeepSeek-V3 and
the families of :mod:`.families`), their install (:mod:`.install`), capturing norms
(:mod:`.norms`), capture state (:mod:`.state`) and buffer rows (:mod:`.sizing`); the
check-only classes of vLLM's other EAGLE-3 targets (:mod:`.checked`) and the
probe's worker extension (:mod:`.probe_capture`). Nothing is imported here: the
plugin is loaded in every vLLM process."""
