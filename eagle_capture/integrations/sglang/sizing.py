"""How many rows the persistent aux buffer needs: the most tokens the EAGLE-3
target runs in one forward, from SGLang's own (resolved) server arguments.

What bounds a target forward (read in the wheels 0.5.13, 0.5.20, 0.5.23; the
target runs only EXTEND and TARGET_VERIFY under EAGLE-3):

* prefill: a chunk of ``chunked_prefill_size`` tokens (mixed-chunk decodes
  are taken out of the chunk's budget). Chunking off (``-1``): the first
  request is admitted whatever its length, later ones up to
  ``max_prefill_tokens`` -- the buffer covers ``max_prefill_tokens`` and a
  longer prefill gets a buffer of its own for that forward (as SGLang's own
  capture allocates one per forward), with a warning;
* verify: ``max_running_requests x speculative_num_draft_tokens`` (the largest
  ``N`` under adaptive speculation); verify batches above the CUDA-graph limit
  run eagerly at their real size;
* CUDA graphs: decode (verify) graphs of up to ``max_bs x N`` tokens and prefill
  graphs of up to their max tokens are captured with the capture inside --
  these MUST fit (a graph's buffer address is fixed at capture).

Where the final values live: 0.5.13 resolves ``ServerArgs`` in place (the
scheduler's copy holds them); from 0.5.18 the ``ServerArgs`` record keeps the
raw command line and the resolved values are the runtime-context bags
(``get_schedule()``, ``get_exec().graph``, ``get_spec()``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from typing import Optional

MAX_TOKENS_ENV = "EAGLE_CAPTURE_MAX_TOKENS"
DEFAULT_MAX_TOKENS = 8192  # SGLang's chunked_prefill_size on an 80 - 160 GB GPU


@dataclass(frozen=True)
class ServingLimits:
    """SGLang's per-forward limits, None where this process cannot see one."""

    chunked_prefill_size: Optional[int] = None
    max_prefill_tokens: Optional[int] = None
    max_running_requests: Optional[int] = None
    num_draft_tokens: Optional[int] = None  # the largest N (adaptive speculation)
    decode_graph_max_bs: Optional[int] = None  # verify graphs: max_bs x N tokens
    prefill_graph_max_tokens: Optional[int] = None  # prefill / piecewise graphs


@dataclass(frozen=True)
class BufferSize:
    max_tokens: int
    graph_tokens: int  # the rows CUDA graphs need (a lower bound for any override)
    reason: str


def size_buffer_for(limits: ServingLimits, env=os.environ) -> BufferSize:
    """The buffer's rows for ``limits`` (``EAGLE_CAPTURE_MAX_TOKENS`` overrides,
    but never below what CUDA graphs need)."""
    terms = {}
    chunk = limits.chunked_prefill_size
    if chunk is not None and chunk > 0:
        terms["chunked_prefill_size"] = chunk
    elif limits.max_prefill_tokens:
        terms["max_prefill_tokens (chunking off; longer prefills get their own buffer)"] = (
            limits.max_prefill_tokens
        )
    n = limits.num_draft_tokens or 1
    if limits.max_running_requests:
        terms[f"max_running_requests x draft tokens ({limits.max_running_requests} x {n})"] = (
            limits.max_running_requests * n
        )
    graph_terms = {}
    if limits.decode_graph_max_bs:
        graph_terms[f"verify graphs ({limits.decode_graph_max_bs} x {n})"] = (
            limits.decode_graph_max_bs * n
        )
    if limits.prefill_graph_max_tokens:
        graph_terms["prefill graphs"] = limits.prefill_graph_max_tokens
    terms.update(graph_terms)
    graph_tokens = max(graph_terms.values(), default=0)
    raw = env.get(MAX_TOKENS_ENV, "").strip()
    if raw:
        try:
            rows = int(raw)
            if rows <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"{MAX_TOKENS_ENV}={raw!r}: expected a positive number of tokens"
            ) from None
        if rows < graph_tokens:
            raise ValueError(
                f"{MAX_TOKENS_ENV}={rows} is below the {graph_tokens} tokens this server's "
                f"CUDA graphs run in one forward ({', '.join(graph_terms)}): a graph writes "
                f"its captures at a fixed address, so the buffer must hold them"
            )
        return BufferSize(rows, graph_tokens, f"{MAX_TOKENS_ENV}={rows}")
    if not terms:
        return BufferSize(
            DEFAULT_MAX_TOKENS,
            0,
            f"default {DEFAULT_MAX_TOKENS}: no limit readable from SGLang here",
        )
    rows = max(terms.values())
    why = ", ".join(f"{k} = {v}" for k, v in terms.items())
    return BufferSize(rows, graph_tokens, f"max of {why}")


def _first(*values):
    return next((v for v in values if v is not None), None)


def read_limits(server_args=None, runner=None) -> ServingLimits:
    """SGLang's resolved limits in this (scheduler) process."""
    rc = sys.modules.get("sglang.srt.runtime_context")
    bags = {}
    for name in ("get_schedule", "get_exec", "get_spec"):
        getter = getattr(rc, name, None)
        try:
            bags[name] = getter() if getter is not None else None
        except Exception:  # noqa: BLE001 - not published (outside a server)
            bags[name] = None
    schedule, spec = bags["get_schedule"], bags["get_spec"]
    graph = getattr(bags["get_exec"], "graph", None)
    config = getattr(graph, "cuda_graph_config", None)
    sa = server_args

    def get(obj, name):
        return getattr(obj, name, None) if obj is not None else None

    decode_bs = _first(
        get(get(config, "decode"), "max_bs"),
        get(graph, "cuda_graph_max_bs_decode"),
        get(sa, "cuda_graph_max_bs"),
    )
    prefill_tokens = _first(
        get(get(config, "prefill"), "max_bs"),
        get(graph, "cuda_graph_max_bs_prefill"),
        None
        if get(sa, "disable_piecewise_cuda_graph")
        else get(sa, "piecewise_cuda_graph_max_tokens"),
    )
    if get(graph, "disable_cuda_graph") or get(sa, "disable_cuda_graph"):
        decode_bs = prefill_tokens = None
    running = _first(
        get(runner, "max_running_requests"),
        get(schedule, "max_running_requests"),
        get(sa, "max_running_requests"),
    )
    if decode_bs is not None and running:
        decode_bs = min(decode_bs, running)  # graphs are captured up to the request pool
    return ServingLimits(
        chunked_prefill_size=_first(
            get(schedule, "chunked_prefill_size"), get(sa, "chunked_prefill_size")
        ),
        max_prefill_tokens=_first(
            get(schedule, "max_prefill_tokens"), get(sa, "max_prefill_tokens")
        ),
        # The runner's own (per rank, after the KV pool is sized) where it is at hand.
        max_running_requests=running,
        num_draft_tokens=_first(
            get(spec, "max_speculative_num_draft_tokens"),
            get(spec, "speculative_num_draft_tokens"),
            get(sa, "max_speculative_num_draft_tokens"),
            get(sa, "speculative_num_draft_tokens"),
        ),
        decode_graph_max_bs=decode_bs,
        prefill_graph_max_tokens=prefill_tokens,
    )


def describe(limits: ServingLimits) -> str:
    return ", ".join(f"{f.name}={getattr(limits, f.name)}" for f in fields(limits))
