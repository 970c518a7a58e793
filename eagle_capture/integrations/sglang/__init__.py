"""SGLang: the drop-in for its model loops (:mod:`.dropin`; one adapter per family in
:mod:`.families`: DeepseekV2 / Kimi, Llama / Qwen2 / Qwen3, Qwen-MoE, GPT-OSS, GLM-4 MoE,
MiniMax-M2), the plugin that
installs it in every scheduler process (:mod:`.plugin`) and the buffer's sizing
from the server's arguments (:mod:`.sizing`). What each SGLang release does is
recorded in docs/engine_facts.md. Nothing is imported here: SGLang loads the
plugin in every process, and it imports the rest only when switched on."""
