"""vLLM integration: the plugin (``vllm.general_plugins``) and the capturing
DeepseekV2 / DeepSeek-V3 model classes it registers."""
