"""The probe's target served by SGLang's engine (``eagle-capture probe --engine sglang``).

SGLang's own ``Engine`` loads the target as it serves it -- the user's tensor-parallel
size, dtype and quantisation (``--engine-arg``, SGLang's server arguments) -- with the
probe's hooks given through SGLang's ``forward_hooks`` server argument
(:mod:`eagle_capture.integrations.sglang.probe_hooks`: imported in every TP rank's
process; no SGLang code changed, no draft served). Per prompt the probe asks SGLang
for one greedy token with the prompt's logprobs (``logprob_start_len=0``,
``top_logprobs_num=1``): SGLang's own logits give the target's greedy token at every
position; each rank writes the forward's states to the side channel, a directory
(``/dev/shm`` when there is one), which this process reads, checks across ranks
(:func:`~eagle_capture.probe.engine.check_ranks`, as with vLLM) and deletes.

The settings the capture needs are set here and stated (:data:`SET_ARGS`); a line that
cannot meet them is refused before the engine starts (:func:`line_problem`).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from eagle_capture.probe.engine import check_ranks
from eagle_capture.probe.runners import EngineError, EngineRunner, Log, Setup

__all__ = [
    "FIRST",
    "FIXED_ARGS",
    "SGLANG_DTYPES",
    "SglangTarget",
    "check_sglang",
    "collect",
    "engine_kwargs",
    "fixed_arg",
    "installed_version",
    "line_problem",
    "read_answers",
]

# The first line whose forward_hooks, server arguments and norm calls were read.
FIRST = (0, 5, 9)
SGLANG_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# Targets 0.5.9 turns the FlashInfer all-reduce + RMSNorm fusion on for, on sm90 / sm100
# GPUs, with no switch to turn it off (server_args.py, _handle_model_specific_adjustments;
# enforce_disable_flashinfer_allreduce_fusion arrives in 0.5.13).
FUSION_ARCHS_0_5_9 = (
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
    "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "Qwen3MoeForCausalLM",
    "KimiK25ForConditionalGeneration",
)
# Seconds to wait for every rank's record of a prompt after SGLang answered it (the
# ranks finish their forward together; rank r > 0 may write its record a little later).
RECORD_WAIT_S = 120.0

# Server arguments the probe sets itself, and why (stated in the plan, refused as
# --engine-arg): the hooks run in eager PyTorch on every row of every prompt, on one
# replica and one pipeline stage, where the norms are called as modules.
FIXED_ARGS = {
    "model_path": "--target",
    "tp_size": "--tp",
    "dtype": "--dtype",
    "forward_hooks": "the probe's capture",
    "disable_cuda_graph": "a CUDA graph replay skips the hooks",
    "enable_torch_compile": "the hooks run in eager mode only",
    "disable_radix_cache": "every prompt's rows must be computed (a cached prefix is not)",
    "chunked_prefill_size": "one forward per prompt",
    "dp_size": "the probe runs one replica",
    "enable_dp_attention": "every rank must hold every row",
    "pp_size": "the probe hooks one pipeline stage",
    "enable_flashinfer_allreduce_fusion": "the fused norm is not called as a module: "
    "its input would not be seen",
    "enforce_disable_flashinfer_allreduce_fusion": "the fused norm is not called as a module",
    "skip_tokenizer_init": "the probe sends token ids",
    "max_running_requests": "one prompt at a time",
}


def fixed_arg(key: str) -> Optional[str]:
    """Why ``key`` may not be passed (set by the probe), or None."""
    if key in FIXED_ARGS:
        return FIXED_ARGS[key]
    if (
        key.startswith("cuda_graph")
        or "piecewise_cuda_graph" in key
        or key.endswith("prefill_cuda_graph")
        or key.endswith("decode_cuda_graph")
    ):
        return "a CUDA graph replay skips the hooks"
    return None


def _parse(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) or "0"
        out.append(int(digits))
    return tuple(out + [0] * (3 - len(out)))


def installed_version() -> str:
    """The SGLang in this Python (found, not imported: its import takes seconds)."""
    if importlib.util.find_spec("sglang") is None:
        raise EngineError(
            "--engine sglang: SGLang is not installed in this Python; run the "
            "probe where the target is served, or leave out --engine to run "
            "the target with transformers"
        )
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise EngineError(
            "--engine sglang: an sglang package is importable here but has no "
            "installed metadata (no version to read); install it with pip"
        ) from None


def line_problem(
    version: str, architecture: str, tp: int, capability: Optional[tuple[int, int]] = None
) -> Optional[str]:
    """Why the probe cannot drive SGLang ``version`` for this target at ``tp``, or None.
    ``capability``: the GPU's compute capability (None: no CUDA device here)."""
    if _parse(version) < FIRST:
        return (
            f"SGLang {version} is older than 0.5.9, the first line the probe drives "
            f"(its forward_hooks server argument and norm calls were read from 0.5.9 on)"
        )
    if (
        _parse(version) < (0, 5, 13)
        and tp > 1
        and architecture in FUSION_ARCHS_0_5_9
        and (capability is None or capability[0] in (9, 10))
    ):
        return (
            f"SGLang {version} turns the FlashInfer all-reduce + RMSNorm fusion on for "
            f"{architecture} on sm90 / sm100 GPUs (H100, H200, B200) with no argument to "
            f"turn it off (enforce_disable_flashinfer_allreduce_fusion arrives in 0.5.13); "
            f"at tensor parallel {tp} the fused norm leaves each layer's input unseen by "
            f"any hook. Probe with SGLang 0.5.13 or newer (the draft's ids do not depend "
            f"on the SGLang version the probe runs), or with --engine transformers"
        )
    return None


