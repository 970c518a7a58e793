"""FlashInfer's ``fused_add_rmsnorm`` for the benchmarks: the strongest peer of our norm.

:func:`load` returns ``(fused_add_rmsnorm or None, one line saying which FlashInfer
and how it was loaded)``. In order:

1. ``from flashinfer.norm import fused_add_rmsnorm``: an installed flashinfer-python.
2. Else FlashInfer's norm from a bundle made by ``tools/gpu/make_gpu_bundle.sh``
   (``FLASHINFER_ONLY=1`` makes just this part; default folder ``.gpu_bundle`` at
   the repository root, or ``$EAGLE_CAPTURE_FLASHINFER_BUNDLE``): the trimmed
   flashinfer-python tree (every .py file, the norm module's CUDA sources and the
   headers they include) and the apache-tvm-ffi wheel are unpacked into
   ``$EAGLE_CAPTURE_FLASHINFER_SITE`` (default ``/tmp/ec_flashinfer``) and imported
   from there. The norm module itself is FlashInfer's own JIT build of those
   sources on this machine (nvcc + ninja; CUDA_HOME, cuBLAS headers and the
   libcuda link found as tools/gpu/gpu_sglang_real.sh finds them); where that
   fails on an sm_90 GPU, the bundle's prebuilt sm_90a build of the same sources,
   installed as FlashInfer's AOT module.

Either way the function is FlashInfer's Python entry point (``enable_pdl``
defaults to the device's support, as SGLang calls it), and one small call has run
and been checked against torch before it is returned. Where nothing works the
line says why; the benchmarks then skip their FlashInfer paths with it.
"""

import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
BUNDLE_ENV = "EAGLE_CAPTURE_FLASHINFER_BUNDLE"
SITE_ENV = "EAGLE_CAPTURE_FLASHINFER_SITE"


def _installed() -> tuple:
    try:
        from flashinfer.norm import fused_add_rmsnorm
    except Exception as exc:  # noqa: BLE001 - not installed, or its JIT / tvm-ffi missing
        return (
            None,
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
        )
    return fused_add_rmsnorm, None


def bundle_parts(bundle: Path) -> Optional[dict]:
    """The bundle's FlashInfer pieces ({"tree", "version", "wheels", "prebuilt"}),
    or None where it has no trimmed FlashInfer tree."""
    trees = sorted(bundle.glob("flashinfer-*-norm.tar.xz"))
    if not trees:
        return None
    version = trees[-1].name[len("flashinfer-") : -len("-norm.tar.xz")]
    prebuilt = bundle / "prebuilt" / f"flashinfer-{version}-norm-sm90a.so"
    return {
        "tree": trees[-1],
        "version": version,
        "wheels": sorted((bundle / "wheels").glob("apache_tvm_ffi-*.whl")),
        "prebuilt": prebuilt if prebuilt.is_file() else None,
    }


def _cuda_env(arch: str) -> list:
    """Set what FlashInfer's JIT build of its CUDA norm module needs (as
    tools/gpu/gpu_sglang_real.sh does); returns notes for the report line."""
    notes = []
    os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")  # the CUDA norm, not CuTe-DSL
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fiws")
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", arch)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    if not os.environ.get("CUDA_HOME") and shutil.which("nvcc"):
        # nvcc may be a wrapper script; nvcc itself names its toolkit (TOP=...).
        dry = subprocess.run(
            ["nvcc", "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"],
            capture_output=True,
            text=True,
        )
        for line in (dry.stdout + dry.stderr).splitlines():
            if line.startswith("#$ TOP="):
                top = Path(line.split("=", 1)[1].strip()).resolve()
                if (top / "include").is_dir():
                    os.environ["CUDA_HOME"] = str(top)
                break
    home = Path(os.environ.get("CUDA_HOME", "/nonexistent"))
    if home.is_dir() and not (home / "include" / "cublasLt.h").is_file():
        try:
            import nvidia  # torch's CUDA wheels: cublasLt.h lives in nvidia-cublas

            found = [
                h.parent for p in nvidia.__path__ for h in Path(p).glob("*/include/cublasLt.h")
            ]
        except ImportError:
            found = []
        if found:
            os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] = (
                os.environ.get("FLASHINFER_EXTRA_CUDAFLAGS", "") + f" -isystem {found[0]}"
            ).strip()
            notes.append(f"cublasLt.h from {found[0]}")
    if home.is_dir() and not any(
        (home / d / "libcuda.so").exists() for d in ("lib64/stubs", "lib64")
    ):
        libs = [
            p
            for d in ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64")
            for p in sorted(Path(d).glob("libcuda.so*"))
        ]
        if libs:
            link = Path("/tmp/ec_cudalink")
            link.mkdir(exist_ok=True)
            target = link / "libcuda.so"
            if target.is_symlink() or target.exists():
                target.unlink()
            target.symlink_to(libs[0])
            os.environ["FLASHINFER_EXTRA_LDFLAGS"] = (
                os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "") + f" -L{link}"
            ).strip()
            notes.append(f"linked against {libs[0]}")
    return notes


def _nvcc_version() -> str:
    if not shutil.which("nvcc"):
        return "no nvcc"
    out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    lines = [ln for ln in out.splitlines() if "release" in ln]
    return lines[-1].split(",")[1].strip() if lines and "," in lines[-1] else "nvcc"


