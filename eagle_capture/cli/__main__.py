"""``python -m eagle_capture.cli``: the same as ``python -m eagle_capture``."""

from eagle_capture.cli import console_main

if __name__ == "__main__":  # not again in a process spawned from this one (vLLM's, the probe's)
    console_main()
