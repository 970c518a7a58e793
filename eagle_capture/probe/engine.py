"""The probe's target served by vLLM's engine (``eagle-capture probe --engine vllm``).

vLLM's ``LLM(...)`` loads the target as it serves it -- the user's tensor-parallel
size, dtype and quantisation (vLLM reads the checkpoint's) -- with the worker
extension :class:`~eagle_capture.integrations.vllm.probe_capture.ProbeCapture`
(vLLM's ``worker_extension_cls``; no draft served, no vLLM code changed). Per prompt
the probe asks vLLM for one greedy token (the prefill runs the whole prompt), then
collects from the workers (``LLM.collective_rpc``) the states at the capture layers
the readings need, the target's greedy next token at every position and the prompt's
embeddings; the draft's first step then runs in this process, as with transformers.

Prompts go one at a time, so each worker keeps one prompt's states (the capture layers
x the prompt's tokens x the hidden size, on its device) and this process one copy of
rank 0's on the host. Every rank's states are checked against rank 0's (a per-row
digest) and their width against the target's hidden size: a partial sum or a TP shard
is refused, never scored.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Optional, Sequence

import torch

from eagle_capture.integrations.vllm.probe_capture import QUALNAME, digest, unpack
from eagle_capture.probe.runners import EngineError, EngineRunner, Setup, size

__all__ = [
    "EngineError",
    "FIXED_ARGS",
    "RANK_TOLERANCE",
    "VLLM_DTYPES",
    "VllmTarget",
    "check_ranks",
    "check_vllm",
    "digest",
    "kv_cache_bytes",
]

# Relative difference allowed between a rank's per-row digest and rank 0's. An
# all-reduce leaves the same bits on every rank (NCCL, vLLM's custom all-reduce and
# gloo sum in one order for all), so the ranks agree exactly; a per-rank partial sum
# differs by the layer's own contribution, percents of the row.
RANK_TOLERANCE = 1e-3
VLLM_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def kv_cache_bytes(num_layers: int, hidden_size: int, max_tokens: int) -> int:
    """The KV cache the probe asks vLLM for on each rank: one prompt of ``max_tokens``
    plus a few blocks of slack, K and V of the full hidden width in fp32 per layer (an
    upper bound for every attention kind), at least 64 MiB."""
    return max(64 << 20, num_layers * (max_tokens + 256) * 2 * hidden_size * 4)


# LLM(...) arguments the probe sets itself: the capture needs them (eager, every row
# computed, one pipeline stage, one replica), or a probe option says them (--target, --tp).
FIXED_ARGS = {
    "model": "--target",
    "tensor_parallel_size": "--tp",
    "enforce_eager": "the hooks run in eager mode only",
    "enable_prefix_caching": "every prompt's rows must be computed",
    "pipeline_parallel_size": "the probe hooks one pipeline stage",
    "data_parallel_size": "the probe runs one replica",
}


def check_ranks(answers: Sequence[dict], hidden_size: int, num_tokens: int) -> float:
    """Every rank's captures are full-width (``hidden_size``), exactly ``num_tokens`` rows
    each, and equal to rank 0's row by row (each row's digest within RANK_TOLERANCE of
    rank 0's); the largest relative difference of a row. Raises :class:`EngineError`
    otherwise.

    Row by row, never on average: per-rank partial sums can sit in a few rows only (the
    rows a rank did not compute under token scattering, e.g. DP attention), which an
    average over a long prompt dilutes below any tolerance."""
    ref = answers[0]
    worst = 0.0
    for rank, a in enumerate(answers):
        for c in sorted(a["width"]):
            rows = a["rows"][c]
            if rows != num_tokens:
                raise EngineError(
                    f"rank {rank} captured {rows} rows at capture layer {c} for a prompt of "
                    f"{num_tokens} tokens: "
                    + (
                        f"{rows - num_tokens} more rows than the prompt has (padding rows the "
                        f"engine added, or forwards besides the prompt's)"
                        if rows > num_tokens
                        else f"{num_tokens - rows} fewer rows than the prompt has (rows scattered "
                        f"over ranks, or a layer the forward did not pass)"
                    )
                    + "; the probe does not score it"
                )
            if a["width"][c] != hidden_size:
                raise EngineError(
                    f"rank {rank}'s state at capture layer {c} is {a['width'][c]} wide, the "
                    f"target's hidden size is {hidden_size}: a tensor-parallel shard, not the "
                    f"full state; the probe does not score it"
                )
            mine, theirs = a["digest"][c], ref["digest"][c]
            scale = theirs.norm(dim=-1).clamp_min(1e-30)
            per_row = (mine - theirs).norm(dim=-1) / scale
            rel = float(per_row.max()) if mine.numel() else 0.0
            if not rel <= RANK_TOLERANCE:
                off = int((~(per_row <= RANK_TOLERANCE)).sum())
                at = int(per_row.nan_to_num(float("inf")).argmax())
                raise EngineError(
                    f"rank {rank}'s state at capture layer {c} differs from rank 0's in {off} "
                    f"of {rows} rows (relative {rel:.2g} at row {at}): "
                    f"per-rank partial sums, not the all-reduced state; the probe does not "
                    f"score it"
                )
            worst = max(worst, rel)
    return worst


def _decoded(answer: dict) -> dict:
    """A worker's answer with its packed tensors back as tensors, layers as ints."""
    out = {}
    for key, value in answer.items():
        if isinstance(value, dict) and value and "dtype" in value and "data" in value:
            value = unpack(value)
        elif isinstance(value, dict):
            value = {int(k): unpack(v) if isinstance(v, dict) else v for k, v in value.items()}
        out[key] = value
    return out


