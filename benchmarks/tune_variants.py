"""Kernel-variant sweep on the GPU: which memory-system hints, rows per
program and programmatic dependent launch (PDL) help the capture kernel.

The production kernel (kernels/add_rmsnorm_capture.py) is fixed; this script
carries an experimental copy whose knobs are constexprs, so one run compares

* loads with ``evict_first`` vs the default policy,
* stores with the default policy vs ``.cs`` (streaming),
* 1, 2 or 4 rows per program,
* in-place vs out-of-place outputs (Liger-Kernel writes out of place),
* PDL: the kernel waits (``gdc_wait``) only before reading the previous
  kernel's output and lets the next launch start at once
  (``gdc_launch_dependents``); launched with ``launch_pdl=True``.

Each cell: CUDA-graph replay of 3 launches per step (the K = 3 captured layers),
input sets rotated past L2, median us per step and % of an in-run copy
roofline. H = 7168 bf16. Results are recorded in benchmarks/NOTES.md.
"""

import argparse

import torch
import triton
import triton.language as tl

from eagle_capture.bench import measure_copy_roofline, time_graph_replay

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - Triton without PDL intrinsics
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def variant_kernel(h_ptr, r_ptr, w_ptr, n_ptr, ro_ptr, aux_ptr, num_tokens, hidden_size, eps,
                   stride_aux, slot_off,
                   NORM: tl.constexpr, STORE_RES: tl.constexpr, CAPTURE: tl.constexpr,
                   BLOCK_H: tl.constexpr, ROWS: tl.constexpr, EVICT: tl.constexpr,
                   STORE_MOD: tl.constexpr, PDL: tl.constexpr, AUX_MOD: tl.constexpr = ""):
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if NORM:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    for i in tl.static_range(ROWS):
        row = tl.program_id(0).to(tl.int64) * ROWS + i
        if row < num_tokens:
            h = tl.load(h_ptr + row * hidden_size + cols, mask=mask, other=0.0,
                        eviction_policy=EVICT)
            r = tl.load(r_ptr + row * hidden_size + cols, mask=mask, other=0.0,
                        eviction_policy=EVICT)
            s = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
            if CAPTURE:
                tl.store(aux_ptr + row * stride_aux + slot_off + cols, s, mask=mask,
                         cache_modifier=AUX_MOD)
            if STORE_RES:
                tl.store(ro_ptr + row * hidden_size + cols, s, mask=mask,
                         cache_modifier=STORE_MOD)
            if NORM:
                x = s.to(tl.float32)
                rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
                tl.store(n_ptr + row * hidden_size + cols, (x * rstd * w.to(tl.float32)).to(h.dtype),
                         mask=mask, cache_modifier=STORE_MOD)


