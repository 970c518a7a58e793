"""SGLang 0.5.23's REAL DeepseekV3ForCausalLM on a GPU, with FlashInfer's real
``fused_add_rmsnorm`` as SGLang's own norm kernel, against the fused EAGLE-3
capture installed by the plugin. ``--family llama | qwen3_moe | ...`` builds that
family's own SGLang class instead (``family_models.py``: the same stand-ins, the
same scenarios).

Run on the GPU machine through ``tools/gpu/gpu_sglang_real.sh`` (which unpacks
``.gpu_bundle/`` and sets the path), or by hand::

    PYTHONPATH=<sglang tree>:<site>:. python3 -m tests.sglang_real.gpu_scenarios --out r.json
    # CPU dry run of the same logic (no graphs, no timing; see --device below):
    PYTHONPATH=.cache/sglang/0.5.23:. .venv/bin/python -m tests.sglang_real.gpu_scenarios \\
        --device cpu --hidden 1024

What is real: everything ``harness.py`` lists (SGLang's model classes, decoder
layers, layer boundaries, RMSNorm, capture loop / AuxHiddenStatePacker, plugin
system), plus, on the GPU, SGLang's CUDA dispatch: ``RMSNorm`` resolves to
``forward_cuda`` (``sglang.srt.utils.is_cuda()`` is true there), which calls
``fused_add_rmsnorm`` / ``rmsnorm`` imported from ``sgl_kernel``. sgl_kernel stays
a stub (``stubs.py``) except for those two names, which are routed to FlashInfer's
real ``flashinfer.norm.fused_add_rmsnorm`` / ``rmsnorm`` -- the kernel sgl_kernel
itself compiles from FlashInfer's ``norm.cuh``, same signature and in-place
semantics (``residual += x; x = rmsnorm(residual) * w``), here through FlashInfer's
CUDA JIT norm module (``FLASHINFER_USE_CUDA_NORM=1``: the CuTe-DSL norms need
nvidia-cutlass-dsl, which the machine lacks). In SGLang 0.5.23 ``forward_cuda``
takes SGLang's own JIT kernel (``sglang.kernels.ops.layernorm.norm``, tvm-ffi) only
for ``cast_x_before_out_mul=True`` norms, which DeepseekV2 does not build: the
plain residual case always calls ``sgl_kernel.fused_add_rmsnorm``. The routed
functions count their calls, and the summary shows them.

Stood in (as in harness.py): attention and MLP / MoE of every layer (``0.5 *
tanh(h @ W^T)`` in fp32, W seeded per layer) and the weights; the
LogitsProcessor is SGLang's own (harness.py), inside the CUDA graphs too.
Deviations from harness.py: the model is built on the CPU by
``harness.build_model`` and then moved with ``model.to(cuda)``
(the stand-ins' weights are drawn with a CPU generator, which cannot run under a
``torch.device("cuda")`` context); ``ForwardBatch`` tensors are moved the same way
(``*_cpu`` fields stay on the CPU, as in SGLang); the server arguments published
by ``harness.setup`` keep ``device="cpu"`` and the gloo TP=1 group (no collective
runs at TP 1, and the model's forward reads no server-level device); and
``SGLANG_IS_FLASHINFER_AVAILABLE`` is ``true`` here (FlashInfer is installed, as
in a deployment), where harness.py defaults it to ``false``.

Scenarios (each its own entry in the JSON; the exit status is 1 when a check
failed, 3 when set-up failed before any scenario ran):

* ``flashinfer``: the routed kernel's semantics on random data (FlashInfer vs a
  fp32 torch reference) and our fused op vs FlashInfer on the same inputs; the
  time of FlashInfer's JIT build of its norm module.
* ``eager`` (a): SGLang's own capture on one model, the drop-in (installed by the
  plugin through SGLang's own ``load_plugins()`` and configure step, with
  ``EAGLE_CAPTURE_VERIFY``) on a second one from the same seed; per case and per
  captured layer: equal or not, fraction of differing elements, max abs / rel /
  ulp deviation. Required: the first captured layer bit-exact, every later layer
  within a rounding-level bound (max deviation <= 2^-4 of the layer's max |value|), the live self-check reporting every verified
  forward equal, one fused capture per captured layer and forward.
* ``graphs`` (b): ``model.forward`` of the drop-in captured in
  ``torch.cuda.CUDAGraph`` for T = 1, 4, 16, 64 (decode batches, one graph pool,
  one aux buffer); each replayed with new token ids copied into its static
  inputs; the replayed capture (buffer rows [0, T)) and final hidden states must
  equal an eager forward of the drop-in on the same inputs bit for bit, and
  compare with SGLang's own eager capture as in (a); afterwards an eager forward
  must pass the completeness check and ``state.graph_captured`` must be True.
* ``timing`` (c): median GPU time per forward (CUDA events around each graph
  replay) of no capture, SGLang's own capture and the drop-in at T = 1, 64, 1024,
  with the harness's matmul stand-ins and with elementwise ones (``0.5 *
  tanh(h)``: the capture's cost is then not buried under fp32 matmuls).
* ``one_kernel`` (d, CUDA only): ``EAGLE_CAPTURE_FUSED_ALLREDUCE``'s paths at a
  captured layer's ``forward_with_allreduce_fusion``, as SGLang calls it at
  TP > 1: the project's one kernel on a world-1 NCCL group (T <= 64) and the
  all-reduce + fused op (T = 100, 1024) vs SGLang's own norm (FlashInfer) on
  the same rows -- residual and capture bit-exact, normed within 2 ulp -- and
  the one-kernel call captured in a CUDA graph, replayed on new rows. (At
  W = 1 the kernel's sum is one partial; W >= 2 needs the multi-GPU kinds.)

``--device cpu`` (a dry run of this file's logic on a machine without a GPU):
by default SGLang is made to believe it runs on CUDA (``torch.cuda`` queries
answer as an H200 would, so its CUDA import branches, its CUDA construction
paths and ``RMSNorm.forward_cuda`` run), sgl_kernel's two norm names are routed
to a torch implementation instead of FlashInfer, tensors stay on the CPU (our op
takes its CPU path), and the graph and timing scenarios are skipped.
``--no-fake-cuda`` keeps SGLang on its CPU paths (``forward_native``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import platform
import statistics
import sys
import time
import traceback
import types

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

ARCH = "DeepseekV3ForCausalLM"
DEEPSEEK = "deepseek_v3"
# The other families (tests/sglang_real/family_models.py; names only: no import of
# SGLang before the harness's set-up) and their feed-forward attribute where not mlp.
FAMILY_NAMES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "glm4_moe",
    "minimax_m2",
)
FFN_ATTR = {"minimax_m2": "block_sparse_moe"}
DRAFT_IDS = [1, 3, 5]  # SpecForge ids -> SGLang layers [2, 4, 6]
CAPTURED_LAYERS = [2, 4, 6]
EAGER_CASES = (
    (1024, "extend"),
    (64, "decode"),
    (5, "extend"),
    (1, "decode"),
    (4, "decode"),
    (16, "decode"),
    (300, "extend"),
)
GRAPH_SIZES = (1, 4, 16, 64)
TIMING_SIZES = (1, 64, 1024)
ELEMENTWISE_EXTRA_SIZES = (4096,)

# Rounding-level bound for captured layers after the first (their inputs went
# through a norm that differs from SGLang's by rsqrt / reduction-order rounding;
# a wrong capture -- wrong layer, stale rows, no residual add -- is off by O(1)).
# Checked: max |ours - SGLang| / max |SGLang| of the layer (a rounding flip is ~1 ulp =
# 2^-8 of an element); the fraction of differing elements is reported, not bounded
# (one flipped normed element changes a whole row of the next stand-in's matmul).
LATER_LAYER_MAX_REL_TO_SCALE = 2.0**-4

ROUTED_CALLS = {"fused_add_rmsnorm": 0, "rmsnorm": 0}
ROUTED_TO = {"impl": None}
_FAKE_MODE = None  # the CPU dry run's TorchFunctionMode (install_fake_cuda)


# ------------------------------------------------------------------ results


class Results:
    def __init__(self):
        self.data: dict = {"checks": [], "scenarios": {}}
        self.failed = 0

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        ok = bool(ok)
        self.data["checks"].append({"name": name, "ok": ok, "detail": detail})
        if not ok:
            self.failed += 1
        print(
            f"  [{'PASS' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""), flush=True
        )
        return ok

    def error(self, scenario: str, exc: BaseException) -> None:
        tb = traceback.format_exc()
        self.data["scenarios"].setdefault(scenario, {})["error"] = tb
        self.check(f"{scenario}: ran to the end", False, f"{type(exc).__name__}: {exc}")
        print(tb, flush=True)


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record):
        try:
            self.lines.append((record.levelno, record.getMessage()))
        except Exception:  # noqa: BLE001
            pass

    def matching(self, text: str) -> list[str]:
        return [m for _, m in self.lines if text in m]


# -------------------------------------------------------------- environment


def install_fake_cuda():
    """CPU dry run only: torch.cuda answers as one H200 would, so SGLang takes
    its CUDA import / construction / dispatch branches; tensors stay on the CPU."""
    import torch

    props = types.SimpleNamespace(
        name="NVIDIA H200 (fake, CPU dry run)",
        major=9,
        minor=0,
        total_memory=141 << 30,
        multi_processor_count=132,
        L2_cache_size=60 << 20,
        warp_size=32,
        gcnArchName="",
        is_integrated=False,
        is_multi_gpu_board=False,
        max_threads_per_multi_processor=2048,
        regs_per_multiprocessor=65536,
        shared_memory_per_block_optin=232448,
        uuid="fake",
    )

    class FakeEvent:
        def __init__(self, *a, **k):
            pass

        def record(self, *a, **k):
            pass

        def wait(self, *a, **k):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

        def elapsed_time(self, other):
            return 0.0

    class FakeStream:
        def __init__(self, *a, **k):
            self.cuda_stream = 0
            self.device = torch.device("cpu")

        def wait_stream(self, *a):
            pass

        def wait_event(self, *a):
            pass

        def record_event(self, event=None):
            return event or FakeEvent()

        def synchronize(self):
            pass

        def query(self):
            return True

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    class FakeGraph:
        """Logic-only stand-in for torch.cuda.CUDAGraph: replay() re-runs the
        captured forward eagerly and copies its results into the tensors recorded
        at 'capture' (see capture_graph)."""

        def __init__(self, *a, **k):
            self._replay = None

        def replay(self):
            self._replay()

    class fake_graph(contextlib.nullcontext):
        def __init__(self, graph, pool=None, **k):
            super().__init__()

    c = torch.cuda
    for name, value in dict(
        CUDAGraph=FakeGraph,
        graph=fake_graph,
        graph_pool_handle=lambda: None,
    ).items():
        setattr(c, name, value)
    for name, value in dict(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        set_device=lambda *a: None,
        get_device_capability=lambda *a: (9, 0),
        get_device_name=lambda *a: props.name,
        get_device_properties=lambda *a: props,
        mem_get_info=lambda *a: (130 << 30, 141 << 30),
        synchronize=lambda *a: None,
        is_current_stream_capturing=lambda: False,
        Stream=FakeStream,
        Event=FakeEvent,
        current_stream=lambda *a: FakeStream(),
        default_stream=lambda *a: FakeStream(),
        stream=lambda *a: contextlib.nullcontext(),
        is_initialized=lambda: True,
        empty_cache=lambda: None,
        get_arch_list=lambda: ["sm_90a"],
        memory_allocated=lambda *a: 0,
        max_memory_allocated=lambda *a: 0,
    ).items():
        setattr(c, name, value)
    torch.version.cuda = "13.0"

    # What SGLang allocates on "cuda" explicitly (device=..., .to("cuda"), .cuda())
    # lands on the CPU.
    from torch.overrides import TorchFunctionMode

    def cpu(dev):
        return (
            "cpu" if isinstance(dev, (str, torch.device)) and str(dev).startswith("cuda") else dev
        )

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            name = getattr(func, "__name__", "")
            if name == "cuda":
                return args[0]
            if name == "to" and len(args) > 1:
                args = (args[0], cpu(args[1])) + tuple(args[2:])
            return func(*args, **kwargs)

    global _FAKE_MODE
    _FAKE_MODE = CudaToCpu()
    _FAKE_MODE.__enter__()


def _torch_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """CPU stand-in for FlashInfer's kernel: residual += input (fp32 sum, rounded
    once); input = sum / rms(sum) * weight, from the unrounded fp32 sum."""
    import torch

    s = input.float() + residual.float()
    residual.copy_(s.to(residual.dtype))
    inv = torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    input.copy_((s * inv * weight.float()).to(input.dtype))


def _torch_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    import torch

    x = input.float()
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()
    y = y.to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def route_sgl_kernel_norms(use_flashinfer: bool) -> str:
    """sgl_kernel stays a stub (tests/sglang_real/stubs.py); the two names
    SGLang's RMSNorm.forward_cuda calls for DeepseekV2's norms get FlashInfer's
    real kernels (GPU) or the torch stand-in above (CPU dry run). Must run before
    sglang.srt.layers.layernorm is imported (it binds the names at import)."""
    from tests.sglang_real import stubs

    stubs.install()
    import sgl_kernel

    if not getattr(sgl_kernel, "__stub__", False):
        raise RuntimeError(
            f"a real sgl_kernel is importable ({sgl_kernel.__file__}): this "
            f"run expects it stubbed, with only the norms routed"
        )
    if use_flashinfer:
        import flashinfer
        import flashinfer.norm as fin

        fused, plain = fin.fused_add_rmsnorm, fin.rmsnorm
        where = (
            f"flashinfer {flashinfer.__version__}: flashinfer.norm.fused_add_rmsnorm / "
            f"rmsnorm (FLASHINFER_USE_CUDA_NORM={os.environ.get('FLASHINFER_USE_CUDA_NORM')})"
        )
    else:
        fused, plain = _torch_fused_add_rmsnorm, _torch_rmsnorm
        where = "torch stand-in for FlashInfer (CPU dry run)"

    def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
        ROUTED_CALLS["fused_add_rmsnorm"] += 1
        fused(input, residual, weight, eps, enable_pdl=enable_pdl)

    def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
        ROUTED_CALLS["rmsnorm"] += 1
        return plain(input, weight, eps, out=out, enable_pdl=enable_pdl)

    sgl_kernel.fused_add_rmsnorm = fused_add_rmsnorm
    sgl_kernel.rmsnorm = rmsnorm
    ROUTED_TO["impl"] = where
    return where


def versions() -> dict:
    import importlib.metadata as md

    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    for name in (
        "sglang",
        "transformers",
        "flashinfer-python",
        "apache-tvm-ffi",
        "triton",
        "huggingface-hub",
        "tokenizers",
        "pydantic",
        "eagle-capture",
    ):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    for mod in ("sglang", "transformers", "flashinfer", "tvm_ffi", "sgl_kernel"):
        m = sys.modules.get(mod)
        out[f"{mod}_from"] = (
            None
            if m is None
            else "stub"
            if getattr(m, "__stub__", False)
            else getattr(m, "__file__", "?")
        )
    return out


# ----------------------------------------------------------------- helpers


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def batch_to(batch, device, input_ids=None):
    """A harness batch with its tensors on ``device`` (``*_cpu`` fields stay),
    optionally with other token ids."""
    ids, positions, fb = batch
    if input_ids is not None:
        ids = input_ids.to(ids.device)
    ids, positions = ids.to(device), positions.to(device)
    for f in dataclasses.fields(fb):
        value = getattr(fb, f.name, None)
        if f.name.endswith("_cpu") or not hasattr(value, "to") or not hasattr(value, "is_cuda"):
            continue
        setattr(fb, f.name, value.to(device))
    fb.input_ids, fb.positions = ids, positions
    return ids, positions, fb


def eager(harness, model, batch):
    """(final hidden states, what the draft receives from SGLang's LogitsProcessor)."""
    call = harness.run(model, batch)
    harness.text_lm(model).logits_processor.records.clear()
    aux = harness.draft_input(call)
    return call.hidden_states.clone(), None if aux is None else aux.clone()


def ordered_int(x):
    """bf16 / fp16 / fp32 bits as integers ordered like the values (ulp distance)."""
    import torch

    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[
        x.dtype
    ]
    i = x.contiguous().view(bits).to(torch.int64)
    sign_bit = 1 << (8 * x.element_size() - 1)
    return torch.where(i < 0, -(i + sign_bit), i)


def deviation(a, b) -> dict:
    """ours (a) vs SGLang's (b), same shape."""
    import torch

    differ = a != b
    n = a.numel()
    d = (a.float() - b.float()).abs()
    ref = b.float().abs()
    rel = torch.where(ref > 0, d / ref.clamp_min(1e-30), torch.where(d > 0, float("inf"), 0.0))
    scale = ref.max().item() if n else 0.0
    return {
        "equal": not bool(differ.any()),
        "n_diff": int(differ.sum()),
        "frac_diff": float(differ.sum()) / max(n, 1),
        "max_abs": d.max().item() if n else 0.0,
        "max_rel": rel.max().item() if n else 0.0,
        "max_abs_over_scale": (d.max().item() / scale) if n and scale else 0.0,
        "max_ulp": int((ordered_int(a) - ordered_int(b)).abs().max()) if n else 0,
        "scale": scale,
    }


def per_layer(aux_ours, aux_ref, hidden) -> list[dict]:
    return [
        dict(
            layer=layer,
            **deviation(
                aux_ours[:, k * hidden : (k + 1) * hidden],
                aux_ref[:, k * hidden : (k + 1) * hidden],
            ),
        )
        for k, layer in enumerate(CAPTURED_LAYERS)
    ]


def fmt_dev(d: dict) -> str:
    if d["equal"]:
        return "bit-exact"
    return (
        f"{d['frac_diff']:.2e} of elements differ, max abs {d['max_abs']:.3g}, "
        f"max rel {d['max_rel']:.3g}, max {d['max_ulp']} ulp (scale {d['scale']:.3g})"
    )


def check_layers(res: Results, where: str, layers: list[dict]) -> None:
    first, later = layers[0], layers[1:]
    res.check(
        f"{where}: first captured layer {first['layer']} bit-exact", first["equal"], fmt_dev(first)
    )
    for d in later:
        ok = d["max_abs_over_scale"] <= LATER_LAYER_MAX_REL_TO_SCALE
        res.check(f"{where}: layer {d['layer']} within rounding", ok, fmt_dev(d))


class LightStandIn:
    """Built lazily (needs torch): elementwise stand-in for timing."""

    @staticmethod
    def make(real):
        import torch

        class Light(torch.nn.Module):
            def __init__(self, replaced):
                super().__init__()
                object.__setattr__(self, "_real", getattr(replaced, "_real", replaced))
                self.role = getattr(replaced, "role", "?")

            def __getattr__(self, name):
                try:
                    return super().__getattr__(name)
                except AttributeError:
                    real = self.__dict__.get("_real")
                    if real is None:
                        raise
                    return getattr(real, name)

            def forward(self, *args, **kwargs):
                h = kwargs.get("hidden_states", args[0] if args else None)
                return (0.5 * torch.tanh(h.float())).to(h.dtype)

        return Light(real)


# ------------------------------------------------------------------ set-up


class Ctx:
    pass


def setup(args, res: Results) -> Ctx:
    import torch

    ctx = Ctx()
    ctx.args = args
    ctx.device = torch.device(args.device)
    ctx.dtype = getattr(torch, args.dtype)
    ctx.t0 = time.time()
    from tests.sglang_real import harness

    ctx.harness = harness
    harness.setup(
        dtype=ctx.dtype,
        hf_config=harness.make_config(num_layers=args.layers, hidden_size=args.hidden),
    )
    ctx.logs = LogLines()
    log = logging.getLogger("eagle_capture")
    log.addHandler(ctx.logs)
    log.setLevel(logging.DEBUG)
    res.data["env"] = versions()
    res.data["env"].update(
        device=str(ctx.device),
        fake_cuda=args.fake_cuda,
        sglang_is_cuda=_sglang_is_cuda(),
        norm_route=ROUTED_TO["impl"],
        SGLANG_IS_FLASHINFER_AVAILABLE=os.environ.get("SGLANG_IS_FLASHINFER_AVAILABLE"),
        hidden=args.hidden,
        layers=args.layers,
        dtype=args.dtype,
    )
    if ctx.device.type == "cuda":
        res.data["env"]["gpu"] = torch.cuda.get_device_name()
    return ctx


def _sglang_is_cuda():
    try:
        from sglang.srt.utils import is_cuda

        return bool(is_cuda())
    except Exception as e:  # noqa: BLE001
        return f"? ({e})"


def build(ctx, set_capture=False):
    t = time.time()
    if ctx.args.family == DEEPSEEK:
        model = ctx.harness.build_model(
            num_layers=ctx.args.layers,
            hidden_size=ctx.args.hidden,
            dtype=ctx.dtype,
            capture_ids=DRAFT_IDS,
            seed=ctx.args.seed,
            arch=ARCH,
            set_capture=set_capture,
        )
    else:  # another family's own SGLang class (family_models.py)
        from tests.sglang_real import family_models

        model = family_models.build(
            ctx.args.family,
            dtype=ctx.dtype,
            capture_ids=DRAFT_IDS,
            seed=ctx.args.seed,
            num_layers=ctx.args.layers,
            hidden_size=ctx.args.hidden,
            set_capture=set_capture,
        )
    model.to(ctx.device)
    sync(ctx.device)
    ctx.build_s = getattr(ctx, "build_s", []) + [round(time.time() - t, 2)]
    return model


def make_models(ctx, res: Results):
    """ref: SGLang's own capture; ours: the drop-in, installed by the plugin through
    SGLang's own load_plugins() + configure step (a direct install if that fails)."""
    from eagle_capture.integrations.sglang import dropin

    lm = ctx.harness.text_lm
    env = dict(
        EAGLE_CAPTURE="1",
        SGLANG_PLUGINS="eagle_capture",
        EAGLE_CAPTURE_MAX_TOKENS=str(ctx.args.max_tokens),
        EAGLE_CAPTURE_VERIFY=str(ctx.args.verify),
    )
    ctx.install = None
    try:
        from tests.sglang_real import plugin_scenarios as ps

        ref, ours = build(ctx), build(ctx)
        with ps.plugins_loaded(**env):
            ps.configure(ours, DRAFT_IDS)
        ps.configure(ref, DRAFT_IDS)
        ctx.install = "plugin (SGLang's load_plugins + configure_aux_hidden_state_capture hook)"
    except Exception as e:  # noqa: BLE001
        res.error("install_via_plugin", e)
        ref = ours = None
    if ctx.install is None:
        ref, ours = build(ctx, set_capture=True), build(ctx, set_capture=True)
        dropin.install_eagle3_capture(ours, ctx.args.max_tokens)
        state = lm(ours)._eagle_capture
        state.verify_left = state.verify_total = ctx.args.verify
        ctx.install = "direct install_eagle3_capture (the plugin path failed, see above)"
    ctx.ref, ctx.ours = ref, ours
    ctx.state = lm(ours)._eagle_capture
    st = ctx.state
    res.data["install"] = {
        "how": ctx.install,
        "layer_ids": st.layer_ids,
        "buffer": list(st.buffer.aux.shape),
        "buffer_device": str(st.buffer.aux.device),
        "surface": st.surface,
        "build_s": ctx.build_s,
        "log": [m for _, m in ctx.logs.lines if "ON" in m][:3],
    }
    res.check(
        "install: layers [2, 4, 6], buffer on the model's device",
        st.layer_ids == CAPTURED_LAYERS
        and st.buffer.aux.device.type == ctx.device.type
        and list(st.buffer.aux.shape) == [ctx.args.max_tokens, 3, ctx.args.hidden],
        f"{ctx.install}; layers {st.layer_ids}, buffer {list(st.buffer.aux.shape)} on "
        f"{st.buffer.aux.device}",
    )
    res.check(
        "install: SGLang's own capture still on in the reference model",
        lm(ref).model.layers_to_capture == CAPTURED_LAYERS and lm(ref).capture_aux_hidden_states,
        str(lm(ref).model.layers_to_capture),
    )
    return ctx


# --------------------------------------------------------------- scenarios


def scenario_flashinfer(ctx, res: Results):
    """FlashInfer's routed kernel vs a fp32 torch reference, and our fused op vs
    FlashInfer, on random [T, H] inputs."""
    import sgl_kernel
    import torch

    from eagle_capture import ops

    out = {"route": ROUTED_TO["impl"]}
    dev, dtype, H = ctx.device, ctx.dtype, ctx.args.hidden
    if ctx.args.norm_impl == "flashinfer":
        import flashinfer.norm as fin
        from flashinfer.jit.norm import gen_norm_module

        t = time.time()
        fin.get_norm_module()
        out["jit_build_or_load_s"] = round(time.time() - t, 1)
        spec = gen_norm_module()
        out["norm_module"] = str(spec.get_library_path())
        out["norm_module_is_prebuilt_aot"] = bool(spec.is_aot)
    g = torch.Generator(device="cpu").manual_seed(7)
    out["cases"] = []
    for T in (1, 64, 1024):
        x = torch.randn(T, H, generator=g).to(dev, dtype)
        r = torch.randn(T, H, generator=g).to(dev, dtype)
        w = (1 + 0.1 * torch.randn(H, generator=g)).to(dev, dtype)
        eps = 1e-6
        fx, fr = x.clone(), r.clone()
        sgl_kernel.fused_add_rmsnorm(fx, fr, w, eps)
        tx, tr = x.clone(), r.clone()
        _torch_fused_add_rmsnorm(tx, tr, w, eps)
        aux = torch.zeros(T, 1, H, device=dev, dtype=dtype)
        ox, orr = x.clone(), r.clone()
        ops.add_rmsnorm_capture(ox, orr, w, eps, aux, 0, norm_fp32_sum=True)
        plain = sgl_kernel.rmsnorm(x, w, eps)
        sync(dev)
        case = {
            "T": T,
            "flashinfer_residual_vs_torch": deviation(fr, tr),
            "flashinfer_normed_vs_torch": deviation(fx, tx),
            "flashinfer_rmsnorm_vs_torch": deviation(plain, _torch_rmsnorm(x, w, eps)),
            "ours_residual_vs_flashinfer": deviation(orr, fr),
            "ours_capture_vs_flashinfer_residual": deviation(aux[:, 0], fr),
            "ours_normed_vs_flashinfer": deviation(ox, fx),
        }
        out["cases"].append(case)
        res.check(
            f"flashinfer T={T}: residual = x + r (rounded once), as torch's fp32 sum",
            case["flashinfer_residual_vs_torch"]["equal"],
            fmt_dev(case["flashinfer_residual_vs_torch"]),
        )
        res.check(
            f"flashinfer T={T}: normed output within 2 ulp of the fp32 reference",
            case["flashinfer_normed_vs_torch"]["max_ulp"] <= 2,
            fmt_dev(case["flashinfer_normed_vs_torch"]),
        )
        res.check(
            f"flashinfer T={T}: rmsnorm (no residual) within 2 ulp",
            case["flashinfer_rmsnorm_vs_torch"]["max_ulp"] <= 2,
            fmt_dev(case["flashinfer_rmsnorm_vs_torch"]),
        )
        res.check(
            f"ours vs flashinfer T={T}: residual and capture bit-exact",
            case["ours_residual_vs_flashinfer"]["equal"]
            and case["ours_capture_vs_flashinfer_residual"]["equal"],
            fmt_dev(case["ours_capture_vs_flashinfer_residual"]),
        )
        res.check(
            f"ours vs flashinfer T={T}: normed output within 2 ulp",
            case["ours_normed_vs_flashinfer"]["max_ulp"] <= 2,
            "normed: " + fmt_dev(case["ours_normed_vs_flashinfer"]),
        )
    ROUTED_CALLS["fused_add_rmsnorm"] = ROUTED_CALLS["rmsnorm"] = 0
    res.data["scenarios"]["flashinfer"] = out


def scenario_eager(ctx, res: Results):
    """(a) SGLang's own capture vs the plugin-installed drop-in, eager, with the
    live self-check on the first forwards."""
    h, st = ctx.harness, ctx.state
    H = ctx.args.hidden
    out = {"cases": []}
    cases = ctx.args.eager_cases
    fused_before, in_slot_before = st.fused_calls, st.slot_residual_calls
    nonzero = 0
    routed_before = dict(ROUTED_CALLS)
    for i, (T, mode) in enumerate(cases):
        cpu_batch = h.make_batch(ctx.ref, T, mode, seed=100 + i)
        ids = cpu_batch[0].clone()
        final_ref, aux_ref = eager(h, ctx.ref, batch_to(cpu_batch, ctx.device))
        routed_ref = {k: ROUTED_CALLS[k] - routed_before[k] for k in ROUTED_CALLS}
        routed_before = dict(ROUTED_CALLS)
        final, aux = eager(
            h, ctx.ours, batch_to(h.make_batch(ctx.ours, T, mode, seed=100 + i), ctx.device, ids)
        )
        routed_ours = {k: ROUTED_CALLS[k] - routed_before[k] for k in ROUTED_CALLS}
        routed_before = dict(ROUTED_CALLS)
        nonzero += T > 0
        layers = per_layer(aux, aux_ref, H)
        case = {
            "T": T,
            "mode": mode,
            "aux_shape": list(aux.shape),
            "layers": layers,
            "final_hidden": deviation(final, final_ref),
            "routed_norm_calls_sglang_model": routed_ref,
            "routed_norm_calls_dropin_model": routed_ours,
        }
        out["cases"].append(case)
        res.check(
            f"eager T={T} {mode}: aux shape [T, 3*H] from the drop-in",
            list(aux.shape) == [T, 3 * H] and list(aux_ref.shape) == [T, 3 * H],
            f"{list(aux.shape)} vs SGLang's {list(aux_ref.shape)}",
        )
        check_layers(res, f"eager T={T} {mode}", layers)
    verify_lines = ctx.logs.matching("eagle_capture verify")
    out["verify_log"] = verify_lines
    out["fused_calls"] = st.fused_calls - fused_before
    out["fallback_calls"] = st.fallback_calls
    out["verify_norm_max_dev"] = st.verify_norm_dev
    n = min(ctx.args.verify, nonzero)
    res.check(
        "eager: the drop-in's fused kernel did every capture",
        out["fused_calls"] == 3 * nonzero and st.fallback_calls == 0,
        f"{out['fused_calls']} fused captures for {nonzero} forwards x 3 layers, "
        f"{st.fallback_calls} fallbacks",
    )
    out["residual_in_slot_calls"] = st.slot_residual_calls - in_slot_before
    res.check(
        "eager: path f (the residual lives in the slot) took every capture",
        out["residual_in_slot_calls"] == out["fused_calls"] and st.residual_in_slot is None,
        f"{out['residual_in_slot_calls']} of {out['fused_calls']} captures",
    )
    equal_lines = [m for m in verify_lines if "bit-identical" in m]
    res.check(
        f"eager: live self-check: {n} forwards verified, all equal to SGLang's own "
        f"(FlashInfer) norm",
        st.verified_forwards == n
        and len(equal_lines) == n
        and not st.disabled
        and not ctx.logs.matching("MISMATCH")
        and (n < ctx.args.verify or any("self-check off" in m for m in verify_lines)),
        f"{st.verified_forwards} verified, {len(equal_lines)} 'bit-identical' lines, "
        f"disabled={st.disabled}, normed max dev {st.verify_norm_dev:.3g}",
    )
    norm = ctx.harness.text_lm(ctx.ref).model.layers[1].input_layernorm
    method = getattr(getattr(norm, "_forward_method", None), "__name__", None)
    out["sglang_rmsnorm_forward_method"] = method
    out["routed_norm_calls_total"] = dict(ROUTED_CALLS)
    want = "forward_cuda" if (ctx.device.type == "cuda" or ctx.args.fake_cuda) else "forward_native"
    res.check(f"eager: SGLang's RMSNorm dispatched to {want}", method == want, str(method))
    if want == "forward_cuda":
        res.check(
            "eager: SGLang's norms called the routed " + ROUTED_TO["impl"].split(":")[0],
            ROUTED_CALLS["fused_add_rmsnorm"] > 0 and ROUTED_CALLS["rmsnorm"] > 0,
            str(ROUTED_CALLS),
        )
    res.data["scenarios"]["eager"] = out


def _graph_batch(ctx, model, T, seed):
    return batch_to(ctx.harness.make_batch(model, T, "decode", seed=seed), ctx.device)


def capture_graph(ctx, model, batch, pool):
    import torch

    ids, positions, fb = batch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            model.forward(ids, positions, fb)
    torch.cuda.current_stream().wait_stream(side)
    records = ctx.harness.text_lm(model).logits_processor.records
    records.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, pool=pool):
        model.forward(ids, positions, fb)
    # What the graph hands SGLang's LogitsProcessor and what that returns on every
    # replay (a LogitsCall), as recorded when its Python ran once, at capture.
    assert len(records) == 1, f"{len(records)} LogitsProcessor calls in one captured forward"
    out = records[-1]
    records.clear()
    if _FAKE_MODE is not None:  # CPU dry run: replay = the same forward, eagerly

        def replay():
            with torch.no_grad():
                model.forward(ids, positions, fb)
            new = records.pop()
            out.hidden_states.copy_(new.hidden_states)
            drafted = ctx.harness.draft_input(out)
            if drafted is not None:
                drafted.copy_(ctx.harness.draft_input(new))

        graph._replay = replay
    return graph, out


