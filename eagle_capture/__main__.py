"""``python -m eagle_capture``: the ``eagle-capture`` command line."""

from eagle_capture.cli import console_main

if __name__ == "__main__":  # not again in a process spawned from this one (vLLM's, the probe's)
    console_main()