# name: (kind, BLOCK_H, num_warps, rows, evict, store modifier, out of place, pdl[, aux store
# modifier])
VARIANTS = {
    "c base": ("c", 2048, 4, 1, "evict_first", "", False, False),
    "c noevict": ("c", 2048, 4, 1, "", "", False, False),
    "c st.cs": ("c", 2048, 4, 1, "evict_first", ".cs", False, False),
    "c rows2": ("c", 2048, 4, 2, "evict_first", "", False, False),
    "c rows4": ("c", 2048, 4, 4, "", "", False, False),
    "c b4096w8": ("c", 4096, 8, 1, "", "", False, False),
    "c pdl": ("c", 2048, 4, 1, "evict_first", "", False, True),
    "d base": ("d", 8192, 16, 1, "evict_first", "", False, False),
    "d noevict": ("d", 8192, 16, 1, "", "", False, False),
    "d oop": ("d", 8192, 16, 1, "evict_first", "", True, False),
    "d oop noev": ("d", 8192, 16, 1, "", "", True, False),
    "d st.cs": ("d", 8192, 16, 1, "evict_first", ".cs", False, False),
    "d rows2": ("d", 8192, 16, 2, "evict_first", "", False, False),
    "d w8": ("d", 8192, 8, 1, "", "", False, False),
    "d pdl": ("d", 8192, 16, 1, "evict_first", "", False, True),
    "e base": ("e", 8192, 16, 1, "evict_first", "", False, False),
    "e noevict": ("e", 8192, 16, 1, "", "", False, False),
    "e st.cs": ("e", 8192, 16, 1, "evict_first", ".cs", False, False),
    "e pdl": ("e", 8192, 16, 1, "evict_first", "", False, True),
    # Second round (after evict_first was dropped and PDL adopted): .cs on the
    # capture store only -- the draft model reads it after the last layer.
    "c ship": ("c", 2048, 4, 1, "", "", False, True),
    "c ship aux.cs": ("c", 2048, 4, 1, "", "", False, True, ".cs"),
    "d ship": ("d", 8192, 16, 1, "", "", False, True),
    "e ship": ("e", 8192, 16, 1, "", "", False, True),
    "e ship aux.cs": ("e", 8192, 16, 1, "", "", False, True, ".cs"),
}
BYTES_PER_ROW = {"c": 3, "d": 4, "e": 5}  # x H x 2 bytes


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden-size", type=int, default=7168)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096, 16384])
    p.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    args = p.parse_args()
    H, K = args.hidden_size, 3
    roof = measure_copy_roofline(torch.device("cuda"))["gbps"]
    names = [n for n in VARIANTS if not args.only or n in args.only]
    if gdc_wait is None:
        names = [n for n in names if not VARIANTS[n][7]]
    print(f"copy roofline {roof:.0f} GB/s; us per step of {K} launches (% of roofline)")
    print(f"{'T':>6} " + " ".join(n.rjust(15) for n in names), flush=True)
    for T in args.tokens:
        # At least one set per launch of a step, so no launch reads what the one
        # before it just wrote (L2), and ~400 MB in all.
        sets = max(K, min(20, (400 << 20) // (T * H * 2 * 4)))
        data = [[torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
                for _ in range(sets)]
        w = torch.rand(H, device="cuda", dtype=torch.bfloat16)
        aux = torch.empty(T, K, H, device="cuda", dtype=torch.bfloat16)
        cells = []
        for name in names:
            kind, blk, nw, rows, evict, smod, oop, pdl, *aux_mod = VARIANTS[name]
            norm = kind != "c"
            grid = (triton.cdiv(T, rows), triton.cdiv(H, blk))

            def step(i, norm=norm, kind=kind, blk=blk, nw=nw, rows=rows, evict=evict,
                     smod=smod, oop=oop, pdl=pdl, grid=grid, aux_mod=(aux_mod or [""])[0]):
                for slot in range(K):
                    h, r, n2, r2 = data[(i + slot) % len(data)]
                    variant_kernel[grid](
                        h, r, w, n2 if oop else h, r2 if oop else r, aux, T, H, 1e-6,
                        aux.stride(0), slot * H, NORM=norm, STORE_RES=norm, CAPTURE=kind != "d",
                        BLOCK_H=blk, ROWS=rows, EVICT=evict, STORE_MOD=smod, PDL=pdl, AUX_MOD=aux_mod or smod,
                        num_warps=nw, **({"launch_pdl": True} if pdl else {}))
            try:
                us = time_graph_replay([lambda i=i: step(i) for i in range(len(data))], 6, 30)
                nbytes = K * BYTES_PER_ROW[kind] * T * H * 2
                cells.append(f"{us:8.2f} ({100 * nbytes / us / 1e3 / roof:3.0f}%)")
            except Exception as exc:  # a variant this Triton cannot build: say so, go on
                cells.append(f"err {type(exc).__name__}"[:15])
        print(f"{T:>6} " + " ".join(c.rjust(15) for c in cells), flush=True)
        del data, aux
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
