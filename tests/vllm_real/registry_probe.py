"""Which class vLLM's registry resolves for ``DeepseekV3ForCausalLM`` after vLLM's own
``load_general_plugins()``: the plugin switched off, or filtered out by ``VLLM_PLUGINS``
(tests/test_vllm_real.py::test_plugin_off_and_filtered). Prints ``CLS <name>``."""

from vllm import ModelRegistry
from vllm.plugins import load_general_plugins

if __name__ == "__main__":
    load_general_plugins()
    print("CLS", ModelRegistry._try_load_model_cls("DeepseekV3ForCausalLM").__name__)
