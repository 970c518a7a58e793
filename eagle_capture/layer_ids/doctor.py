"""``python -m eagle_capture.layer_ids.doctor``: the doctor's command line,
:mod:`eagle_capture.cli.doctor` (``eagle-capture doctor``), run the way the docs
have always shown it; the library it prints is :mod:`.diagnosis`."""

if __name__ == "__main__":
    import sys

    from eagle_capture.cli.doctor import main

    sys.exit(main())