def check_sglang(asked: Optional[str], architecture: str, tp: int) -> str:
    """The installed SGLang's version, when the probe can drive it for this target at
    ``tp`` (:func:`line_problem`); an ``asked`` --sglang-version must be it (the line
    shown is the installed one's)."""
    version = installed_version()
    if asked is not None and asked != version:
        raise EngineError(
            f"--sglang-version {asked}: --engine sglang runs and reports the "
            f"installed SGLang, {version}; leave out --sglang-version, or leave "
            f"out --engine to see another version's line"
        )
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    problem = line_problem(version, architecture, tp, capability)
    if problem:
        raise EngineError(f"--engine sglang: {problem}")
    return version


def engine_kwargs(
    version: str,
    folder: Path,
    tp: int,
    dtype: str,
    max_tokens: int,
    hooks: list,
    engine_args: Optional[dict] = None,
) -> dict:
    """SGLang ``Engine(...)`` arguments: the probe's settings for ``version``, then the
    user's (which never name a fixed one: refused before)."""
    v = _parse(version)
    kwargs = dict(
        model_path=str(folder),
        tp_size=tp,
        dtype=SGLANG_DTYPES[dtype],
        forward_hooks=hooks,
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        enable_torch_compile=False,
        disable_radix_cache=True,
        chunked_prefill_size=-1,
        max_prefill_tokens=max(max_tokens + 1, 16384),
        dp_size=1,
        enable_dp_attention=False,
        pp_size=1,
        max_running_requests=1,
        # One prompt at a time needs little KV cache: a bound on the pool
        # instead of most of each device, which leaves room for the draft.
        max_total_tokens=max_tokens + 1024,
        enable_flashinfer_allreduce_fusion=False,
        log_level="warning",
    )
    if v >= (0, 5, 13):
        kwargs["enforce_disable_flashinfer_allreduce_fusion"] = True
    if (0, 5, 13) <= v < (0, 5, 18):
        # 0.5.18+ fold piecewise graphs into cuda_graph_config, which disable_cuda_graph
        # turns off for both phases (server_args.py 0.5.18, arg_groups/cuda_graph_hook.py).
        kwargs["disable_piecewise_cuda_graph"] = True
    elif v < (0, 5, 13):
        kwargs["enable_piecewise_cuda_graph"] = False
    kwargs.update(engine_args or {})
    return kwargs


def stated_settings(version: str) -> str:
    """The settings in words, for the plan the probe prints."""
    fusion = (
        "FlashInfer all-reduce fusion off (enforce_disable_flashinfer_allreduce_fusion)"
        if _parse(version) >= (0, 5, 13)
        else "FlashInfer all-reduce fusion not enabled"
    )
    return (
        f"CUDA graphs off, torch.compile off, radix cache off, chunked prefill off, "
        f"{fusion}, DP 1, PP 1, one request at a time"
    )


