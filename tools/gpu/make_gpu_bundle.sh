#!/usr/bin/env bash
# Build .gpu_bundle/: what tools/gpu/gpu_sglang_real.sh needs on a GPU machine with
# no network (python3 3.12, torch 2.11 + Triton 3.6, nvcc 13, ninja) to run
# SGLang 0.5.23's REAL DeepseekV2 model code with FlashInfer's real norm kernels.
#
#   bash tools/gpu/make_gpu_bundle.sh          # idempotent; prints the bundle's size
#
# Contents (about 35 MiB; every archive is xz-compressed):
#   sglang-0.5.23.tar.xz        SGLang 0.5.23's Python tree, copied from the CPU
#                               overlay .cache/sglang/0.5.23 (tools/sglang_real_env.sh;
#                               pip offers 0.5.23 only as a cp311 wheel): without
#                               sglang/multimodal_gen, sglang/test and the cp311 Rust
#                               extensions (*.so), which the model code does not import
#   transformers-5.19.0.tar.xz  the transformers SGLang 0.5.23 pins (same overlay)
#   flashinfer-0.7.2-norm.tar.xz  flashinfer-python 0.7.2 (SGLang 0.5.23's pin), trimmed:
#                               every .py file (so `import flashinfer` and SGLang's
#                               module-level `from flashinfer... import` work) and, of
#                               the 330 MiB of kernel sources, only what the JIT build of
#                               its CUDA norm module (csrc/norm.cu +
#                               flashinfer_norm_binding.cu) includes: data/include,
#                               the csrc headers, the vendored CCCL 3.6 headers; the
#                               CUTLASS / spdlog include folders are left empty (the norm
#                               sources include neither)
#   wheels/*.whl                cp312 manylinux / pure wheels of SGLang's import-graph
#                               dependencies the GPU image lacks (pydantic, orjson,
#                               msgspec, pyzmq, pybase64, fastapi, ...), FlashInfer's
#                               apache-tvm-ffi, and pinned huggingface_hub / tokenizers /
#                               typing_extensions inside transformers 5.19's ranges
#   prebuilt/flashinfer-0.7.2-norm-sm90a.so  FlashInfer's own JIT build of that norm
#                               module for sm_90a, made here (when nvcc and a Python with
#                               torch exist): gpu_sglang_real.sh falls back to it when the
#                               JIT build on the GPU machine fails
#   MANIFEST.txt                versions, sizes, sha256
#
# FLASHINFER_ONLY=1: only what benchmarks/flashinfer_norm.py needs to run FlashInfer's norm
# beside ours (the trimmed flashinfer tree, the apache-tvm-ffi wheel, the prebuilt module;
# about 4 MiB): no SGLang, transformers or SGLang's dependencies, so no CPU overlay first.
#
# Downloads are cached under .cache/gpu_bundle_dl/ (git-ignored). The bundle folder
# is git-ignored through .git/info/exclude (this script adds the line).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)

BUNDLE=.gpu_bundle
DL=.cache/gpu_bundle_dl
SGLANG_VER=0.5.23
TF_VER=5.19.0
FI_VER=0.7.2
OVERLAY=.cache/sglang/$SGLANG_VER
PY=${PY:-python3}

# cp312 wheels (versions: the ones the CPU harness runs SGLang 0.5.23 with, in .venv).
WHEELS=(
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0
    orjson==3.13.0 msgspec==0.23.0 pybase64==1.5.1 pyzmq==27.3.0
    partial-json-parser==0.2.1.1.post7 fastapi==0.165.0 starlette==1.10.0
    uvicorn==0.54.0 python-multipart==0.0.34 openai==2.8.0 distro==1.9.0 jiter==0.19.0
    sniffio==1.3.1 dill==0.4.1 opentelemetry-api==1.45.2
    huggingface-hub==1.33.0 tokenizers==0.23.2
    apache-tvm-ffi==0.1.11
)

FLASHINFER_ONLY=${FLASHINFER_ONLY:-0}
if [ "$FLASHINFER_ONLY" = 1 ]; then WHEELS=(apache-tvm-ffi==0.1.11); fi

say() { echo "make_gpu_bundle: $*" >&2; }

# A worktree's .git is a file: ask git where the exclude file is.
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.gpu_bundle/' "$EXCLUDE" 2>/dev/null || echo '/.gpu_bundle/' >> "$EXCLUDE"

if [ "$FLASHINFER_ONLY" != 1 ] && [ ! -f "$OVERLAY/.ok" ]; then
    say "building the CPU overlay $OVERLAY first"
    bash tools/sglang_real_env.sh "$SGLANG_VER" >/dev/null
