"""Will these CUDA extensions load under another torch? Their LibTorch needs, read
from the ELF files with binutils' ``nm``:

    python3 tools/gpu/torch_abi_check.py EXT.so ... [--torch-wheel torch-2.11.0-...whl]

* C++ symbols of c10 / at / torch / caffe2 (mangled ``_ZN3c10``, ``_ZN2at``, ...) tie an
  extension to the torch it was built with: any such undefined symbol fails the check.
* Extensions built on LibTorch's stable C ABI (vLLM's since 0.29) need only C functions
  (``aoti_torch_*``, ``torch_*``); with ``--torch-wheel`` each must be defined by that
  wheel's ``libtorch*.so`` / ``libc10*.so``.

One line per extension; exit 0 when every one passes, 1 when one fails, 2 on bad input.
Used by tools/gpu/make_vllm_engine_bundle.sh (the GPU image runs torch 2.11).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import zipfile

MANGLED = re.compile(r"^_ZN(K)?(3c10|2at|5torch|6caffe2)")
STABLE = re.compile(r"^(aoti_torch|torch_)")
TORCH_LIBS = re.compile(r"^torch/lib/lib(torch|torch_cpu|torch_cuda|c10|c10_cuda)\.so$")


def symbols(path: str, defined: bool) -> set:
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run(["nm", "-D", flag, path], capture_output=True, text=True, check=True)
    return {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.split()}


def torch_symbols(wheel: str) -> tuple:
    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
        names = [n for n in z.namelist() if TORCH_LIBS.match(n)]
        if not names:
            raise ValueError(f"{wheel}: no torch/lib/libtorch*.so in it")
        version = z.read("torch/version.py").decode().split("__version__ = ")[1].split("\n")[0]
        found = set()
        for name in names:
            found |= symbols(z.extract(name, tmp), defined=True)
            os.remove(os.path.join(tmp, name))
    return found, version.strip("'\"")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("extensions", nargs="+")
    p.add_argument("--torch-wheel", help="the torch wheel the extensions must load under")
    args = p.parse_args(argv)
    for path in [*args.extensions, *([args.torch_wheel] if args.torch_wheel else [])]:
        if not os.path.isfile(path):
            print(f"torch_abi_check: {path}: no such file", file=sys.stderr)
            return 2
    try:
        provided, version = torch_symbols(args.torch_wheel) if args.torch_wheel else (None, None)
    except (ValueError, KeyError, zipfile.BadZipFile) as e:
        print(f"torch_abi_check: {e}", file=sys.stderr)
        return 2
    failed = False
    for path in args.extensions:
        needed = symbols(path, defined=False)
        mangled = sorted(s for s in needed if MANGLED.match(s))
        stable = sorted(s for s in needed if STABLE.match(s))
        missing = sorted(set(stable) - provided) if provided is not None else []
        ok = not mangled and not missing
        failed |= not ok
        against = f", all in torch {version}" if provided is not None and not missing else ""
        print(
            f"{'ok  ' if ok else 'FAIL'} {os.path.basename(path)}: {len(mangled)} LibTorch C++ "
            f"symbols, {len(stable)} stable C ABI symbols{against}"
            + (f"; C++: {' '.join(mangled[:5])}" if mangled else "")
            + (f"; not in torch {version}: {' '.join(missing[:8])}" if missing else "")
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
