"""The doctor's deployment dimension: what tensor parallelism, SGLang's
all-reduce fusion, DP attention, pipeline stages, CUDA graphs and torch.compile
do to the rows the draft receives, per SGLang line, for SGLang's own capture and
for the fused drop-in.

Each verdict names what it rests on: the wheel's code (file and function, as
recorded in docs/engine_facts.md) and, where one runs that wheel, the test.
"read" means read in the wheels and not yet run with that deployment.
"""

import argparse
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .sglang_lines import SGLangLine, default_capture_layers

# Targets SGLang turns the FlashInfer all-reduce fusion on for by itself
# (server_args.py / arg_groups/overrides.py, every line read); DeepseekV2 is in none.
FUSION_AUTO_ARCHS = ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")
FUSE_MAX_TOKENS = 2048   # FUSE_ALLREDUCE_MAX_BATCH_SIZE, every line
TP_TESTS = "tests/test_sglang_real_tp.py (TP 2, gloo, this wheel's code)"
FUSION_TEST = ("tests/test_sglang_real_tp.py tp2_fusion (TP 2, gloo; the GPU gate and "
               "FlashInfer's kernel stood in, the rest this wheel's code)")


@dataclass(frozen=True)
class Deployment:
    tp: int = 1
    allreduce_fusion: str = "auto"     # on | off | auto
    gpu: str = "hopper"                # hopper | blackwell | other (for "auto")
    architecture: str = ""             # the target's, for "auto"
    dp_attention: bool = False
    pp: int = 1
    cuda_graph: bool = True
    torch_compile: bool = False

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
        where = ("server_args.py::_handle_model_specific_adjustments" if line.first < (0, 5, 18)
                 else "arg_groups/overrides.py::_flashinfer_allreduce_fusion_auto_enable")
        return on, (f"auto: {'on' if on else 'off'} for {arch}"
                    f"{'' if self.architecture else ' (assumed; --target-config names it)'} on "
                    f"{self.gpu} ({where})")


@dataclass
class Row:
    subject: str       # "SGLang's own capture" | "drop-in"
    status: str        # OK | PROBLEM | NOTE
    text: str
    basis: str


@dataclass
class LineReport:
    line: SGLangLine
    rows: list[Row] = field(default_factory=list)


@dataclass
class Report:
    deploy: Deployment
    lines: list[LineReport]

    @property
    def ok(self) -> bool:
        return all(r.status != "PROBLEM" for lr in self.lines for r in lr.rows
                   if r.subject == SGLANG)

    def format(self, width: int) -> list[str]:
        from .doctor import _wrap
        d = self.deploy
        out = [f"deployment: TP {d.tp}, all-reduce fusion {d.allreduce_fusion}, "
               f"{'DP attention, ' if d.dp_attention else ''}PP {d.pp}, CUDA graphs "
               f"{'on' if d.cuda_graph else 'off'}{', torch.compile' if d.torch_compile else ''}"
               f", {d.gpu} GPU"]
        for lr in self.lines:
            out.append(f"  SGLang {lr.line.name}:")
            for r in lr.rows:
                out.append(_wrap(f"{r.subject}: {r.status}: {r.text}. Basis: {r.basis}",
                                 "    ", "      "))
        return out


SGLANG, DROPIN = "SGLang's own capture", "drop-in"


def graphs_captured_before_ids(line: SGLangLine) -> bool:
    """0.5.9 - 0.5.12 capture the target's CUDA graphs before the draft's ids are
    set (``ModelRunner.initialize``), with the defaults its graph runner sets."""
    return line.first < (0, 5, 13)


