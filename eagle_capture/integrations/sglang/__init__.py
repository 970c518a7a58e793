"""SGLang: the drop-in for its DeepseekV2 loop (:mod:`.dropin`), the plugin that
installs it in every scheduler process (:mod:`.plugin`) and the buffer's sizing
from the server's arguments (:mod:`.sizing`). What each SGLang release does is
recorded in docs/engine_facts.md. Nothing is imported here: SGLang loads the
plugin in every process, and it imports the rest only when switched on."""
