"""``eagle-capture`` (or ``python -m eagle_capture``): the command line.

    eagle-capture doctor ...   what each engine will capture for a draft, read from the
                               configs (eagle_capture/cli/doctor.py; its library:
                               eagle_capture/layer_ids/diagnosis.py)
    eagle-capture probe ...    which layers the draft was trained on, measured by running
                               the target and the draft (eagle_capture/cli/probe.py;
                               the measurement: eagle_capture/probe/)

Each command parses its own arguments; this module only dispatches, so that it imports
nothing heavy: ``--help``, ``--version`` and the doctor need neither torch nor Triton.
"""

import argparse
import importlib
import sys

from eagle_capture import __version__

# name -> (module whose main(argv) runs it, what it does: the top-level help's line)
COMMANDS = {
    "doctor": (
        "eagle_capture.cli.doctor",
        "what each SGLang release and vLLM runner will capture for a draft's layer ids "
        "and what the draft expects, read from the draft's and the target's configs "
        "(exit 0: as trained; 1: not, or unknown)",
    ),
    "probe": (
        "eagle_capture.cli.probe",
        "which layers a draft was trained on, measured by running the target and the "
        "draft on calibration text: in transformers (needs torch and transformers), or "
        "in vLLM's engine at the tensor-parallel size you serve with (--engine vllm)",
    ),
}


class _HelpFormatter(argparse.HelpFormatter):
    def _format_action(self, action):
        text = super()._format_action(action)
        if isinstance(action, argparse._SubParsersAction):  # drop the lone "COMMAND" line
            text = text.split("\n", 1)[1]
        return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle-capture",
        formatter_class=_HelpFormatter,
        usage=(
            "%(prog)s doctor --draft-config CONFIG (--target-config CONFIG | --num-layers N) "
            "[options]\n       %(prog)s probe --target DIR --draft DIR [options]\n"
            "       %(prog)s [-h] [-V]"
        ),
        description="Fused EAGLE-3 aux-hidden-state capture for SGLang and vLLM: check which "
        "target layers a draft model receives before you serve it.",
        epilog="'eagle-capture COMMAND --help' lists a command's options.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, (_, text) in COMMANDS.items():
        commands.add_parser(name, help=text)
    return parser


def _top_level(argv: list) -> int:
    """``--help`` / ``--version`` (exit 0), nothing (the help, exit 2), anything else: one
    line, exit 2."""
    parser = _parser()
    if not argv:
        parser.print_help()
        return 2
    if argv[0] in ("-h", "--help", "-V", "--version"):
        try:
            parser.parse_args(argv[:1])
        except SystemExit as done:  # argparse printed the help or the version
            return done.code
    what = (
        f"unknown option {argv[0]!r}" if argv[0].startswith("-") else f"unknown command {argv[0]!r}"
    )
    print(
        f"eagle-capture: {what} (commands: {', '.join(COMMANDS)}; "
        f"'eagle-capture --help' says more)",
        file=sys.stderr,
    )
    return 2


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        return _top_level(argv)
    module, _ = COMMANDS[argv[0]]
    try:
        command = importlib.import_module(module).main
    except ModuleNotFoundError as missing:
        # The probe runs the models: without torch (a doctor-only install) it cannot start.
        if missing.name is None or missing.name.split(".")[0] == "eagle_capture":
            raise
        print(
            f"eagle-capture {argv[0]}: needs {missing.name}, which this Python does not have "
            f"(pip install 'eagle-capture[probe]' in a Python with torch)",
            file=sys.stderr,
        )
        return 2
    return command(argv[1:])


def console_main() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
