"""Tuning sweeps of the production kernel (eagle_capture/kernels/add_rmsnorm_capture.py) on a GPU.

Every cell launches ``add_rmsnorm_capture_kernel`` itself -- the kernel the
ops launch, not a copy -- varied only through what it exposes: its constexpr
flags (which outputs a launch writes, NORM_FP32_SUM, USE_PDL), BLOCK_H, and
the launch's num_warps, grid and ``launch_pdl``. Two sweeps:

  --sweep launch     (default) launch parameters, one launch per step:
                     add+RMSNorm with and without the slot store (d, e), one
                     program per row, num_warps 4 - 32; the capture alone (c) in
                     column blocks of 1024 - 8192 elements x 2 - 16 warps.
                     What chose ``launch_config``.
  --sweep variants   named variants, 3 launches per step (the K = 3 captured
                     layers of a forward step): each kind at the shipped launch
                     configuration with PDL off and on, another block or warp
                     count, out-of-place outputs (Liger-Kernel's form).
  --sweep flashinfer the SGLang drop-in's in-slot call (l) against FlashInfer's
                     fused_add_rmsnorm alone (k, loaded by flashinfer_norm.py:
                     the installed package, else built from its kernel source),
                     3 launches per step: l as shipped, with each cache hint the
                     kernel exposes (AUX_CACHE / AUX_EVICT on the slot store,
                     RESIDUAL_EVICT on the residual load), PDL's trigger after
                     the stores, other warp counts; d for reference. Every cell
                     also as a multiple of k's time (table "x k").

Kinds (which outputs a launch writes; the letters of capture_latency.py):
  c  add_capture: h + r into the aux slot
  d  add+RMSNorm in place, no capture
  e  add+RMSNorm in place + the residual stored into the slot
  f  add+RMSNorm whose residual output is the slot (residual untouched)
  i  e, normalising the unrounded fp32 sum (NORM_FP32_SUM: the SGLang drop-in)
  l  f, normalising the unrounded fp32 sum (the SGLang drop-in's in-slot call)
  k  FlashInfer's fused_add_rmsnorm (not our kernel: the peer; flashinfer sweep)

Each cell: CUDA-graph replay, median GPU us per step over --replays replays,
each step on the next of N buffer sets (h, r, w, aux; outputs of out-of-place
variants) that total >= --rotate-l2 x L2, so no step reads what an earlier
one left in cache; and % of an in-run 2 GiB copy's bandwidth (read +
written). Before its first timing at each T, a variant's outputs are checked
against torch (the sums bit-exact, the norm to 1%); a variant whose outputs are
wrong gets a WRONG cell, one that cannot launch an "err" cell, and the reason
goes to stderr.

Not swept: knobs the kernel does not have. The fork of the kernel this script
replaces (tune_variants.py; benchmarks/NOTES.md, results/tune_variants_round*.txt)
also tried evict_first loads on h and r, .cs (streaming) stores on all outputs,
and 2 or 4 rows per program; a persistent grid (1 - 4 programs per SM walking the
rows, 1 - 3 pipeline stages), the slot stored after the normed output, a row in
two power-of-two pieces (H 5120 as 4096 + 1024) and TMA stores of the slot's and the
normed row were tried as kernel constexprs on 2026-12-07 (NOTES.md; the TMA patch is
in results/2026-12-07-h100-session6/). None was adopted. Sweeping
them again means adding them to the kernel as constexprs first (as AUX_CACHE,
AUX_EVICT, RESIDUAL_EVICT and PDL_TRIGGER_LATE were).

Without a GPU the script says so and exits 0; ``--list`` prints a sweep's
variants and their launch settings (no GPU needed). Results: benchmarks/NOTES.md.
"""

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from eagle_capture.kernels import (
    HAS_PDL,
    add_rmsnorm_capture_kernel,
    band_sms,
    kernel_arguments,
    launch_config,
)
from eagle_capture.testing.bench import (
    add_graph_timing_arguments,
    measure_copy_roofline,
    rotation_sets,
    time_graph_replay,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_TOKENS = [1, 8, 16, 64, 256, 1024, 4096, 16384]
EPS = 1e-6
SLOTS = 3  # K: slots of every aux buffer; a variants step launches once per slot
# Elements after each token's SLOTS * H in the aux storage: room for the "padded"
# layout's longer row (the draft's GEMM reads a row stride above 3H as its lda).
AUX_PAD = 64
# Where a launch's slot lies in the aux storage: "interleaved" is the buffer the engines'
# draft reads ([T, K, H], rows K * H apart); "slot-major" ([K, T, H], each slot's rows
# contiguous) and "padded" (rows K * H + AUX_PAD apart) are layouts to measure against it.
AUX_LAYOUTS = ("interleaved", "slot-major", "padded")
MAX_SETS = 4096  # rotated buffer sets at the most (each is one graph step)


@dataclass(frozen=True)
class Kind:
    """The kernel's output flags for one op (HAS_RESIDUAL is always set)."""

    what: str
    apply_norm: bool
    store_residual: bool
    capture: bool
    norm_fp32_sum: bool = False

    @property
    def rows_moved(self) -> int:
        """[T, H] tensors read or written per launch: h and r, then each output."""
        return 2 + self.apply_norm + self.store_residual + self.capture


KINDS = {
    "c": Kind("add_capture: h + r into the aux slot", False, False, True),
    "d": Kind("add+RMSNorm in place, no capture", True, True, False),
    "e": Kind("add+RMSNorm in place + residual into the slot", True, True, True),
    "f": Kind("add+RMSNorm, residual output is the slot", True, False, True),
    "i": Kind("e, norm of the fp32 sum (SGLang drop-in)", True, True, True, True),
    "l": Kind("f, norm of the fp32 sum (SGLang drop-in, in slot)", True, False, True, True),
}
# The peer, not our kernel: FlashInfer's in-place fused_add_rmsnorm (residual += h;
# h = norm(residual) * w, of the fp32 sum), launched by the flashinfer sweep alone.
PEER = "k"
PEER_KIND = Kind("FlashInfer's fused_add_rmsnorm (peer)", True, True, False, True)
_flashinfer = {}  # "fn", "line": flashinfer_norm.load()'s answer, once per process


def kind_of(v: "Variant") -> Kind:
    return PEER_KIND if v.kind == PEER else KINDS[v.kind]


def flashinfer_peer() -> tuple:
    """(FlashInfer's fused_add_rmsnorm or None, how it was loaded), once per process."""
    if not _flashinfer:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import flashinfer_norm

        _flashinfer["fn"], _flashinfer["line"] = flashinfer_norm.load()
    return _flashinfer["fn"], _flashinfer["line"]


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # a key of KINDS
    block_h: Optional[int] = None  # None: launch_config's
    num_warps: Optional[int] = None  # None: the op's (launch_config, one_wave_warps at T)
    pdl: bool = False  # USE_PDL, launched with launch_pdl=True
    out_of_place: bool = False  # normed and residual outputs to other tensors
    knobs: tuple = ()  # (constexpr, value) pairs: the kernel's cache hints
    aux_layout: str = "interleaved"  # one of AUX_LAYOUTS

    def launch_shape(self, hidden_size: int) -> tuple:
        """(BLOCK_H, num_warps, column blocks) at this hidden size."""
        norm = kind_of(self).apply_norm
        block_h, num_warps, _ = launch_config(hidden_size, norm)
        block_h, num_warps = self.block_h or block_h, self.num_warps or num_warps
        if norm and block_h < hidden_size:
            raise ValueError(
                f"{self.name}: the norm needs the whole row in one program "
                f"(BLOCK_H {block_h} < H = {hidden_size})"
            )
        return block_h, num_warps, triton.cdiv(hidden_size, block_h)


def launch_sweep(hidden_size: int) -> list:
    """The launch-parameter grid."""
    row = triton.next_power_of_2(hidden_size)
    variants = [Variant(f"{k} w{nw}", k, row, nw) for k in "de" for nw in (4, 8, 16, 32)]
    # Column blocks: at least 8 elements per thread, except the largest block.
    variants += [
        Variant(f"c b{blk} w{nw}", "c", blk, nw)
        for blk in (1024, 2048, 4096, 8192)
        for nw in (2, 4, 8, 16)
        if blk // (nw * 32) >= 8 or blk >= 8192
    ]
    return variants


def variants_sweep(hidden_size: int) -> list:
    """Named variants: the shipped configuration of each kind, PDL off and on,
    then other launch shapes and out-of-place outputs."""
    variants = [
        Variant(f"{k}{' pdl' if pdl else ''}", k, pdl=pdl) for k in KINDS for pdl in (False, True)
    ]
    return variants + [
        Variant("c b4096 w8", "c", 4096, 8),
        Variant("d w8", "d", num_warps=8),
        Variant("d oop", "d", out_of_place=True),
        Variant("e oop", "e", out_of_place=True),
    ]


def flashinfer_sweep(hidden_size: int) -> list:
    """The drop-in's in-slot call (l) as shipped and varied, against FlashInfer's norm."""
    warps = launch_config(hidden_size, True)[1]  # H-only (no bands): w/2 = half of it
    cs, ef = ("AUX_CACHE", ".cs"), ("AUX_EVICT", "evict_first")
    ref = ("RESIDUAL_EVICT", "evict_first")
    return [
        Variant("k flashinfer", PEER),
        Variant("d pdl", "d", pdl=True),
        Variant("l pdl", "l", pdl=True),
        # The warps launch_config gives H alone, without the one-wave bands of T
        Variant("l h-only", "l", num_warps=warps, pdl=True),
        Variant("l", "l"),
        Variant("l aux.cs", "l", pdl=True, knobs=(cs,)),
        Variant("l aux.ef", "l", pdl=True, knobs=(ef,)),
        Variant("l r.ef", "l", pdl=True, knobs=(ref,)),
        Variant("l r.ef aux.cs", "l", pdl=True, knobs=(ref, cs)),
        Variant("l late", "l", pdl=True, knobs=(("PDL_TRIGGER_LATE", True),)),
        Variant("l w/2", "l", num_warps=max(1, warps // 2), pdl=True),
        Variant("l w*2", "l", num_warps=min(32, warps * 2), pdl=True),
        Variant("l aux.el", "l", pdl=True, knobs=(("AUX_EVICT", "evict_last"),)),
        # The same bytes, the slot's rows laid out otherwise: is T = 16384's residue over
        # the peer the interleaved rows' DRAM placement, or the write to other rows at all?
        Variant("l slot-major", "l", pdl=True, aux_layout="slot-major"),
        Variant("l padded", "l", pdl=True, aux_layout="padded"),
        # The peer once more, last: its ratio to the first is the run's noise floor
        # (clock and thermal drift across the cell's variants included).
        Variant("k again", PEER),
    ]


SWEEPS = {
    "launch": (launch_sweep, 1),
    "variants": (variants_sweep, SLOTS),  # launches per step
    "flashinfer": (flashinfer_sweep, SLOTS),
}


# ----------------------------------------------------------------------------
# Buffers, launch, check
# ----------------------------------------------------------------------------


@dataclass
class BufferSet:
    """One step's inputs and outputs: h, r [T, H], w [H], the aux storage
    [T, SLOTS * H + AUX_PAD] (``slot_view`` lays a slot out in it);
    ``normed`` and ``res_out`` [T, H] for out-of-place variants (else None)."""

    h: torch.Tensor
    r: torch.Tensor
    w: torch.Tensor
    aux: torch.Tensor
    normed: Optional[torch.Tensor] = None
    res_out: Optional[torch.Tensor] = None

    def clone(self) -> "BufferSet":
        return BufferSet(
            *(
                t.clone() if t is not None else None
                for t in (self.h, self.r, self.w, self.aux, self.normed, self.res_out)
            )
        )


def make_set(num_tokens: int, hidden_size: int, dtype, device, out_of_place: bool) -> BufferSet:
    def rows():
        return torch.randn(num_tokens, hidden_size, device=device).to(dtype)

    return BufferSet(
        rows(),
        rows(),
        (1 + 0.1 * torch.randn(hidden_size, device=device)).to(dtype),
        torch.empty(num_tokens, SLOTS * hidden_size + AUX_PAD, device=device, dtype=dtype),
        rows() if out_of_place else None,
        rows() if out_of_place else None,
    )


def set_bytes(num_tokens: int, hidden_size: int, elem: int, out_of_place: bool) -> int:
    rows = num_tokens * hidden_size * (2 + SLOTS + 2 * out_of_place)
    return elem * (rows + num_tokens * AUX_PAD + hidden_size)


def slot_view(v: Variant, aux: torch.Tensor, hidden_size: int, slot: int) -> tuple:
    """(a [T, K, H] view of the aux storage, the slot's index in it) for slot ``slot``
    in ``v``'s layout. Every layout writes the same T * H elements."""
    T = aux.shape[0]
    dense = aux.view(-1)[: T * SLOTS * hidden_size]
    if v.aux_layout == "interleaved":
        return dense.view(T, SLOTS, hidden_size), slot
    if v.aux_layout == "slot-major":
        return dense.view(SLOTS, T, hidden_size)[slot].unsqueeze(1), 0
    if v.aux_layout == "padded":
        return aux[:, : SLOTS * hidden_size].unflatten(1, (SLOTS, hidden_size)), slot
    raise ValueError(f"{v.name}: no aux layout {v.aux_layout!r} (one of {AUX_LAYOUTS})")


def warps_at(v: Variant, hidden_size: int, tokens: int, sms) -> int:
    """The warps ``v``'s launch of ``tokens`` rows takes on a device whose bands count
    ``sms`` SMs (None: no bands there): kernel_arguments' answer for the variant's
    own block and warps, else the op's (asked with meta tensors: nothing allocated)."""
    h = torch.empty(tokens, hidden_size, device="meta")
    w = h[0] if kind_of(v).apply_norm else None
    normed = h if w is not None else None
    return kernel_arguments(h, h, w, normed, block_h=v.block_h, num_warps=v.num_warps, sms=sms)[2]


def launch(v: Variant, shape: tuple, inputs: BufferSet, aux: torch.Tensor, slot: int) -> None:
    """One launch of the production kernel: ``inputs``' rows, slot ``slot`` of the aux
    storage ``aux`` in ``v``'s layout (of FlashInfer's norm for the peer: in place on
    ``inputs``' rows)."""
    if v.kind == PEER:
        flashinfer_peer()[0](inputs.h, inputs.r, inputs.w, EPS)
        return
    kind = KINDS[v.kind]
    block_h, _, col_blocks = shape
    h, r = inputs.h, inputs.r
    num_warps = warps_at(v, h.shape[1], h.shape[0], band_sms(h.device.index) if h.is_cuda else None)
    aux, slot = slot_view(v, aux, h.shape[1], slot)
    normed = inputs.normed if v.out_of_place else h
    res_out = inputs.res_out if v.out_of_place else r
    _, values, num_warps = kernel_arguments(
        h,
        r,
        inputs.w if kind.apply_norm else None,
        normed if kind.apply_norm else None,
        res_out if kind.store_residual else None,
        aux if kind.capture else None,
        eps=EPS,
        slot=slot,
        norm_fp32_sum=kind.norm_fp32_sum,
        use_pdl=v.pdl,
        block_h=block_h,
        num_warps=num_warps,
    )
    values.update(v.knobs)
    add_rmsnorm_capture_kernel[(h.shape[0], col_blocks)](
        **values, num_warps=num_warps, **({"launch_pdl": True} if v.pdl else {})
    )


def check_variant(v: Variant, shape: tuple, inputs: BufferSet) -> None:
    """One launch on copies of ``inputs``, outputs against torch: the captured
    and stored sums bit-exact (one fp32 add, one rounding), the normed output
    to 1% (relative norm of the error). Raises AssertionError."""
    out = inputs.clone()
    out.aux.fill_(float("nan"))
    launch(v, shape, out, out.aux, 0)
    kind = kind_of(v)
    s32 = inputs.h.float() + inputs.r.float()
    s = s32.to(inputs.h.dtype)
    slots, slot = slot_view(v, out.aux, inputs.h.shape[1], 0)
    stored = {"capture": slots[:, slot]} if kind.capture else {}
    if kind.store_residual:
        stored["residual"] = out.res_out if v.out_of_place else out.r
    for what, got in stored.items():
        if not torch.equal(got, s):
            raise AssertionError(f"{v.name}: the {what} differs from h + r")
    if not kind.store_residual and not torch.equal(out.r, inputs.r):
        raise AssertionError(f"{v.name}: the residual input was written")
    if kind.apply_norm:
        x = (s32 if kind.norm_fp32_sum else s.float()).double()
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * inputs.w.double()
        got = (out.normed if v.out_of_place else out.h).double()
        rel = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if not rel <= 1e-2:
            raise AssertionError(f"{v.name}: normed output rel err {rel:.2e}")


def graph_steps_of(v: Variant, shape: tuple, sets: list, launches: int) -> list:
    """One zero-argument step per buffer set: step i launches ``launches`` times,
    launch k on the rows of set i * launches + k (mod the number of sets) into
    slot k of set i's aux buffer. Consecutive launches walk the sets in order, so
    a set's rows are read again only after every other set's (>= --rotate-l2 x L2
    of traffic): no launch finds its inputs in L2. (Step i on sets i + k, as
    before, read every set in every step once there were as few sets as launches,
    and a set came back two launches later: at T = 512 - 1024, where a set is
    about L2's size, that put FlashInfer's norm above the copy roofline.)"""
    n = len(sets)

    def step(i):
        for k in range(launches):
            launch(v, shape, sets[(i * launches + k) % n], sets[i].aux, k % SLOTS)

    return [lambda i=i: step(i) for i in range(n)]


# ----------------------------------------------------------------------------
# Sweep, report
# ----------------------------------------------------------------------------


def pdl_unavailable() -> Optional[str]:
    """Why this machine cannot launch with PDL, or None."""
    if not HAS_PDL:
        return "this Triton has no gdc_wait / gdc_launch_dependents"
    if torch.cuda.get_device_capability()[0] < 9:
        return "PDL needs sm_90+"
    return None


def measure_cell(v: Variant, shape: tuple, sets: list, launches: int, args) -> float:
    check_variant(v, shape, sets[0])
    return time_graph_replay(
        graph_steps_of(v, shape, sets, launches), args.steps_per_graph, args.replays
    )


def run(args, variants: list, launches: int) -> dict:
    """Print the sweep's table at ``args.hidden_size``; return its cells,
    ``{T: {variant name: median us per step, or None}}``. With the peer among
    the variants, a second table gives every cell as a multiple of the peer's."""
    device, dtype = torch.device("cuda"), DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    H = args.hidden_size
    roof = measure_copy_roofline(device)["gbps"]
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    out_of_place = any(v.out_of_place for v in variants)
    shapes = {v.name: v.launch_shape(H) for v in variants}
    print(
        f"{len(variants)} variants, {per_step(launches)}, H = {H}, {args.dtype}; "
        f">= {args.steps_per_graph} steps per CUDA graph, {args.replays} replays, buffer sets "
        f"rotated past {args.rotate_l2:g} x L2 ({l2_bytes / 2**20:.0f} MiB)"
    )
    print(
        f"copy roofline {roof:.0f} GB/s (2 GiB eager copy, read + written); cells: median us "
        f"per step (% of roofline)"
    )
    width = max(16, max(len(v.name) for v in variants) + 1)
    print(f"{'T':>6} {'sets':>5} " + " ".join(v.name.rjust(width) for v in variants), flush=True)
    table = {}
    for T in args.tokens:
        one_set = set_bytes(T, H, elem, out_of_place)
        free, _ = torch.cuda.mem_get_info(device)
        num_sets = max(
            2 * launches,
            rotation_sets(
                one_set, l2_bytes, args.rotate_l2, max_sets=MAX_SETS, budget_bytes=free // 2
            ),
        )
        sets = [make_set(T, H, dtype, device, out_of_place) for _ in range(num_sets)]
        cells, table[T] = [], {}
        for v in variants:
            table[T][v.name] = None
            try:
                us = measure_cell(v, shapes[v.name], sets, launches, args)
            except Exception as exc:  # a variant this GPU / Triton cannot run: say why, go on
                reason = (str(exc).strip().splitlines() or [""])[0][:200]
                print(f"T = {T}, {v.name}: {type(exc).__name__}: {reason}", file=sys.stderr)
                wrong = isinstance(exc, AssertionError)  # check_variant: wrong outputs
                cells.append("WRONG" if wrong else f"err {type(exc).__name__}"[: width - 1])
                continue
            table[T][v.name] = us
            kind = kind_of(v)
            nbytes = launches * elem * (kind.rows_moved * T * H + H * kind.apply_norm)
            cells.append(f"{us:8.2f} ({100 * nbytes / us / 1e3 / roof:3.0f}%)")
        print(f"{T:>6} {num_sets:>5} " + " ".join(c.rjust(width) for c in cells), flush=True)
        del sets
        torch.cuda.empty_cache()
    peer = next((v.name for v in variants if v.kind == PEER), None)
    if peer is not None:
        print(f"x k: each cell / {peer}'s (below 1.00: faster than FlashInfer's norm alone)")
        print(f"{'T':>6} " + " ".join(v.name.rjust(width) for v in variants))
        for T, cells in table.items():
            base = cells[peer]
            print(
                f"{T:>6} "
                + " ".join(
                    (f"{cells[v.name] / base:.3f}" if base and cells[v.name] else "-").rjust(width)
                    for v in variants
                ),
                flush=True,
            )
    return table


def per_step(launches: int) -> str:
    return f"{launches} launch{'es' if launches > 1 else ''} per step"


def list_lines(variants: list, hidden_size: int, launches: int) -> list:
    lines = [
        f"{len(variants)} variants at H = {hidden_size}, {per_step(launches)}:",
        f"  {'name':<14} {'kind':<4} {'BLOCK_H':>7} {'warps':>5} {'col blocks':>10} "
        f"{'PDL':>3} {'out of place':>12}",
    ]
    for v in variants:
        block_h, num_warps, col_blocks = v.launch_shape(hidden_size)
        lines.append(
            f"  {v.name:<14} {v.kind:<4} {block_h:>7} {num_warps:>5} {col_blocks:>10} "
            f"{'yes' if v.pdl else 'no':>3} {'yes' if v.out_of_place else 'no':>12}"
        )
    lines += [
        "  (warps: launch_config's for H; a variant that does not set them takes the op's "
        "choice at each T, one_wave_warps)"
    ]
    lines += ["Kinds:"] + [f"  {k}  {kind.what}" for k, kind in KINDS.items()]
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sweep",
        choices=sorted(SWEEPS),
        default="launch",
        help="launch: launch parameters (default); variants: named variants",
    )
    p.add_argument(
        "--hidden-size",
        type=int,
        nargs="+",
        default=[7168],
        help="H, one or more (default 7168): one table per H",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=DEFAULT_TOKENS,
        help=f"T values (default {' '.join(map(str, DEFAULT_TOKENS))})",
    )
    p.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="run only these variants of the sweep (names as --list prints them)",
    )
    add_graph_timing_arguments(
        p,
        replays=30,
        one_set_note="one set per launch of a step",
        steps_note="every buffer set once where there are more",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="also write the cells (us per step per H, T and variant), the device "
        "and, in the flashinfer sweep, which FlashInfer ran, to PATH",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print the sweep's variants and launch settings and exit (no GPU needed)",
    )
    args = p.parse_args(argv)
    if min(args.hidden_size) < 1 or args.replays < 1 or args.steps_per_graph < 1:
        p.error("--hidden-size, --replays and --steps-per-graph must be at least 1")
    args.hidden_sizes, args.hidden_size = args.hidden_size, args.hidden_size[0]
    make_variants, args.launches = SWEEPS[args.sweep]
    args.variants = make_variants(args.hidden_size)
    if args.only:
        names = [v.name for v in args.variants]
        unknown = [n for n in args.only if n not in names]
        if unknown:
            p.error(
                f"--only: no variant {', '.join(map(repr, unknown))} in the {args.sweep} "
                f"sweep; its variants: {', '.join(names)}"
            )
        args.variants = [v for v in args.variants if v.name in args.only]
    try:
        for v in args.variants:
            for hidden_size in args.hidden_sizes:
                v.launch_shape(hidden_size)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        names = {v.name for v in args.variants}
        for hidden_size in args.hidden_sizes:
            variants = [v for v in SWEEPS[args.sweep][0](hidden_size) if v.name in names]
            print("\n".join(list_lines(variants, hidden_size, args.launches)))
        return 0
    if not torch.cuda.is_available():
        print(
            "tune_kernel: no CUDA GPU here, nothing measured: the sweeps time compiled kernels "
            "under CUDA-graph replay. --list shows what a sweep runs."
        )
        return 0
    variants = args.variants
    no_pdl = pdl_unavailable()
    if no_pdl and any(v.pdl for v in variants):
        print(f"PDL variants left out: {no_pdl}")
        variants = [v for v in variants if not v.pdl]
    props = torch.cuda.get_device_properties(0)
    device = f"{props.name}  torch {torch.__version__}  triton {triton.__version__}"
    print(f"device: {device}; sweep: {args.sweep}")
    peer_line = None
    if any(v.kind == PEER for v in variants):
        fn, peer_line = flashinfer_peer()
        print(f"peer (k): {peer_line}", flush=True)
        if fn is None:
            print("FlashInfer's norm is not available: its cells are left out")
            variants = [v for v in variants if v.kind != PEER]
    if not variants:
        print("No variant to run.")
        return 0
    tables = {}
    sms = band_sms(0)
    for hidden_size in args.hidden_sizes:
        args.hidden_size = hidden_size
        names = {v.name for v in variants}
        # the sweep's variants at this H, as selected (the same names at every H)
        chosen = [v for v in SWEEPS[args.sweep][0](hidden_size) if v.name in names]
        tables[hidden_size] = run(args, chosen, args.launches)
        if args.json:  # after every H: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "device": device,
                        "sweep": args.sweep,
                        "flashinfer": peer_line,
                        "config": {k: v for k, v in vars(args).items() if k != "variants"},
                        "variants": {
                            v.name: {
                                "kind": v.kind,
                                "num_warps": v.num_warps,
                                "pdl": v.pdl,
                                "knobs": dict(v.knobs),
                                "aux_layout": v.aux_layout,
                            }
                            for v in chosen
                        },
                        "us_per_step": tables,
                        # the warps each launch took (the op's change with T in its bands)
                        "warps": {
                            H: {
                                T: {
                                    v.name: warps_at(v, H, T, sms) for v in chosen if v.kind != PEER
                                }
                                for T in args.tokens
                            }
                            for H in tables
                        },
                    },
                    f,
                    indent=1,
                    default=str,
                )
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
