"""``eagle-capture``: the command line.

    eagle-capture doctor ...   what each engine will capture for a draft, read from the
                               configs (eagle_capture/layer_ids/doctor.py)
    eagle-capture probe ...    which layers the draft was trained on, measured by running
                               the target and the draft (eagle_capture/probe/probe.py)
"""

import sys

COMMANDS = ("doctor", "probe")
USAGE = ("usage: eagle-capture doctor [--help] --draft-config ... (--target-config ... | "
         "--num-layers N) [deployment options]\n"
         "       eagle-capture probe [--help] --target DIR --draft DIR [--prompts FILE] "
         "[--device cuda|cpu] [--dtype bf16|fp16|fp32]")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "doctor":
        from eagle_capture.layer_ids.doctor import main as doctor
        return doctor(rest)
    if command == "probe":
        from eagle_capture.probe.probe import main as probe
        return probe(rest)
    print(f"eagle-capture: unknown command {command!r} (commands: {', '.join(COMMANDS)})",
          file=sys.stderr)
    return 2


def console_main() -> None:
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
