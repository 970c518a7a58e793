#!/usr/bin/env bash
# One device-tool call: SGLang 0.5.23's REAL model code on the GPU (DeepseekV2 by
# default; --family llama | qwen3_moe | ... another family's, gpu_scenarios.py)
# with the fused EAGLE-3 capture, FlashInfer's real fused_add_rmsnorm as SGLang's
# own norm kernel (tests/sglang_real/gpu_scenarios.py). Needs .gpu_bundle/ (built
# here by tools/gpu/make_gpu_bundle.sh, carried to the GPU machine).
#
#   bash tools/gpu/gpu_sglang_real.sh [gpu_scenarios.py arguments]
#
# Writes $OUT/gpu_sglang_real.json and $OUT/gpu_sglang_real.log (OUT defaults to
# benchmarks/out). Exit status: 0 every check passed; 1 a check failed; 2 the
# bundle could not be installed; 3 set-up failed (imports / model build) -- then
# the run is repeated once with SGLANG_IS_FLASHINFER_AVAILABLE=false (SGLang's
# module-level FlashInfer imports off; the norms still go to FlashInfer) and its
# status is returned, its files suffixed _fi_off.
#
# GPU_SCENARIOS=0 skips the scenarios; BENCH_HIDDEN="H ..." then runs
# benchmarks/capture_latency.py at each hidden size in the same environment (paths
# BENCH_PATHS, default bdfijk, at BENCH_TOKENS), FlashInfer's norm among its peers.
#
# Environment: PY (default python3), SITE (default /tmp/site: the wheels, the
# transformers tree and the trimmed FlashInfer), EC_SGLANG_DIR (default /tmp/sgl: the
# SGLang tree), RUN_TIMEOUT_S (default 330, per python run),
# JIT_TIMEOUT_S (default 200), NORM_IMPL (flashinfer, or torch to skip FlashInfer).
set -uo pipefail
cd "$(dirname "$0")/../.."

PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
SGL=${EC_SGLANG_DIR:-/tmp/sgl}
OUT=${OUT:-benchmarks/out}
B=.gpu_bundle
T0=$SECONDS
say() { echo "gpu_sglang_real: [$((SECONDS - T0)) s] $*"; }

[ -d "$B/wheels" ] || { say "no $B/wheels: run tools/gpu/make_gpu_bundle.sh and carry $B"; exit 2; }
mkdir -p "$OUT" "$SITE" "$SGL"

say "installing $(ls "$B"/wheels/*.whl | wc -l) wheels into $SITE"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$B"/wheels/*.whl || { say "pip install failed"; exit 2; }

untar() {  # untar ARCHIVE DIR (tar -J, else Python's tarfile)
    tar -xJf "$1" -C "$2" 2>/dev/null || "$PY" - "$1" "$2" <<'EOF' || { say "cannot unpack $1"; exit 2; }
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    t.extractall(sys.argv[2], filter="data")
EOF
}
rm -rf "$SGL/sglang" "$SITE/transformers" "$SITE/flashinfer"
untar "$B/sglang-0.5.23.tar.xz" "$SGL"
untar "$B/transformers-5.19.0.tar.xz" "$SITE"
untar "$B/flashinfer-0.7.2-norm.tar.xz" "$SITE"

# eagle_capture's entry point (group sglang.srt.plugins, as setup.py declares it),
# found by SGLang's load_plugins(); the code itself comes from the tree (PYTHONPATH).
DI="$SITE/eagle_capture-0.1.0.dist-info"
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: eagle-capture\nVersion: 0.1.0\n' > "$DI/METADATA"
printf '[sglang.srt.plugins]\neagle_capture = eagle_capture.integrations.sglang.plugin:register\n' \
    > "$DI/entry_points.txt"

