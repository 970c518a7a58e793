"""The id probe: which target layers an EAGLE-3 draft was trained on, measured from
its first speculative step (``eagle-capture probe``; :mod:`.probe`). Needs
transformers (the target runs as a Hugging Face model)."""