def read_answers(
    directory: str, tp: int, tokens: Sequence[int], consumed: dict, timeout: float = RECORD_WAIT_S
) -> list[dict]:
    """Every rank's records of the forward of ``tokens`` since the last call (waits for
    it), merged per rank: {rank, rows, width, digest, states and embeds from rank 0,
    errors, others}. A record of other input ids is a forward SGLang ran of its own
    (0.5.9 - 0.5.20: a one-token forward before the first prompt and one after each
    prompt; 0.5.23: none): skipped, counted in ``others``. The first forward of the prompt's ids is
    its answer (one request at a time, no chunked prefill, no radix cache: one forward per
    prompt); a layer whose hook ran more or less than once in it shows in its rows.
    ``consumed``: rank -> the last sequence number read (updated); the files read are
    deleted."""
    want = torch.as_tensor(list(tokens), dtype=torch.int64)
    deadline = time.monotonic() + timeout
    answers = []
    for rank in range(tp):
        records, others, done = [], 0, False
        while not done:
            paths = sorted(glob.glob(os.path.join(directory, f"{rank}.*.pt")))
            for path in paths:
                seq = int(path.rsplit(".", 2)[1])
                if seq <= consumed.get(rank, 0):
                    continue
                rec = torch.load(path, weights_only=False)
                os.unlink(path)
                consumed[rank] = seq
                ids = rec.get("input_ids")
                if ids is None or ids.shape != want.shape or not torch.equal(ids, want):
                    others += 1
                    continue
                records.append(rec)
                # One forward per prompt (no chunked prefill): the answer is complete;
                # a second forward of the same ids is read with the next prompt's.
                done = True
                break
            if not done:
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"SGLang's rank {rank} wrote no capture of the prompt's forward in "
                        f"{timeout:.0f} s ({others} other forwards seen): the hooks on "
                        f"the embedding and the final norm did not run (a model whose text "
                        f"layers are not under 'model.', or a path that does not call them)"
                    )
                time.sleep(0.01)
        answers.append(dict(_merge(records), others=others))
    return answers


def _merge(records: list[dict]) -> dict:
    """One rank's records (the forwards since the last prompt: its own, and any other,
    which the row counts then show) as one answer."""
    last = records[-1]
    out = {
        "rank": last["rank"],
        "errors": [e for r in records for e in r["errors"]],
        "device": last.get("device", "?"),
        "rows": {},
        "width": {},
        "digest": {},
    }
    for c in last["rows"]:
        out["rows"][c] = sum(r["rows"].get(c, 0) for r in records)
        parts = [r["digest"][c] for r in records if c in r["digest"]]
        if parts:
            out["digest"][c] = torch.cat(parts)
            out["width"][c] = max(r["width"][c] for r in records if c in r["width"])
        else:
            out["digest"][c] = torch.empty(0, 8, dtype=torch.float64)
            out["width"][c] = 0
    if "states" in last:
        out["states"] = {
            c: torch.cat([r["states"][c] for r in records if c in r["states"]])
            for c in last["rows"]
            if any(c in r["states"] for r in records)
        }
        out["embeds"] = last.get("embeds")
    return out


def collect(
    directory: str,
    tp: int,
    tokens: Sequence[int],
    hidden_size: int,
    consumed: dict,
    timeout: float = RECORD_WAIT_S,
):
    """The ranks' captures of the prompt ``tokens``, checked: (every rank's answer, rank
    0's first, the largest relative difference between ranks). Raises :class:`EngineError` for a
    capture the probe does not score (missing rows, a shard, partial sums)."""
    answers = read_answers(directory, tp, tokens, consumed, timeout)
    for a in answers:
        if a["errors"]:
            raise EngineError(f"SGLang's rank {a['rank']}: {a['errors'][0]}")
    n = len(tokens)
    for c in sorted(answers[0]["rows"]):
        if all(a["rows"][c] == 0 for a in answers):
            raise EngineError(
                f"no rank captured capture layer {c}: its hook (on the norm that reads the "
                f"stream there) never ran -- a norm called through a fused path, not as a "
                f"module; the probe does not score it"
            )
    worst = check_ranks(answers, hidden_size, n)
    return answers, worst


def _side_channel() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="eagle-probe-", dir=base)