fi
for d in sglang "sglang-$SGLANG_VER.dist-info" transformers "transformers-$TF_VER.dist-info"; do
    [ "$FLASHINFER_ONLY" = 1 ] || [ -e "$OVERLAY/$d" ] || { say "missing $OVERLAY/$d"; exit 1; }
done

rm -rf "$BUNDLE.tmp"
mkdir -p "$BUNDLE.tmp/wheels" "$DL/wheels"

# ------------------------------------------------------------------ wheels
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done
for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}; ver=${spec##*==}
    norm=$(echo "$name" | tr '-' '_')
    found=$(ls "$DL/wheels" 2>/dev/null | grep -i "^${norm}-${ver}-" | head -1 || true)
    if [ -z "$found" ]; then
        say "downloading $spec"
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${PLATFORMS[@]}" -d "$DL/wheels" "$spec" >&2
        found=$(ls "$DL/wheels" | grep -i "^${norm}-${ver}-" | head -1)
    fi
    cp "$DL/wheels/$found" "$BUNDLE.tmp/wheels/"
done

# ---------------------------------------------------------------- archives
# Made once into $DL/built (FORCE=1 remakes them), then copied into the bundle.
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
BUILT=$DL/built
mkdir -p "$BUILT"
[ "${FORCE:-0}" = 1 ] && rm -f "$BUILT"/*.tar.xz

copy_dist_info() {  # copy_dist_info FROM TO: the metadata importlib.metadata reads
    mkdir -p "$2"
    for f in METADATA WHEEL top_level.txt entry_points.txt INSTALLER; do
        if [ -f "$1/$f" ]; then cp "$1/$f" "$2/"; fi
    done
}

make_sglang() {
    say "sglang $SGLANG_VER tree (trimmed) -> sglang-$SGLANG_VER.tar.xz"
    mkdir -p "$stage/sgl"
    tar -C "$OVERLAY" -cf - --exclude=__pycache__ --exclude='sglang/multimodal_gen' \
        --exclude='sglang/test' --exclude='*.so' sglang | tar -C "$stage/sgl" -xf -
    copy_dist_info "$OVERLAY/sglang-$SGLANG_VER.dist-info" "$stage/sgl/sglang-$SGLANG_VER.dist-info"
    tar -C "$stage/sgl" -cf - . | xz -T0 -6 > "$BUILT/sglang-$SGLANG_VER.tar.xz.part"
    mv "$BUILT/sglang-$SGLANG_VER.tar.xz.part" "$BUILT/sglang-$SGLANG_VER.tar.xz"
}

make_transformers() {
    say "transformers $TF_VER -> transformers-$TF_VER.tar.xz"
    mkdir -p "$stage/tf"
    tar -C "$OVERLAY" -cf - --exclude=__pycache__ transformers | tar -C "$stage/tf" -xf -
    copy_dist_info "$OVERLAY/transformers-$TF_VER.dist-info" "$stage/tf/transformers-$TF_VER.dist-info"
    tar -C "$stage/tf" -cf - . | xz -T0 -6 > "$BUILT/transformers-$TF_VER.tar.xz.part"
    mv "$BUILT/transformers-$TF_VER.tar.xz.part" "$BUILT/transformers-$TF_VER.tar.xz"
}

make_flashinfer() {
    local whl=flashinfer_python-$FI_VER-py3-none-any.whl
    if [ ! -f "$DL/$whl" ]; then
        say "downloading flashinfer-python==$FI_VER (65 MB, trimmed below)"
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${PLATFORMS[@]}" -d "$DL" "flashinfer-python==$FI_VER" >&2
    fi
    say "flashinfer $FI_VER trimmed to its norm module -> flashinfer-$FI_VER-norm.tar.xz"
    mkdir -p "$stage/fi_whl" "$stage/fi"
    "$PY" -m zipfile -e "$ROOT/$DL/$whl" "$stage/fi_whl"
"$PY" - "$stage/fi_whl" "$stage/fi" <<'EOF'
import os, re, shutil, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
pkg = src / "flashinfer"
data = pkg / "data"
kept = 0
def keep(p: Path):
    global kept
    out = dst / p.relative_to(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(p, out)
    kept += p.stat().st_size
# 1. The Python package: every .py file, and small non-source files outside data/
#    (json tables, typed markers); kernel sources (.cu/.cuh/.h/.jinja) outside data/
#    belong to other JIT modules.
for p in pkg.rglob("*"):
    if not p.is_file() or "__pycache__" in p.parts:
        continue
    if data in p.parents:
        continue
    if p.suffix == ".py" or (p.suffix not in (".cu", ".cuh", ".h", ".hpp", ".cpp", ".jinja")
                             and p.stat().st_size < 1 << 20):
        keep(p)
# 2. The norm module's JIT sources (flashinfer/jit/norm.py) and the headers they reach.
for name in ("norm.cu", "flashinfer_norm_binding.cu"):
    keep(data / "csrc" / name)
for p in (data / "csrc").iterdir():            # top-level csrc headers (tvm_ffi_utils.h, ...)
    if p.is_file() and p.suffix in (".h", ".cuh", ".hpp"):
        keep(p)
for tree in ("include", "cccl/cub/cub", "cccl/libcudacxx/include", "cccl/thrust/thrust"):
    for p in (data / tree).rglob("*"):
        if p.is_file():
            keep(p)
# The include folders flashinfer/jit/cpp_ext.py names on every nvcc line: empty.
for empty in ("cutlass/include", "cutlass/tools/util/include", "spdlog/include"):
    (dst / "flashinfer" / "data" / empty).mkdir(parents=True, exist_ok=True)
# 3. Check: every #include "..." of the norm sources resolves inside what was kept.
inc = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
d = dst / "flashinfer" / "data"
roots = [d / "cccl/cub", d / "cccl/libcudacxx/include", d / "cccl/thrust", d / "include", d / "csrc"]
full = [data / "cccl/cub", data / "cccl/libcudacxx/include", data / "cccl/thrust", data / "include",
        data / "csrc", data / "cutlass/include", data / "cutlass/tools/util/include",
        data / "spdlog/include"]
seen, stack, missing = set(), [d / "csrc/norm.cu", d / "csrc/flashinfer_norm_binding.cu"], set()
while stack:
    f = stack.pop()
    if f in seen:
        continue
    seen.add(f)
    for kind, name in inc.findall(f.read_text(errors="ignore")):
        for c in ([f.parent] if kind == '"' else []) + roots:
            if (c / name).is_file():
                stack.append((c / name).resolve())
                break
        else:
            # Not in the trimmed tree: fine only if the full wheel does not have it either
            # (then it is a CUDA toolkit / system header).
            if any((c / name).is_file() for c in full):
                missing.add(name)
if missing:
    sys.exit(f"trimmed flashinfer misses headers the norm sources include: {sorted(missing)}")
for f in ("METADATA", "WHEEL", "top_level.txt", "entry_points.txt"):
    p = next(src.glob("flashinfer_python-*.dist-info")) / f
    if p.exists():
        keep(p)
print(f"flashinfer trimmed: {kept / 2**20:.1f} MiB uncompressed, the norm sources reach "
      f"{len(seen)} headers, all kept", file=sys.stderr)
EOF
    tar -C "$stage/fi" -cf - . | xz -T0 -6 > "$BUILT/flashinfer-$FI_VER-norm.tar.xz.part"
    mv "$BUILT/flashinfer-$FI_VER-norm.tar.xz.part" "$BUILT/flashinfer-$FI_VER-norm.tar.xz"
}

[ -f "$BUILT/flashinfer-$FI_VER-norm.tar.xz" ] || make_flashinfer
cp "$BUILT/flashinfer-$FI_VER-norm.tar.xz" "$BUNDLE.tmp/"
if [ "$FLASHINFER_ONLY" != 1 ]; then
    [ -f "$BUILT/sglang-$SGLANG_VER.tar.xz" ] || make_sglang
    [ -f "$BUILT/transformers-$TF_VER.tar.xz" ] || make_transformers
    cp "$BUILT/sglang-$SGLANG_VER.tar.xz" "$BUILT/transformers-$TF_VER.tar.xz" "$BUNDLE.tmp/"
fi

# ------------------------------------------------- prebuilt norm module (optional)
# A fallback for gpu_sglang_real.sh when FlashInfer's JIT build fails on the GPU
# machine: the same JIT build (FlashInfer's own gen_norm_module().build(), sm_90a,
# the trimmed sources above) done here, where a CUDA 13 nvcc and a Python with torch
# exist (PY_BUILD, default .venv/bin/python; tvm-ffi for that Python is fetched into
# $DL; cuBLAS headers, which a partial toolkit lacks, from its nvidia-cublas package,
# e.g. PY_BUILD=<a venv with the PyPI torch>). Skipped when either is missing, or
# with PREBUILT=0; a failed prebuild only leaves the fallback out.
PY_BUILD=${PY_BUILD:-.venv/bin/python}
if [ "${PREBUILT:-1}" = 1 ] && command -v nvcc >/dev/null && [ -x "$PY_BUILD" ] \
        && "$PY_BUILD" -c 'import torch' 2>/dev/null; then
    PRE="$BUILT/flashinfer-$FI_VER-norm-sm90a.so"
    if [ ! -f "$PRE" ]; then
        say "prebuilding FlashInfer's norm module for sm_90a with $(nvcc --version | tail -1)"
        pb="$stage/prebuild"
        mkdir -p "$pb/site" "$pb/cudalink" "$DL/build_wheels"
        pyver=$("$PY_BUILD" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        if ! ls "$DL/build_wheels" | grep -q "^apache_tvm_ffi-0.1.11-cp${pyver/./}"; then
            "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
                --implementation cp "${PLATFORMS[@]}" -d "$DL/build_wheels" apache-tvm-ffi==0.1.11 >&2
        fi
        "$PY_BUILD" -m pip install -q --no-index --no-deps --target "$pb/site" \
            "$DL"/build_wheels/apache_tvm_ffi-0.1.11-cp"${pyver/./}"*.whl >&2
        xz -dc "$BUILT/flashinfer-$FI_VER-norm.tar.xz" | tar -C "$pb/site" -xf -
        top=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
        cuda_home=$(readlink -f "$top")
        extra_cuda=""
        if [ ! -f "$cuda_home/include/cublasLt.h" ]; then
            inc=$("$PY_BUILD" -c 'import glob, os, nvidia
print(next((os.path.dirname(h) for p in nvidia.__path__
            for h in glob.glob(os.path.join(p, "*", "include", "cublasLt.h"))), ""))' 2>/dev/null || true)
            [ -n "$inc" ] && extra_cuda="-isystem $inc"
        fi
        extra_ld=""
        if [ ! -e "$cuda_home/lib64/stubs/libcuda.so" ] && [ ! -e "$cuda_home/lib64/libcuda.so" ]; then
            # Link-time only: the module uses no driver symbol (the linker drops it).
            echo "" | cc -shared -x c - -o "$pb/cudalink/libcuda.so" -Wl,-soname,libcuda.so.1
            extra_ld="-L$pb/cudalink"
        fi
        if PYTHONPATH="$pb/site" CUDA_HOME="$cuda_home" FLASHINFER_CUDA_ARCH_LIST=9.0a \
                FLASHINFER_USE_CUDA_NORM=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 \
                FLASHINFER_WORKSPACE_BASE="$pb/ws" FLASHINFER_EXTRA_CUDAFLAGS="$extra_cuda" \
                FLASHINFER_EXTRA_LDFLAGS="$extra_ld" "$PY_BUILD" -c '
import shutil, sys, time
t = time.time()
from flashinfer.jit.norm import gen_norm_module
spec = gen_norm_module()
spec.build(verbose=False)
shutil.copy(spec.get_library_path(), sys.argv[1])
print(f"built in {time.time() - t:.0f} s", file=sys.stderr)
' "$PRE.part" >&2; then
            mv "$PRE.part" "$PRE"
            nvcc --version | tail -1 > "$PRE.nvcc"
        else
            say "prebuild failed: the bundle goes without a prebuilt norm module"
        fi
    fi
    if [ -f "$PRE" ]; then
        mkdir -p "$BUNDLE.tmp/prebuilt"
        cp "$PRE" "$BUNDLE.tmp/prebuilt/"
        cp "$PRE.nvcc" "$BUNDLE.tmp/prebuilt/$(basename "$PRE").nvcc.txt" 2>/dev/null || true
    fi
else
    say "no nvcc or no torch for $PY_BUILD here: no prebuilt norm module (the GPU JIT-builds it)"
fi

# --------------------------------------------------------------- manifest
{
    echo "# .gpu_bundle for $([ "$FLASHINFER_ONLY" = 1 ] && echo "benchmarks/flashinfer_norm.py" \
        || echo "tools/gpu/gpu_sglang_real.sh") (built $(date -u +%Y-%m-%dT%H:%MZ))"
    if [ "$FLASHINFER_ONLY" = 1 ]; then
        echo "flashinfer-python $FI_VER (norm only) and apache-tvm-ffi: FLASHINFER_ONLY=1, no SGLang"
    else
        echo "sglang $SGLANG_VER (trimmed tree), transformers $TF_VER, flashinfer-python $FI_VER (norm only)"
    fi
    (cd "$BUNDLE.tmp" && find . -type f ! -name MANIFEST.txt | sort | while read -r f; do
        printf '%10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -c1-16)" "${f#./}"
    done)
} > "$BUNDLE.tmp/MANIFEST.txt"

rm -rf "$BUNDLE"
mv "$BUNDLE.tmp" "$BUNDLE"
say "done: $(du -sh "$BUNDLE" | cut -f1) in $BUNDLE"
du -sh "$BUNDLE"