def unpack(parts: dict, site: Path) -> None:
    """The trimmed tree and the tvm-ffi wheel into ``site`` (once per bundle)."""
    marker = site / f".unpacked-{parts['tree'].stat().st_size}"
    if marker.exists():
        return
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    with tarfile.open(parts["tree"]) as tar:
        # (the "data" filter where tarfile has one: Python 3.11.4+, 3.12+)
        tar.extractall(site, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    for wheel in parts["wheels"]:  # a wheel is a zip of its site-packages files
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
            for info in z.infolist():  # zip drops the executable bits of its .so files
                mode = info.external_attr >> 16
                if mode:
                    os.chmod(site / info.filename, mode & 0o777)
    marker.touch()


def _check(fn: Callable) -> None:
    """One small call, against torch (FlashInfer's math: the fp32 sum's norm)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, 512, generator=g).to("cuda", torch.bfloat16)
    r = torch.randn(3, 512, generator=g).to("cuda", torch.bfloat16)
    w = (1 + 0.1 * torch.randn(512, generator=g)).to("cuda", torch.bfloat16)
    s = x.float() + r.float()
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    fn(x, r, w, 1e-6)
    torch.cuda.synchronize()
    if not torch.equal(r, s.to(torch.bfloat16)):
        raise RuntimeError("its residual output differs from h + r")
    rel = ((x.float() - ref).norm() / ref.norm()).item()
    if rel > 1e-2:
        raise RuntimeError(f"its normed output is off (rel err {rel:.1e})")


def load() -> tuple:
    """(FlashInfer's fused_add_rmsnorm or None, a line: which FlashInfer, how loaded)."""
    fn, why = _installed()
    if fn is not None:
        import flashinfer

        _check(fn)
        return fn, (
            f"flashinfer {getattr(flashinfer, '__version__', '?')} "
            f"(installed package, {Path(flashinfer.__file__).parent})"
        )
    bundle = Path(os.environ.get(BUNDLE_ENV, REPO / ".gpu_bundle"))
    parts = bundle_parts(bundle)
    if parts is None:
        return None, (
            f"flashinfer's norm does not import ({why}) and {bundle} holds no "
            f"flashinfer-*-norm.tar.xz (FLASHINFER_ONLY=1 bash tools/gpu/make_gpu_bundle.sh)"
        )
    import torch

    try:
        major, minor = torch.cuda.get_device_capability()
    except Exception:  # noqa: BLE001 - no usable CUDA device
        return None, "no CUDA GPU: FlashInfer's norm is a CUDA kernel"
    arch = f"{major}.{minor}{'a' if major == 9 else ''}"
    site = Path(os.environ.get(SITE_ENV, "/tmp/ec_flashinfer"))
    try:
        unpack(parts, site)
    except Exception as exc:  # noqa: BLE001 - say why, run the rest
        return None, f"cannot unpack {parts['tree']}: {type(exc).__name__}: {exc}"
    aot = site / "flashinfer" / "data" / "aot" / "norm" / "norm.so"
    if aot.exists():
        aot.unlink()
    notes = _cuda_env(arch)
    sys.path.insert(0, str(site))
    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        del sys.modules[name]
    t0 = time.time()
    try:
        import flashinfer
        from flashinfer.jit.norm import gen_norm_module
        from flashinfer.norm import fused_add_rmsnorm
    except Exception as exc:  # noqa: BLE001 - the benchmarks go on without the peer
        return None, (
            f"flashinfer {parts['version']} from {parts['tree'].name} does not import: "
            f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
        )
    try:
        gen_norm_module().build(verbose=False)
        _check(fused_add_rmsnorm)
        how = (
            f"its norm module JIT-built here from its kernel source for sm_{arch.replace('.', '')}"
            f" by {_nvcc_version()} in {time.time() - t0:.0f} s"
            + (f"; {'; '.join(notes)}" if notes else "")
        )
    except Exception as exc:  # noqa: BLE001 - the prebuilt module, if any, else no peer
        jit_error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
        if parts["prebuilt"] is None or arch != "9.0a":
            return None, (
                f"flashinfer {parts['version']}: the JIT build of its norm module "
                f"failed ({jit_error}) and the bundle has no prebuilt module for "
                f"sm_{arch.replace('.', '')}"
            )
        # FlashInfer loads data/aot/norm/norm.so as its AOT module; the failed
        # JIT module must not be found first (fresh import, fresh module cache).
        aot.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(parts["prebuilt"], aot)
        for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
            del sys.modules[name]
        try:
            import flashinfer
            from flashinfer.norm import fused_add_rmsnorm

            _check(fused_add_rmsnorm)
        except Exception as exc2:  # noqa: BLE001
            return None, (
                f"flashinfer {parts['version']}: JIT build failed ({jit_error}); the "
                f"prebuilt module failed too: {type(exc2).__name__}: {exc2}"[:400]
            )
        nvcc_note = parts["prebuilt"].with_name(parts["prebuilt"].name + ".nvcc.txt")
        built_by = nvcc_note.read_text().strip() if nvcc_note.is_file() else "nvcc"
        how = (
            f"its JIT build failed here ({jit_error}); its norm module prebuilt for sm_90a "
            f"from its kernel source by {built_by} ({parts['prebuilt'].name}), loaded as its "
            f"AOT module"
        )
    version = getattr(flashinfer, "__version__", parts["version"])
    return fused_add_rmsnorm, (
        f"flashinfer {version} ({parts['tree'].name} unpacked into {site}; {how})"
    )


if __name__ == "__main__":
    _, line = load()
    print(line)
