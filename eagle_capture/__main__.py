"""``python -m eagle_capture``: the ``eagle-capture`` command line."""

from eagle_capture.cli import console_main

console_main()