class SglangTarget(EngineRunner):
    """The target in SGLang's engine: :meth:`run` gives, for one prompt, the states at
    the capture layers ``keep`` ({c: [1, T, H]}), the greedy next token at each
    position [1, T] and the tokens' embeddings [1, T, H] (rank 0's). ``extra_hooks``:
    more ``forward_hooks`` specs, registered after the probe's."""

    engine_name = "sglang"
    words = "SGLang"
    answers_for = ("sglang",)
    holds = (
        "and copies them to the host; rank 0's pass through a side channel in "
        "/dev/shm (or the temporary directory) to this process"
    )

    @classmethod
    def check_installed(cls, architecture: str, tp: int, sglang_version: Optional[str]) -> str:
        return check_sglang(sglang_version, architecture, tp)

    @classmethod
    def option_problem(cls, dtype: str, engine_args: dict) -> Optional[str]:
        # SGLang picks its kernels from the host, not from its device argument: wherever a
        # GPU is visible its RMSNorm is sgl_kernel's (its CPU engine runs only without one).
        if dtype == "fp32" and torch.cuda.is_available():
            return (
                "--dtype fp32 with --engine sglang on a machine with a GPU: SGLang runs the "
                "target's RMSNorm in sgl_kernel wherever a GPU is visible, which takes fp16 "
                "and bf16 only (float32 stops the engine at its first forward); use --dtype "
                "bf16, fp16 or auto, or leave out --engine for an fp32 probe in transformers"
            )
        return None

    @classmethod
    def cache(cls, setup: Setup) -> str:
        return f"a KV cache pool of {setup.max_tokens + 1024} tokens (max_total_tokens)"

    @classmethod
    def plan(cls, setup: Setup, log: Log) -> None:
        super().plan(setup, log)
        log(
            f"probe: SGLang {setup.sglang_version} runs with the settings the capture needs: "
            f"{stated_settings(setup.sglang_version)}; the first prompt includes the engine's "
            f"warm-up, the time for all prompts is estimated after the second"
        )

    @classmethod
    def options(cls, setup: Setup) -> dict:
        return {"version": setup.sglang_version}

    def measured(self, setup: Setup) -> dict:
        return dict(super().measured(setup), sglang_version=setup.sglang_version)

    def __init__(
        self,
        folder: Path,
        num_layers: int,
        hidden_size: int,
        keep: Sequence[int],
        tp: int = 1,
        dtype: str = "auto",
        max_tokens: int = 512,
        engine_args: Optional[dict] = None,
        version: Optional[str] = None,
        extra_hooks: Sequence[dict] = (),
    ) -> None:
        from eagle_capture.integrations.sglang.probe_hooks import specs

        problem = self.option_problem(dtype, engine_args or {})
        if problem:
            raise EngineError(problem)
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.keep = sorted(set(keep))
        self.tp = tp
        self.version = version or installed_version()
        self.reset_counts()
        self.dir = _side_channel()
        self._consumed: dict = {}
        self.engine = None
        kwargs = engine_kwargs(
            self.version,
            folder,
            tp,
            dtype,
            max_tokens,
            specs(self.dir, self.keep, num_layers) + list(extra_hooks),
            engine_args,
        )
        try:
            import sglang
            from sglang.srt.server_args import ServerArgs

            # The piecewise switch's name per line (0.5.14 - 0.5.17 not read): an argument
            # this SGLang does not have is left out (disable_cuda_graph covers it there).
            for key in ("disable_piecewise_cuda_graph", "enable_piecewise_cuda_graph"):
                if key in kwargs and not hasattr(ServerArgs, key):
                    del kwargs[key]
            self.engine = sglang.Engine(**kwargs)
        except Exception as exc:  # noqa: BLE001 - SGLang's start-up errors are all kinds
            self.close()
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise EngineError(
                f"SGLang could not serve the target {folder} (tensor parallel "
                f"{tp}, dtype {dtype}): {type(exc).__name__}: "
                f"{lines[0] if lines else ''}"
            ) from None
        self.ranks = self._hellos()

    def _hellos(self) -> list[dict]:
        import json

        ranks = []
        for rank in range(self.tp):
            path = os.path.join(self.dir, f"hello.{rank}.json")
            try:
                with open(path) as f:
                    ranks.append(json.load(f))
            except (OSError, ValueError):
                self.close()
                raise EngineError(
                    f"SGLang's rank {rank} did not load the probe's hooks (its "
                    f"forward_hooks argument): SGLang {self.version} ignored "
                    f"them"
                ) from None
        return ranks

    def reset_counts(self) -> None:
        """Start the counts a report quotes (a target serving several probe runs)."""
        self.worst_rank_difference = 0.0
        self.engine_disagreements = 0
        self.prompts = 0
        self.other_forwards = 0

    @property
    def device(self) -> str:
        return self.ranks[0].get("device", "?")

    @torch.no_grad()
    def run(self, tokens: list[int]):
        out = self.engine.generate(
            input_ids=list(tokens),
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=1,
        )
        self.answers, worst = collect(self.dir, self.tp, tokens, self.hidden_size, self._consumed)
        first = self.answers[0]
        self.other_forwards += first["others"]
        self.worst_rank_difference = max(self.worst_rank_difference, worst)
        meta = out["meta_info"]
        top = meta.get("input_top_logprobs") or []
        last = (meta.get("output_top_logprobs") or [[None]])[0]
        n = len(tokens)
        if len(top) != n or any(not t for t in top[1:]) or not last:
            raise EngineError(
                f"SGLang returned {len(top)} positions of prompt logprobs for a "
                f"prompt of {n} tokens: the target's greedy tokens are unknown"
            )
        # input_top_logprobs[t] is the top token SGLang predicts for position t (from
        # position t - 1); the last position's is the output's.
        greedy = [int(top[t][0][1]) for t in range(1, n)] + [int(last[0][1])]
        self.engine_disagreements += int(int(out["output_ids"][0]) != greedy[-1])
        self.prompts += 1
        states = {c: s.unsqueeze(0) for c, s in first["states"].items()}
        embeds = first["embeds"]
        if embeds is None or embeds.shape[0] != n:
            raise EngineError("SGLang's embedding hook saw another input than the prompt's")
        return states, torch.tensor([greedy]), embeds.unsqueeze(0)

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - the engine may already be down
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
