"""The aux buffer's rows in vLLM: its ``max_num_batched_tokens`` (no forward is
larger), or ``EAGLE_CAPTURE_MAX_TOKENS``."""

from __future__ import annotations

import os

from eagle_capture.integrations import settings
from eagle_capture.integrations.core.errors import PluginError

__all__ = ["buffer_rows"]


def buffer_rows(vllm_config, compiled: bool, env=os.environ) -> tuple[int, str]:
    """The buffer's rows: vLLM's ``max_num_batched_tokens`` (no forward is
    larger: the scheduler's token budget, the profile run and every CUDA-graph
    size are within it), or ``EAGLE_CAPTURE_MAX_TOKENS``."""
    limit = int(vllm_config.scheduler_config.max_num_batched_tokens)
    raw = env.get(settings.MAX_TOKENS, "").strip()
    if not raw:
        return limit, f"vLLM's max_num_batched_tokens {limit}"
    try:
        rows = int(raw)
        if rows < 1:
            raise ValueError
    except ValueError:
        raise PluginError(
            f"{settings.MAX_TOKENS}={raw!r}: expected a number of tokens >= 1"
        ) from None
    if rows < limit and compiled:
        raise PluginError(
            f"{settings.MAX_TOKENS}={rows} is below vLLM's max_num_batched_tokens {limit}, and "
            f"a compiled / CUDA-graph forward of more tokens cannot take a buffer of its own: "
            f"unset it or raise it to {limit}"
        )
    return rows, f"{settings.MAX_TOKENS}={rows} (vLLM's max_num_batched_tokens {limit})"
