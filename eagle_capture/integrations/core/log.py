"""The project's loggers in each engine's processes, and the TP rank a log line
names."""

import logging
from typing import Any, Callable

__all__ = ["SGLANG_LOGGER", "VLLM_LOGGER", "logger", "rank_or_unknown"]

SGLANG_LOGGER = "eagle_capture"
# Under vLLM's logger: its handler, format and VLLM_LOGGING_LEVEL (a logger outside
# "vllm" prints nothing below WARNING in vLLM's processes).
VLLM_LOGGER = "vllm.eagle_capture"


def logger(name: str = SGLANG_LOGGER) -> logging.Logger:
    """The logger ``name``, taken per call and enabled: an engine's logging set-up
    (vLLM's dictConfig) disables the loggers that existed before it ran."""
    log = logging.getLogger(name)
    log.disabled = False
    return log


def rank_or_unknown(rank: Callable[[], Any]) -> Any:
    """``rank()`` (the engine's TP rank of this process), or "?" where the engine
    cannot say (outside a server, its groups not initialised)."""
    try:
        return rank()
    except Exception:  # noqa: BLE001 - any failure: the log line says "?"
        return "?"