def scenario_graphs(ctx, res: Results):
    """(b) the drop-in inside CUDA graphs: several batch sizes, one aux buffer."""
    import torch

    h, st = ctx.harness, ctx.state
    H = ctx.args.hidden
    pool = torch.cuda.graph_pool_handle()
    graphs = {}
    out = {"sizes": list(GRAPH_SIZES), "replays": []}
    for T in sorted(GRAPH_SIZES, reverse=True):
        batch = _graph_batch(ctx, ctx.ours, T, seed=500 + T)
        try:
            graph, gout = capture_graph(ctx, ctx.ours, batch, pool)
        except Exception as e:  # noqa: BLE001 - the other sizes still run
            res.error(f"graphs_capture_T{T}", e)
            continue
        graphs[T] = (graph, batch, gout)
    if not graphs:
        raise RuntimeError("no CUDA graph could be captured")
    if _FAKE_MODE is None:
        res.check(
            "graphs: state.graph_captured after capture",
            st.graph_captured is True,
            str(st.graph_captured),
        )
    else:
        print(
            "  [SKIP] graphs: state.graph_captured (CPU dry run: no real capture; replays "
            "re-run the forward eagerly)",
            flush=True,
        )
    aux_ptr = st.buffer.aux.data_ptr()
    res.check(
        "graphs: what every graph's LogitsProcessor hands the draft is a view of the "
        "one persistent buffer",
        all(h.draft_input(g[2]).data_ptr() == aux_ptr for g in graphs.values()),
        "rows [0, T) of the same buffer",
    )
    g = torch.Generator().manual_seed(11)
    vocab = h.text_lm(ctx.ours).config.vocab_size
    for rep in range(2):
        for T in sorted(graphs):
            graph, (ids, positions, fb), gcall = graphs[T]
            gfinal, gaux = gcall.hidden_states, h.draft_input(gcall)
            new_ids = torch.randint(0, vocab, (T,), generator=g)
            ids.copy_(new_ids.to(ctx.device))
            graph.replay()
            torch.cuda.synchronize()
            r_final, r_aux = gfinal.clone(), gaux.clone()
            e_final, e_aux = eager(
                h, ctx.ours, batch_to(h.make_batch(ctx.ours, T, "decode"), ctx.device, new_ids)
            )
            s_final, s_aux = eager(
                h, ctx.ref, batch_to(h.make_batch(ctx.ref, T, "decode"), ctx.device, new_ids)
            )
            vs_eager = deviation(r_aux, e_aux)
            final_vs_eager = deviation(r_final, e_final)
            layers = per_layer(r_aux, s_aux, H)
            out["replays"].append(
                {
                    "T": T,
                    "rep": rep,
                    "vs_dropin_eager": vs_eager,
                    "final_vs_dropin_eager": final_vs_eager,
                    "vs_sglang_eager": layers,
                }
            )
            res.check(
                f"graphs T={T} replay {rep}: capture and final hidden == eager drop-in "
                f"on the same inputs",
                vs_eager["equal"] and final_vs_eager["equal"],
                fmt_dev(vs_eager) + "; final " + fmt_dev(final_vs_eager),
            )
            check_layers(res, f"graphs T={T} replay {rep} vs SGLang's eager", layers)
    # After replays: an eager forward passes the completeness check.
    try:
        eager(h, ctx.ours, _graph_batch(ctx, ctx.ours, 7, seed=9))
        eager(h, ctx.ours, batch_to(h.make_batch(ctx.ours, 33, "extend", seed=9), ctx.device))
        res.check("graphs: eager forwards after replays pass the completeness check", True)
    except Exception as e:  # noqa: BLE001
        res.check(
            "graphs: eager forwards after replays pass the completeness check",
            False,
            f"{type(e).__name__}: {e}",
        )
    res.check(
        "graphs: still the drop-in (not switched back)"
        + (", graph_captured" if _FAKE_MODE is None else ""),
        not st.disabled and (st.graph_captured or _FAKE_MODE is not None),
        f"disabled={st.disabled}, graph_captured={st.graph_captured}",
    )
    ctx.graphs_ours = graphs
    res.data["scenarios"]["graphs"] = out