export PYTHONPATH="$SGL:$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# FlashInfer: its CUDA JIT norm module (the CuTe-DSL norms need nvidia-cutlass-dsl),
# built for this GPU only, into a fresh cache; tvm-ffi: no JIT of its optional torch addon.
export FLASHINFER_USE_CUDA_NORM=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fiws}
if [ -z "${FLASHINFER_CUDA_ARCH_LIST:-}" ]; then
    cap=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || true)
    case "$cap" in 9.0) export FLASHINFER_CUDA_ARCH_LIST=9.0a ;; ?*) export FLASHINFER_CUDA_ARCH_LIST=$cap ;; esac
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
    # FlashInfer takes dirname(dirname(which nvcc)), wrong for a wrapper script such as
    # /usr/local/bin/nvcc; nvcc itself knows its toolkit (TOP=<toolkit>/bin/..).
    top=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
    if [ -n "$top" ] && [ -d "$top/include" ]; then CUDA_HOME=$(readlink -f "$top"); export CUDA_HOME; fi
fi
# The norm module's nvcc line names $CUDA_HOME/include (cublasLt.h is reached through
# flashinfer/trtllm/common/cudaUtils.h) and links -lcudart -lcuda from
# $CUDA_HOME/lib64[/stubs]; a toolkit without cuBLAS headers or the libcuda stub gets
# them from torch's nvidia-cublas package and the driver's libcuda.so.1.
if [ -n "${CUDA_HOME:-}" ] && [ ! -f "$CUDA_HOME/include/cublasLt.h" ]; then
    inc=$("$PY" -c 'import glob, os, nvidia
print(next((os.path.dirname(h) for p in nvidia.__path__
            for h in glob.glob(os.path.join(p, "*", "include", "cublasLt.h"))), ""))' 2>/dev/null || true)
    if [ -n "$inc" ]; then
        export FLASHINFER_EXTRA_CUDAFLAGS="${FLASHINFER_EXTRA_CUDAFLAGS:+$FLASHINFER_EXTRA_CUDAFLAGS }-isystem $inc"
        say "no cublasLt.h in $CUDA_HOME/include: nvcc also searches $inc"
    fi
fi
if [ -n "${CUDA_HOME:-}" ] && [ ! -e "$CUDA_HOME/lib64/stubs/libcuda.so" ] && [ ! -e "$CUDA_HOME/lib64/libcuda.so" ]; then
    lib=$( (ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? /{print $NF}';
            ls /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null) | head -1)
    if [ -n "$lib" ]; then
        mkdir -p /tmp/ec_cudalink && ln -sf "$lib" /tmp/ec_cudalink/libcuda.so
        export FLASHINFER_EXTRA_LDFLAGS="${FLASHINFER_EXTRA_LDFLAGS:+$FLASHINFER_EXTRA_LDFLAGS }-L/tmp/ec_cudalink"
        say "no libcuda stub in $CUDA_HOME/lib64: linking against $lib"
    fi
fi
say "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo missing); CUDA_HOME=${CUDA_HOME:-?}; arch ${FLASHINFER_CUDA_ARCH_LIST:-?}; ninja $(ninja --version 2>/dev/null || echo missing); MAX_JOBS=$MAX_JOBS"

# FlashInfer's JIT build of its CUDA norm module, alone (its time and errors apart
# from the scenarios'); cached under $FLASHINFER_WORKSPACE_BASE for the run below.
# If it fails, the bundle's prebuilt sm_90a module (made by make_gpu_bundle.sh with
# the same sources) is installed as FlashInfer's AOT module, else the scenarios run
# with a torch stand-in for FlashInfer (--norm-impl torch); either way the run ends
# with a non-zero status.
NORM_IMPL=${NORM_IMPL:-flashinfer}
JIT_FAILED=0
if [ "$NORM_IMPL" = flashinfer ]; then
    say "FlashInfer JIT build of its norm module (csrc/norm.cu + flashinfer_norm_binding.cu)"
    timeout "${JIT_TIMEOUT_S:-200}" "$PY" - <<'PYEOF' 2>&1 | tee "$OUT/flashinfer_jit.log"
import time
t = time.time()
from flashinfer.jit.norm import gen_norm_module
spec = gen_norm_module()
spec.build(verbose=False)
print(f"gpu_sglang_real: FlashInfer norm module built in {time.time() - t:.1f} s: "
      f"{spec.get_library_path()}", flush=True)
PYEOF
    jit_rc=${PIPESTATUS[0]}
    if [ "$jit_rc" != 0 ]; then
        JIT_FAILED=1
        PRE=$B/prebuilt/flashinfer-0.7.2-norm-sm90a.so
        if [ -f "$PRE" ] && [ "${FLASHINFER_CUDA_ARCH_LIST:-}" = 9.0a ]; then
            say "FAIL: FlashInfer's JIT build failed (status $jit_rc, $OUT/flashinfer_jit.log): trying the bundle's prebuilt sm_90a norm module (FlashInfer loads data/aot/norm/norm.so as an AOT module)"
            mkdir -p "$SITE/flashinfer/data/aot/norm" && cp "$PRE" "$SITE/flashinfer/data/aot/norm/norm.so"
            if "$PY" -c 'import torch, flashinfer.norm as n
x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16); r = torch.randn_like(x)
n.fused_add_rmsnorm(x, r, torch.ones(256, device="cuda", dtype=torch.bfloat16)); torch.cuda.synchronize()
print("gpu_sglang_real: prebuilt norm module loads and runs")' 2>&1 | tee -a "$OUT/flashinfer_jit.log"
            then :; else NORM_IMPL=torch; fi   # pipefail: the python status counts
        else
            NORM_IMPL=torch
        fi
        if [ "$NORM_IMPL" = torch ]; then
            rm -rf "$SITE/flashinfer/data/aot"
            say "FAIL: no usable FlashInfer norm module: the scenarios run with --norm-impl torch (a torch stand-in for FlashInfer)"
        fi
    fi
