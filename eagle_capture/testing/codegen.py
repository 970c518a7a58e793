"""The kernels' Triton IR (TTIR), generated on a machine without a GPU, and the
check that their row offsets are 64-bit.

``rows * stride`` passes 2^31 for T = 100k, K = 3, H = 7168: an int32 product
would wrap into another request's rows. The kernels widen the row index to int64
before multiplying; on the GPU a large-T test runs the real thing, and this check
reads the generated code on any machine: no 32-bit multiply may take a stride,
the hidden size or the slab size as an operand, and each stride argument must be
widened to i64 somewhere.

TTIR is built by Triton's own front end for a Hopper target (no driver, no ptxas);
the interpreter must be off (its ``@jit`` functions cannot be compiled), so tests
run this module in a child process::

    python -m eagle_capture.testing.codegen      # JSON: {kernel variant: [problems]}
"""

import inspect
import json
import os
import re
import sys

# Arguments whose products with a row index (or each other) address memory.
WIDE_OPERANDS = re.compile(r"^%(stride_\w+|hidden_size|max_tokens|aux_slot_offset)(_\d+)?$")


def ttir(kernel, signature: dict, constexprs: dict) -> str:
    """The TTIR text of ``kernel`` (a ``triton.jit`` function) for ``signature``
    (argument -> Triton type string) and ``constexprs`` (name -> value)."""
    import triton._C.libtriton as libtriton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TTIR needs TRITON_INTERPRET unset (run this module in a child)")
    parameters = inspect.signature(kernel.fn).parameters
    params = list(parameters)
    # A constexpr left out takes its default, as at a launch (the cache-hint knobs).
    constexprs = {
        **{
            name: p.default
            for name, p in parameters.items()
            if "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty
        },
        **constexprs,
    }
    sig = {p: ("constexpr" if p in constexprs else signature[p]) for p in params}
    consts = {(params.index(name),): value for name, value in constexprs.items()}
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = libtriton.ir.context()
    libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(fn=kernel, signature=sig, constexprs=consts)
    make_ir = source.make_ir
    args = (options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    if "target" in inspect.signature(make_ir).parameters:  # Triton >= 3.5
        args = (target,) + args
    return str(make_ir(*args))


def narrow_offsets(text: str, stride_args) -> list[str]:
    """What in ``text`` (TTIR) computes an address offset in 32 bits: an i32 multiply
    of a stride / size argument, or a stride argument never widened to i64."""
    problems = []
    for line in text.splitlines():
        m = re.search(r"arith\.muli (%[\w.]+), (%[\w.]+) : i32\b", line)
        if m and any(WIDE_OPERANDS.match(op) for op in m.groups()):
            problems.append(f"32-bit multiply: {line.split(' loc(')[0].strip()}")
    for name in stride_args:
        if not re.search(rf"arith\.extsi %{name}\b[^:]*: i32 to i64", text):
            problems.append(f"{name} is never widened to i64")
    return problems


def _variants():
    from eagle_capture.kernels.add_rmsnorm_capture import add_rmsnorm_capture_kernel
    from eagle_capture.kernels.allreduce_add_rmsnorm_capture import (
        lamport_allreduce_add_rmsnorm_capture_kernel,
    )

    def types(kernel, special):
        out = {}
        for p in inspect.signature(kernel.fn).parameters:
            out[p] = special.get(p) or (
                "*bf16" if p.endswith("_ptr") else "fp32" if p == "eps" else "i32"
            )
        return out

    fused = types(add_rmsnorm_capture_kernel, {})
    for residual in (True, False):
        for norm in (True, False):
            consts = dict(
                HAS_RESIDUAL=residual,
                APPLY_NORM=norm,
                STORE_RESIDUAL=residual,
                CAPTURE=True,
                BLOCK_H=64,
                USE_PDL=False,
                NORM_FP32_SUM=False,
            )
            strides = ["stride_hidden", "stride_aux_row"]
            strides += ["stride_residual", "stride_residual_out"] if residual else []
            strides += ["stride_normed_out"] if norm else []
            yield (
                f"add_rmsnorm_capture residual={residual} norm={norm}",
                add_rmsnorm_capture_kernel,
                fused,
                consts,
                strides,
            )
    reduce = types(
        lamport_allreduce_add_rmsnorm_capture_kernel,
        {"ptr_table": "*i64", "state_ptr": "*i32", "timeout_ns": "i64"},
    )
    consts = dict(
        WORLD_SIZE=2,
        CAPTURE=True,
        NORM_FP32_SUM=False,
        USE_GLOBALTIMER=True,
        DEBUG_SPIN=0,
        BLOCK_H=64,
    )
    yield (
        "lamport_allreduce_add_rmsnorm_capture",
        lamport_allreduce_add_rmsnorm_capture_kernel,
        reduce,
        consts,
        [
            "stride_partial",
            "stride_residual",
            "stride_normed_out",
            "stride_residual_out",
            "stride_aux_row",
        ],
    )


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, root)
    report = {
        name: narrow_offsets(ttir(kernel, sig, consts), strides)
        for name, kernel, sig, consts, strides in _variants()
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