def scenario_one_kernel(ctx, res: Results):
    """(d) EAGLE_CAPTURE_FUSED_ALLREDUCE's paths at a captured layer on one GPU:
    the capturing norm's forward_with_allreduce_fusion (as SGLang's layer calls
    it at TP > 1) with the project's one kernel (a world-1 NCCL group: the
    kernel's Lamport protocol with one rank) for T <= 64 and the all-reduce +
    fused op above, against SGLang's own norm (FlashInfer's fused_add_rmsnorm)
    on the same rows: residual and capture bit-exact, normed within 2 ulp;
    then the one-kernel call inside a CUDA graph, replayed on new rows."""
    import torch
    import torch.distributed as dist

    from eagle_capture.integrations.sglang.allreduce import CapturedLayerAllReduce
    from eagle_capture.parallel.paths import PathTable
    from eagle_capture.parallel.symm import SymmAllReduceCapture

    dev, dtype, H = ctx.device, ctx.dtype, ctx.args.hidden
    lm = ctx.harness.text_lm
    st = ctx.state
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.new_group([0], backend="nccl")
    table = PathTable({"1": [[64, "one_shot"], [4096, "nccl"]]})
    one_shot = SymmAllReduceCapture(
        64, H, dtype, group=group, device=st.buffer.aux.device, table=table
    )
    reducer = CapturedLayerAllReduce(1, lambda t: t, one_shot, table, dtype, H)
    layer = CAPTURED_LAYERS[1]
    norm = lm(ctx.ours).model.layers[layer].input_layernorm
    ref_norm = lm(ctx.ref).model.layers[layer].input_layernorm
    slot = st.buffer.slot_of(layer)
    saved = st.allreduce
    st.allreduce = reducer
    out = {"layer": layer, "cases": []}
    g = torch.Generator(device="cpu").manual_seed(17)

    def rows(T):
        return (
            torch.randn(T, H, generator=g).to(dev, dtype),
            torch.randn(T, H, generator=g).to(dev, dtype),
        )

    def compare(tag, T, x_out, r_out, x, r):
        rx, rr = ref_norm.forward(x.clone(), r.clone())
        sync(dev)
        case = {
            "T": T,
            "case": tag,
            "residual": deviation(r_out, rr),
            "capture": deviation(st.buffer.aux[:T, slot], rr),
            "normed": deviation(x_out, rx),
        }
        out["cases"].append(case)
        res.check(
            f"one kernel {tag} T={T}: residual and capture bit-exact with SGLang's norm",
            case["residual"]["equal"] and case["capture"]["equal"],
            fmt_dev(case["capture"]),
        )
        res.check(
            f"one kernel {tag} T={T}: normed within 2 ulp of SGLang's norm",
            case["normed"]["max_ulp"] <= 2,
            fmt_dev(case["normed"]),
        )

    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # as serving runs (the model's weights require grad)
    try:
        for T in (1, 7, 64, 100, 1024):
            x, r = rows(T)
            st.buffer.aux[:T, slot].fill_(float("nan"))
            before = dict(reducer.calls)
            xo, ro = norm.forward_with_allreduce_fusion(
                x.clone(), r.clone(), use_attn_tp_group=False
            )
            want = "one_shot" if T <= 64 else "nccl"
            res.check(
                f"one kernel T={T}: path {want}",
                reducer.calls[want] == before.get(want, 0) + 1,
                str(dict(reducer.calls)),
            )
            compare("eager", T, xo, ro, x, r)
        # Inside a CUDA graph: static rows, replayed on new values.
        T = 8
        xs, rs = rows(T)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                norm.forward_with_allreduce_fusion(xs.clone(), rs.clone(), use_attn_tp_group=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gx, gr = norm.forward_with_allreduce_fusion(xs, rs, use_attn_tp_group=False)
        for rep in range(3):
            x, r = rows(T)
            xs.copy_(x)
            rs.copy_(r)
            graph.replay()
            compare(f"graph replay {rep}", T, gx, gr, x, r)
        out["calls"] = dict(reducer.calls)
    finally:
        torch.set_grad_enabled(grad)
        st.allreduce = saved
        st.stored_rows = {}  # these calls were not a forward
        st.residual_in_slot = None
    res.data["scenarios"]["one_kernel"] = out


def _replay_us(graph, n):
    import torch

    for _ in range(5):
        graph.replay()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        start[i].record()
        graph.replay()
        end[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(start, end)]


def scenario_timing(ctx, res: Results):
    """(c) GPU us per forward from graph replay: no capture / SGLang's / drop-in
    (path f, the default) / drop-in path e."""
    import torch

    h = ctx.harness
    out = {
        "replays": ctx.args.replays,
        "method": "median of per-replay CUDA-event times; rounds alternate the four graphs",
        "standins": {},
    }
    ctx.graphs_ours = None  # (b)'s graphs: their memory back
    torch.cuda.empty_cache()
    for standin in ("matmul", "elementwise"):
        if time.time() - ctx.t0 > ctx.args.deadline_s:
            out["standins"][standin] = "skipped: deadline"
            continue
        if standin == "elementwise":
            for model in (ctx.ref, ctx.ours):
                ffn = FFN_ATTR.get(ctx.args.family, "mlp")
                for layer in h.text_lm(model).model.layers:
                    layer.self_attn = LightStandIn.make(layer.self_attn)
                    setattr(layer, ffn, LightStandIn.make(getattr(layer, ffn)))
        rows = []
        # The elementwise stand-ins leave the norms and the capture dominant: also
        # T = 4096 there, when the buffer has the rows (--max-tokens 4096).
        sizes = TIMING_SIZES + tuple(
            T
            for T in ELEMENTWISE_EXTRA_SIZES
            if standin == "elementwise" and T <= ctx.args.max_tokens
        )
        for T in sizes:
            if time.time() - ctx.t0 > ctx.args.deadline_s:
                rows.append({"T": T, "skipped": "deadline"})
                continue
            try:
                row = _time_row(ctx, standin, T)
            except Exception as e:  # noqa: BLE001 - the other rows still run
                res.error(f"timing_{standin}_T{T}", e)
                row = {"T": T, "skipped": f"error: {type(e).__name__}: {e}"}
            rows.append(row)
        out["standins"][standin] = rows
    res.data["scenarios"]["timing"] = out
    res.check(
        "timing: measured",
        any(
            isinstance(v, list) and any("skipped" not in r for r in v)
            for v in out["standins"].values()
        ),
    )


def _time_row(ctx, standin, T):
    """One timing row: graphs of the three captures at T, replays interleaved."""
    import torch

    h = ctx.harness
    pool = torch.cuda.graph_pool_handle()
    lm_ref = h.text_lm(ctx.ref)
    # no capture: the reference model with SGLang's capture switched off (by its
    # family's adapter: Qwen-MoE's per-layer marks too) while its graph is
    # captured (Python decides at capture time).
    from eagle_capture.integrations.sglang.families import family_of

    family = family_of(ctx.ref)
    saved = family.engine_layers(lm_ref)
    family.engine_capture_off(lm_ref)
    try:
        g_none, _ = capture_graph(ctx, ctx.ref, _graph_batch(ctx, ctx.ref, T, 1), pool)
    finally:
        family.engine_capture_on(lm_ref, saved)
    g_ref, _ = capture_graph(ctx, ctx.ref, _graph_batch(ctx, ctx.ref, T, 1), pool)
    g_ours, _ = capture_graph(ctx, ctx.ours, _graph_batch(ctx, ctx.ours, T, 1), pool)
    # path e: the drop-in with the residual updated in place and copied into the
    # slot (its norms decide at capture time, like SGLang's capture switch above)
    st = ctx.state
    st.residual_in_slot_enabled = False
    try:
        g_ours_e, _ = capture_graph(ctx, ctx.ours, _graph_batch(ctx, ctx.ours, T, 1), pool)
    finally:
        st.residual_in_slot_enabled = True
    times = {"none": [], "sglang": [], "dropin": [], "dropin_e": []}
    rounds = 5
    per = max(10, ctx.args.replays // rounds)
    for _ in range(rounds):
        for name, graph in (
            ("none", g_none),
            ("sglang", g_ref),
            ("dropin", g_ours),
            ("dropin_e", g_ours_e),
        ):
            times[name] += _replay_us(graph, per)
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {
        "T": T,
        "n_each": len(times["none"]),
        "none_us": round(med["none"], 2),
        "sglang_us": round(med["sglang"], 2),
        "dropin_us": round(med["dropin"], 2),
        "dropin_path_e_us": round(med["dropin_e"], 2),
        "sglang_capture_cost_us": round(med["sglang"] - med["none"], 2),
        "dropin_capture_cost_us": round(med["dropin"] - med["none"], 2),
        "dropin_path_e_capture_cost_us": round(med["dropin_e"] - med["none"], 2),
        "dropin_minus_sglang_us": round(med["dropin"] - med["sglang"], 2),
    }
    print(
        f"  timing {standin:11s} T={T:5d}: none {row['none_us']:9.2f} us, SGLang "
        f"{row['sglang_us']:9.2f} us, drop-in f {row['dropin_us']:9.2f} us, e "
        f"{row['dropin_path_e_us']:9.2f} us (f - SGLang "
        f"{row['dropin_minus_sglang_us']:+.2f} us)",
        flush=True,
    )
    del g_none, g_ref, g_ours, g_ours_e
    return row


# --------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--no-fake-cuda",
        dest="fake_cuda",
        action="store_false",
        help="--device cpu: keep SGLang on its CPU paths (forward_native)",
    )
    ap.add_argument(
        "--norm-impl",
        default=None,
        choices=("flashinfer", "torch"),
        help="what SGLang's sgl_kernel norms are routed to (default: flashinfer "
        "on cuda, torch on cpu)",
    )
    ap.add_argument(
        "--family",
        default=DEEPSEEK,
        choices=(DEEPSEEK,) + tuple(FAMILY_NAMES),
        help="the SGLang model family to build (default: DeepSeek-V3)",
    )
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=1024, help="EAGLE_CAPTURE_MAX_TOKENS")
    ap.add_argument("--verify", type=int, default=3, help="EAGLE_CAPTURE_VERIFY")
    ap.add_argument(
        "--tokens", default=None, help="eager cases, e.g. '1024e,64d,5e' (e extend, d decode)"
    )
    ap.add_argument("--replays", type=int, default=100, help="timed replays per graph")
    ap.add_argument("--skip", default="", help="comma list of scenarios to skip")
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=240.0,
        help="skip the remaining timing rows after this many seconds",
    )
    ap.add_argument("--out", default=None, help="JSON file (default $OUT/gpu_sglang_real.json)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        args.fake_cuda = False
    if args.norm_impl is None:
        args.norm_impl = "flashinfer" if args.device == "cuda" else "torch"
    if args.norm_impl == "flashinfer" and args.device != "cuda":
        ap.error("--norm-impl flashinfer needs --device cuda")
    if args.tokens:
        args.eager_cases = tuple(
            (int(t[:-1]), {"e": "extend", "d": "decode"}[t[-1]]) for t in args.tokens.split(",")
        )
    else:
        args.eager_cases = EAGER_CASES
    args.skip = {s for s in args.skip.split(",") if s}
    if args.out is None:
        args.out = os.path.join(os.environ.get("OUT", "benchmarks/out"), "gpu_sglang_real.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    res = Results()
    res.data["args"] = {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()}
    t0 = time.time()
    print(
        f"gpu_scenarios: SGLang's real {ARCH if args.family == DEEPSEEK else args.family} "
        f"model, H={args.hidden}, "
        f"{args.layers} layers, {args.dtype}, device {args.device}"
        f"{' (fake CUDA for SGLang)' if args.fake_cuda and args.device == 'cpu' else ''}",
        flush=True,
    )
    os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    if args.device == "cuda" or args.fake_cuda:
        # harness.py defaults it to false at import; FlashInfer is installed here.
        os.environ.setdefault("SGLANG_IS_FLASHINFER_AVAILABLE", "true")
    try:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch sees no GPU")
        if args.device == "cpu" and args.fake_cuda:
            install_fake_cuda()
        route_sgl_kernel_norms(use_flashinfer=args.norm_impl == "flashinfer")
        print(
            f"gpu_scenarios: SGLang's fused_add_rmsnorm / rmsnorm -> {ROUTED_TO['impl']}",
            flush=True,
        )
        ctx = setup(args, res)
        print("gpu_scenarios: versions " + json.dumps(res.data["env"]), flush=True)
    except Exception as e:  # noqa: BLE001
        res.error("setup", e)
        _write(args, res, t0)
        return 3
    steps = [
        ("flashinfer", scenario_flashinfer),
        ("models", make_models),
        ("eager", scenario_eager),
    ]
    if args.device == "cuda" or args.fake_cuda:
        # CPU dry run: fake graphs (replay = an eager forward), timings of 0.
        steps += [("graphs", scenario_graphs), ("timing", scenario_timing)]
    if args.device == "cuda":
        steps += [("one_kernel", scenario_one_kernel)]
    else:
        res.data["scenarios"]["graphs"] = res.data["scenarios"]["timing"] = "skipped on cpu"
    have_models = False
    for name, fn in steps:
        if name in args.skip or (
            name in ("eager", "graphs", "timing", "one_kernel") and not have_models
        ):
            res.data["scenarios"].setdefault(name, "skipped")
            print(f"== {name}: skipped", flush=True)
            continue
        print(f"== {name} ({time.time() - t0:.0f} s)", flush=True)
        try:
            fn(ctx, res)
            have_models = have_models or name == "models"
        except Exception as e:  # noqa: BLE001
            res.error(name, e)
            if name == "models":
                _write(args, res, t0)
                return 3
    _write(args, res, t0)
    summary(res)
    return 1 if res.failed else 0


def _write(args, res: Results, t0: float) -> None:
    res.data["wall_s"] = round(time.time() - t0, 1)
    res.data["ok"] = res.failed == 0
    res.data["n_checks"] = len(res.data["checks"])
    res.data["n_failed"] = res.failed
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res.data, f, indent=1, default=str)
    print(f"gpu_scenarios: wrote {args.out}", flush=True)


def summary(res: Results) -> None:
    d = res.data
    env = d.get("env", {})
    print("\n================ gpu_scenarios summary ================")
    print(
        f"device {env.get('device')} {env.get('gpu', '')}; torch {env.get('torch')}, "
        f"sglang {env.get('sglang')}, transformers {env.get('transformers')}, flashinfer "
        f"{env.get('flashinfer-python')}; SGLang's norm -> {env.get('norm_route')}"
    )
    fi = d["scenarios"].get("flashinfer")
    if isinstance(fi, dict):
        if "jit_build_or_load_s" in fi:
            print(
                f"FlashInfer norm module ({'prebuilt AOT' if fi.get('norm_module_is_prebuilt_aot') else 'JIT'}"
                f", {fi.get('norm_module')}): loaded in {fi['jit_build_or_load_s']} s"
            )
        for c in fi.get("cases", []):
            print(
                f"  T={c['T']:5d} ours vs FlashInfer: capture "
                f"{fmt_dev(c['ours_capture_vs_flashinfer_residual'])}; normed "
                f"{fmt_dev(c['ours_normed_vs_flashinfer'])}"
            )
    ea = d["scenarios"].get("eager")
    if isinstance(ea, dict):
        print(f"eager (a), install: {d.get('install', {}).get('how')}")
        for c in ea["cases"]:
            print(
                f"  T={c['T']:5d} {c['mode']:6s} "
                + " | ".join(f"L{x['layer']}: {fmt_dev(x)}" for x in c["layers"])
            )
        for line in ea.get("verify_log", []):
            print(f"  {line[:200]}")
    gr = d["scenarios"].get("graphs")
    if isinstance(gr, dict):
        ok = all(r["vs_dropin_eager"]["equal"] for r in gr["replays"])
        print(
            f"graphs (b): {len(gr['replays'])} replays of T={gr['sizes']}: "
            f"{'all bit-exact vs eager drop-in' if ok else 'NOT all equal to eager'}"
        )
        for r in gr["replays"]:
            if r["rep"] == 0:
                print(
                    f"  T={r['T']:3d} vs SGLang eager: "
                    + " | ".join(f"L{x['layer']}: {fmt_dev(x)}" for x in r["vs_sglang_eager"])
                )
    ti = d["scenarios"].get("timing")
    if isinstance(ti, dict):
        print("timing (c), us per forward (graph replay, median):")
        for standin, rows in ti["standins"].items():
            if not isinstance(rows, list):
                print(f"  {standin}: {rows}")
                continue
            for r in rows:
                if "skipped" in r:
                    print(f"  {standin:11s} T={r['T']}: skipped ({r['skipped']})")
                    continue
                print(
                    f"  {standin:11s} T={r['T']:5d}: none {r['none_us']:9.2f}  SGLang "
                    f"{r['sglang_us']:9.2f} (+{r['sglang_capture_cost_us']:.2f})  drop-in "
                    f"{r['dropin_us']:9.2f} (+{r['dropin_capture_cost_us']:.2f})"
                )
    failed = [c for c in d["checks"] if not c["ok"]]
    print(f"{len(d['checks']) - len(failed)} passed, {len(failed)} failed ({d.get('wall_s')} s)")
    for c in failed:
        print(f"  FAILED: {c['name']}: {c['detail'][:300]}")


if __name__ == "__main__":
    sys.exit(main())