fi

run() {  # run SUFFIX [args]: one gpu_scenarios.py run; returns its status
    local suffix=$1; shift
    say "gpu_scenarios.py $* (log $OUT/gpu_sglang_real$suffix.log)"
    local impl=()
    if [ "$NORM_IMPL" != flashinfer ]; then impl=(--norm-impl "$NORM_IMPL"); fi
    timeout "${RUN_TIMEOUT_S:-330}" "$PY" -m tests.sglang_real.gpu_scenarios \
        "${impl[@]}" --out "$OUT/gpu_sglang_real$suffix.json" "$@" 2>&1 \
        | tee "$OUT/gpu_sglang_real$suffix.log"
    return "${PIPESTATUS[0]}"
}

rc=0
if [ "${GPU_SCENARIOS:-1}" != 0 ]; then
    run "" "$@"
    rc=$?
    if [ "$rc" = 3 ] && [ -z "${SGLANG_IS_FLASHINFER_AVAILABLE:-}" ]; then
        say "set-up failed (status 3): again with SGLANG_IS_FLASHINFER_AVAILABLE=false"
        export SGLANG_IS_FLASHINFER_AVAILABLE=false
        run "_fi_off" "$@"
        rc=$?
    fi
fi

# BENCH_HIDDEN="2880 4096 ...": the capture benchmark at each hidden size, in this
# environment (FlashInfer's norm importable: paths j and k, SGLang's own kernel on CUDA).
for H in ${BENCH_HIDDEN:-}; do
    say "capture_latency.py --hidden-size $H (log $OUT/bench_H$H.log)"
    # shellcheck disable=SC2086 # BENCH_TOKENS is a list of T values
    timeout "${BENCH_TIMEOUT_S:-240}" "$PY" benchmarks/capture_latency.py --hidden-size "$H" \
        --paths "${BENCH_PATHS:-bdfijk}" --tokens ${BENCH_TOKENS:-1 16 64 256 1024 4096} \
        --no-plot --out "$OUT/bench" 2>&1 | tee "$OUT/bench_H$H.log"
    brc=${PIPESTATUS[0]}
    if [ "$brc" != 0 ]; then say "FAIL: the benchmark at H = $H: status $brc"; rc=1; fi
done
if [ "$JIT_FAILED" = 1 ]; then
    say "FAIL: FlashInfer's JIT build failed ($OUT/flashinfer_jit.log); SGLang's norm kernel was $([ "$NORM_IMPL" = torch ] && echo "a torch stand-in" || echo "the bundle's prebuilt FlashInfer module")"
    if [ "$rc" = 0 ]; then rc=1; fi
fi
case "$rc" in
    0) say "PASS: every check passed" ;;
    124) say "FAIL: timed out after ${RUN_TIMEOUT_S:-330} s" ;;
    *) say "FAIL: status $rc (see the FAILED lines above)" ;;
esac
exit "$rc"
