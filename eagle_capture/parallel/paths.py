"""Which all-reduce path a tensor-parallel layer boundary takes, per (world size, T).

:class:`eagle_capture.parallel.symm.SymmAllReduceCapture` runs either its one-shot
kernel or NCCL + the fused add+RMSNorm; which one is faster depends on the
machine, the world size and T. A :class:`PathTable` holds what was measured
(:func:`measured_table` builds it, :func:`write_table` writes it;
``benchmarks/allreduce_capture.py --write-table`` measures and calls both); without
one, :data:`DEFAULT_ONE_SHOT_MAX_TOKENS` decides. Pure Python: no torch needed.
"""

import json
import os
import time
from typing import Iterable, Optional, Union

# one_shot: the one kernel; nccl: NCCL (in SGLang: its all-reduce) + the fused
# add+RMSNorm; engine_fusion: the serving engine's own all-reduce + norm fusion
# followed by a capture copy (FlashInfer's in SGLang). A standalone
# SymmAllReduceCapture has no engine: it runs engine_fusion rows as nccl.
PATHS = ("one_shot", "nccl", "engine_fusion")
TABLE_FORMAT = "eagle_capture.parallel.paths/1"
TABLE_ENV = "EAGLE_CAPTURE_ALLREDUCE_TABLE"
# Largest T that takes the one-shot kernel when no measured table is given, per
# world size (the largest listed world size <= W applies). World 1 and 2:
# measured on two H200s over NVLink, H = 7168 bf16 (benchmarks/RESULTS.md,
# 2026-11-30): at W = 1 the NCCL path is a no-op all-reduce + the fused op and
# always wins; at W = 2 the one-shot kernel wins up to T = 512 and ties at 1024.
# World 4 and 8: unmeasured guesses that follow the shape of TensorRT-LLM's SM90
# table (one-shot's NVLink traffic grows with W - 1, the ring's does not).
DEFAULT_ONE_SHOT_MAX_TOKENS = {1: 0, 2: 1024, 4: 256, 8: 64}


class PathTable:
    """The fastest path per (world size, T), measured on the machine.

    JSON written by :func:`write_table` (``benchmarks/allreduce_capture.py --write-table``):
    ``{"format": TABLE_FORMAT, "hidden_size": H, "dtype": "bfloat16",
    "device": ..., "paths": {"2": [[1, "one_shot"], [2, "one_shot"], ...]}}``.
    A T between two measured sizes takes the path of the next larger one
    (above the largest: the largest's); a world size not in the table takes
    the default rule."""

    def __init__(
        self,
        paths: dict,
        hidden_size: Optional[int] = None,
        dtype: Optional[str] = None,
        source: str = "<dict>",
    ) -> None:
        self.hidden_size, self.dtype, self.source = hidden_size, dtype, source
        self.paths: dict[int, list[tuple[int, str]]] = {}
        for world, rows in paths.items():
            entries = sorted((int(t), str(p)) for t, p in rows)
            bad = [p for _, p in entries if p not in PATHS]
            if bad or not entries or entries[0][0] < 1:
                raise ValueError(
                    f"eagle_capture: path table {source}: world size {world} needs "
                    f"[[T >= 1, path], ...] with path in {PATHS}, got {rows!r}"
                )
            self.paths[int(world)] = entries

    @classmethod
    def load(cls, table: Union[str, os.PathLike, dict, "PathTable"]) -> "PathTable":
        if isinstance(table, PathTable):
            return table
        source = "<dict>"
        if not isinstance(table, dict):
            source = os.fspath(table)
            with open(source) as f:
                table = json.load(f)
        if table.get("format") != TABLE_FORMAT:
            raise ValueError(
                f"eagle_capture: {source} is not a path table (format "
                f"{table.get('format')!r}, expected {TABLE_FORMAT!r})"
            )
        return cls(table["paths"], table.get("hidden_size"), table.get("dtype"), source)

    def path(self, world_size: int, num_tokens: int) -> Optional[str]:
        entries = self.paths.get(world_size)
        if entries is None:
            return None
        for t, p in entries:
            if num_tokens <= t:
                return p
        return entries[-1][1]


def default_one_shot_max_tokens(world_size: int) -> int:
    known = [w for w in DEFAULT_ONE_SHOT_MAX_TOKENS if w <= world_size]
    return DEFAULT_ONE_SHOT_MAX_TOKENS[max(known)] if known else 0


def measured_table(
    world_size: int,
    timings: Iterable[tuple[int, Optional[float], Optional[float]]],
    hidden_size: int,
    dtype: str,
    device: str,
    date: Optional[str] = None,
) -> dict:
    """The path table of one world size from times measured on this machine.

    Parameters
    ----------
    world_size : int
        The world size the times were measured at.
    timings : iterable of (T, one_shot_us, nccl_us)
        GPU time per layer boundary of each path at T tokens; ``None`` where that
        path was not measured. A T with neither is left out.
    hidden_size, dtype, device : int, str, str
        What was measured (recorded in the table, not used by the lookup).
    date : str, optional
        ``YYYY-MM-DD``; today (UTC) by default.

    Returns
    -------
    dict
        The JSON object :meth:`PathTable.load` reads: per T the faster of
        ``one_shot`` and ``nccl`` (``one_shot`` on a tie: one launch, no NCCL
        call to schedule).
    """
    entries = []
    for t, one_shot, nccl in timings:
        if one_shot is None and nccl is None:
            continue
        fastest = (
            "one_shot" if nccl is None or (one_shot is not None and one_shot <= nccl) else "nccl"
        )
        entries.append([int(t), fastest])
    return {
        "format": TABLE_FORMAT,
        "hidden_size": hidden_size,
        "dtype": dtype,
        "device": device,
        "date": date or time.strftime("%Y-%m-%d", time.gmtime()),
        "paths": {str(world_size): entries},
    }


def write_table(table: dict, path: Union[str, os.PathLike]) -> PathTable:
    """Write a path table as JSON; returns it as loaded.

    The table is checked by :meth:`PathTable.load` first, so that no file is
    written that the reader would refuse (``ValueError`` instead).
    """
    loaded = PathTable.load(table)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return loaded