def check_vllm() -> None:
    """vLLM is installed (found, not imported: its import takes seconds)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise EngineError(
            "--engine vllm: vLLM is not installed in this Python; run the probe "
            "where the target is served, or leave out --engine to run the target "
            "with transformers"
        )


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise EngineError(
            f"--engine vllm: vLLM does not import here ({exc}); run the probe "
            f"where the target is served, or leave out --engine to run the "
            f"target with transformers"
        ) from None
    return vllm


class VllmTarget(EngineRunner):
    """The target in vLLM's engine: :meth:`run` gives, for one prompt, the states at
    the capture layers ``keep`` ({c: [1, T, H]}), the greedy next token at each
    position [1, T] and the tokens' embeddings [1, T, H] (rank 0's)."""

    engine_name = "vllm"
    words = "vLLM"
    answers_for = ("vllm",)
    holds = "on its device, this process rank 0's on the host"

    @classmethod
    def check_installed(cls, architecture: str, tp: int, sglang_version: Optional[str]):
        check_vllm()
        return sglang_version

    @classmethod
    def cache(cls, setup: Setup) -> str:
        kv = kv_cache_bytes(setup.target.num_layers, setup.hidden, setup.max_tokens)
        return f"a KV cache of {size(kv)} per rank"

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
    ) -> None:
        vllm = _import_vllm()
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.keep = sorted(set(keep))
        self.tp = tp
        self.reset_counts()
        kwargs = dict(
            model=str(folder),
            tensor_parallel_size=tp,
            dtype=VLLM_DTYPES[dtype],
            # The hooks run in eager PyTorch: torch.compile would trace the layer
            # loop without them, a CUDA graph replay would skip them.
            enforce_eager=True,
            # Every prompt's rows must be computed (a cached prefix is not).
            enable_prefix_caching=False,
            max_model_len=max_tokens + 1,
            max_num_batched_tokens=max_tokens + 1,
            max_num_seqs=1,
            skip_tokenizer_init=True,
            # One prompt at a time needs little KV cache: a bound on it (every
            # layer, K and V of the full width, fp32) instead of vLLM's default of
            # most of each device, which leaves room for the draft.
            kv_cache_memory_bytes=kv_cache_bytes(num_layers, hidden_size, max_tokens),
            worker_extension_cls=QUALNAME,
        )
        kwargs.update(engine_args or {})
        # vLLM forks its engine and workers unless it sees CUDA initialised here; the
        # probe's own checks (torch.cuda.is_available()) already make a fork unusable
        # for CUDA without initialising it, and the draft runs on the GPU in this
        # process: its processes must be spawned.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        try:
            self.llm = vllm.LLM(**kwargs)
        except Exception as exc:  # noqa: BLE001 - vLLM's start-up errors are all kinds
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise EngineError(
                f"vLLM could not serve the target {folder} "
                f"(tensor parallel {tp}, dtype {dtype}): {type(exc).__name__}: "
                f"{lines[0] if lines else ''}"
            ) from None
        try:
            self.ranks = self.llm.collective_rpc(
                "eagle_probe_install", args=(self.keep, num_layers)
            )
        except Exception as exc:  # noqa: BLE001 - raised in the workers
            self.close()
            raise EngineError(
                f"the probe's capture could not be installed in vLLM's workers: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        self.sampling = vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def reset_counts(self) -> None:
        """Start the counts a report quotes (a target serving several probe runs)."""
        self.worst_rank_difference = 0.0
        self.engine_disagreements = 0
        self.prompts = 0

    @property
    def device(self) -> str:
        return self.ranks[0]["device"]

    @torch.no_grad()
    def run(self, tokens: list[int]):
        out = self.llm.generate([{"prompt_token_ids": list(tokens)}], self.sampling, use_tqdm=False)
        try:
            answers = [
                _decoded(a)
                for a in self.llm.collective_rpc("eagle_probe_take", args=(list(tokens),))
            ]
        except Exception as exc:  # noqa: BLE001 - raised in the workers
            raise EngineError(
                f"vLLM's workers could not hand over the probe's captures: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        n = len(tokens)
        self.worst_rank_difference = max(
            self.worst_rank_difference, check_ranks(answers, self.hidden_size, n)
        )
        first = next((a for a in answers if "states" in a), {})  # TP rank 0's
        if first.get("greedy") is None:
            raise EngineError(
                "vLLM's workers returned no final hidden states for a prompt: "
                "the model's final norm was not called as the probe expects"
            )
        greedy = first["greedy"].long()
        # The engine's own sampled token is the greedy token after the last position.
        self.engine_disagreements += int(out[0].outputs[0].token_ids[0] != int(greedy[-1]))
        self.prompts += 1
        states = {c: s.unsqueeze(0) for c, s in first["states"].items()}
        return states, greedy.unsqueeze(0), first["embeds"].unsqueeze(0)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.collective_rpc("eagle_probe_remove")
            except Exception:  # noqa: BLE001 - the engine may already be down
                pass
            shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()
            self.llm = None
        gc.collect()