def _last_stage_start(num_layers: int, pp: int) -> int:
    """First layer of the last pipeline stage (distributed/utils.py::get_pp_indices:
    the last ``num_layers % pp`` stages get one layer more)."""
    return num_layers - (num_layers // pp + (1 if num_layers % pp else 0))


def assess(deploy: Deployment, lines: Sequence[SGLangLine],
           captures: Sequence[list[int]], num_layers: int,
           trained: Optional[Sequence[int]]) -> Report:
    """Per line (with the capture layers that line sets for the draft's ids)."""
    report = Report(deploy, [])
    for line, capture in zip(lines, captures):
        lr = LineReport(line)
        report.lines.append(lr)
        rows = lr.rows
        old = line.first < (0, 5, 13)            # 0.5.9 - 0.5.12
        loop_capture = line.first < (0, 5, 18)   # hidden_states + residual in the model loop
        if deploy.architecture == "KimiK25ForConditionalGeneration" and old:
            rows.append(Row(SGLANG, "PROBLEM", "KimiK25ForConditionalGeneration has no "
                            "set_eagle3_layers_to_capture on this line: EAGLE-3 fails at start-up",
                            "read: models/kimi_k25.py"))
        # Tensor parallelism and the fused all-reduce.
        if deploy.tp > 1 and not deploy.dp_attention:   # (DP attention: its own rows below)
            fused, why = deploy.fusion_on(line)
            if not fused:
                rows.append(Row(SGLANG, "OK", f"TP {deploy.tp} without the fusion ({why}): the "
                                "captured residual is all-reduced, full width, identical on every "
                                "rank", f"run: {TP_TESTS}, tp2_equals_tp1"))
                rows.append(Row(DROPIN, "OK", "the same rows", f"run: {TP_TESTS}, plugin_tp2"))
            elif loop_capture:
                rows.append(Row(
                    SGLANG, "PROBLEM",
                    f"TP {deploy.tp} with the fusion ({why}): for forwards of <= "
                    f"{FUSE_MAX_TOKENS} tokens (decode, target verify, short prefills) layer i-1 "
                    f"leaves its MLP all-reduce to layer i's fused input norm, and the loop "
                    f"captures hidden_states + residual BEFORE layer i: per-rank partial sums, "
                    f"different on every rank. Larger prefills are reduced. Fix: "
                    + ("no flag turns the auto-enabled fusion off on this line; the drop-in "
                       "captures the reduced value" if old else
                       "--enforce-disable-flashinfer-allreduce-fusion, or the drop-in"),
                    f"read: models/deepseek_v2.py DeepseekV2Model.forward, "
                    f"DeepseekV2DecoderLayer.forward (should_allreduce_fusion); run: {FUSION_TEST}"
                    f" (SGLang's capture 12% - 19% off the TP 1 run, different per rank)"))
                rows.append(Row(DROPIN, "OK", "captures the fused norm's reduced residual_out "
                                "(never the partial input)", f"run: {FUSION_TEST}"))
            else:
                unreduced = line.first < (0, 5, 22)
                rows.append(Row(
                    SGLANG, "OK",
                    f"TP {deploy.tp} with the fusion ({why}): the capture takes the residual "
                    f"after the fused all-reduce + add + RMSNorm, reduced"
                    + ("; on 0.5.18 - 0.5.20, if FlashInfer's workspace cannot be set up in a "
                       "forward, the fallback runs the norm without the all-reduce for that "
                       "forward: hidden states and capture unreduced (0.5.22+ all-reduce first)"
                       if unreduced else ""),
                    f"read: layers/communicator.py prepare_attn_and_capture_last_layer_outputs, "
                    f"layer_boundary/stage.py _prepare_attention; run: {FUSION_TEST}"))
                rows.append(Row(DROPIN, "OK", "stores the fused norm's reduced residual_out; "
                                "contiguous inputs so FlashInfer does not decline",
                                f"run: {FUSION_TEST}"))
        # DP attention.
        if deploy.dp_attention:
            if old:
                rows.append(Row(SGLANG, "PROBLEM", "DP attention: with an all-to-all MoE the "
                                "loop all-gathers the capture over the whole TP group, so the "
                                "draft receives every DP rank's rows",
                                "read: models/deepseek_v2.py DeepseekV2Model.forward"))
            else:
                rows.append(Row(SGLANG, "OK", "DP attention: the captured residual is gathered "
                                "over the attention-TP group: the draft receives its own DP "
                                "rank's rows", "read: models/deepseek_v2.py / "
                                "layers/communicator.py / layer_boundary/stage.py input_move"))
            rows.append(Row(DROPIN, "NOTE", "not applicable under DP attention: the plugin "
                            "logs it and SGLang's own capture stays",
                            "run: tests/test_sglang_real.py refusals"))
        # Pipeline parallelism: the last stage captures.
        if deploy.pp > 1:
            start = _last_stage_start(num_layers, deploy.pp)
            outside = sorted(i for i in capture if i < start)
            if outside:
                how = ("the loop hands the draft fewer slots, no error" if loop_capture
                       else "the packer raises 'captured k of N' at the first forward")
                rows.append(Row(SGLANG, "PROBLEM", f"PP {deploy.pp}: only the last stage "
                                f"(layers {start} - {num_layers - 1}) captures; layers {outside} "
                                f"run on earlier stages and are never captured: {how}",
                                "read: DeepseekV2ForCausalLM.set_eagle3_layers_to_capture "
                                "(pp_group.is_last_rank), distributed/utils.py get_pp_indices"))
                rows.append(Row(DROPIN, "NOTE", f"refuses to start on the last stage (layers "
                                f"{outside} outside [{start}, {num_layers}))",
                                "run: tests/test_sglang_real.py refusals"))
            else:
                rows.append(Row(SGLANG, "OK", f"PP {deploy.pp}: every captured layer runs on "
                                f"the last stage (layers {start} - {num_layers - 1})",
                                "read: distributed/utils.py get_pp_indices"))
        # CUDA graphs (0.5.9: captured before the draft's ids are set).
        if deploy.cuda_graph:
            defaults = default_capture_layers(num_layers)
            if graphs_captured_before_ids(line) and sorted(capture) != sorted(defaults):
                rows.append(Row(
                    SGLANG, "PROBLEM",
                    f"CUDA graphs are captured before the draft's ids are set: decode / "
                    f"target-verify graphs replay the defaults {defaults} while eager prefill "
                    f"captures {capture}. Fix: --disable-cuda-graph, or ids that map to the "
                    f"defaults", "read: model_executor/model_runner.py ModelRunner.initialize "
                    "(init_device_graphs before set_eagle3_layers_to_capture), "
                    "cuda_graph_runner.py CudaGraphRunner.__init__; the call order checked: "
                    "tests/test_sglang_real.py graph_order"))
            elif not old:
                rows.append(Row(SGLANG, "OK", "the ids are set before any CUDA graph is "
                                "captured", "read: ModelRunner.initialize / "
                                "init_attention_backends before init_all_cuda_graphs; the call "
                                "order checked: tests/test_sglang_real.py graph_order"))
            if old:
                rows.append(Row(DROPIN, "NOTE", "no plugin system on this line: the manual "
                                "install runs after the graphs were captured; only with "
                                "--disable-cuda-graph", "read: model_runner.py"))
            else:
                rows.append(Row(DROPIN, "OK", "installed before the graphs; graphs of several "
                                "sizes share the one buffer",
                                "run: scripts/gpu_sglang_real.sh (0.5.23, H200)"
                                if line.last >= (0, 5, 23) else
                                "run: tests/test_sglang_real.py plugin scenarios (install "
                                "moment); graphs on the GPU run for 0.5.23 only"))
        if deploy.torch_compile:
            rows.append(Row(SGLANG, "OK", "the capture is traced with the layer loop",
                            "run: tests/test_sglang_real.py piecewise_compiled (reference)"))
            traced = line.last < (0, 5, 22)
            rows.append(Row(DROPIN, "OK" if traced else "NOTE",
                            "traced as the project's op, no graph break" if traced else
                            "not run: SGLang's own loop of 0.5.22+ does not trace with the CPU "
                            "torch of CI", "run: tests/test_sglang_real.py piecewise_compiled"
                            if traced else "not run"))
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment (any of these adds the deployment verdicts)")
    g.add_argument("--tp", type=int, help="tensor-parallel size (the seed's: 8)")
    g.add_argument("--allreduce-fusion", choices=("on", "off", "auto"),
                   help="SGLang's FlashInfer all-reduce + RMSNorm fusion (default auto: what the "
                        "line turns on by itself for the target and GPU)")
    g.add_argument("--gpu", choices=("hopper", "blackwell", "other"),
                   help="GPU generation, for --allreduce-fusion auto (default hopper: H100/H200)")
    g.add_argument("--dp-attention", action="store_true", help="--enable-dp-attention")
    g.add_argument("--pp", type=int, help="pipeline-parallel size")
    g.add_argument("--cuda-graph", choices=("on", "off"),
                   help="CUDA graphs (default on; off = --disable-cuda-graph)")
    g.add_argument("--torch-compile", action="store_true",
                   help="--enable-torch-compile / piecewise CUDA graphs")


def from_arguments(args: argparse.Namespace, architecture: str = "") -> Optional[Deployment]:
    given = [args.tp, args.allreduce_fusion, args.gpu, args.pp, args.cuda_graph]
    if all(v is None for v in given) and not args.dp_attention and not args.torch_compile:
        return None
    for name in ("tp", "pp"):
        value = getattr(args, name)
        if value is not None and value < 1:
            from .sglang_lines import CapturePlanError
            raise CapturePlanError(f"--{name} must be >= 1, got {value}")
    return Deployment(tp=args.tp or 1, allreduce_fusion=args.allreduce_fusion or "auto",
                      gpu=args.gpu or "hopper", architecture=architecture,
                      dp_attention=args.dp_attention, pp=args.pp or 1,
                      cuda_graph=(args.cuda_graph or "on") == "on",
                      torch_compile=args.torch_compile)
