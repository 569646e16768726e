"""Peak-memory measurement shared by the memory benchmarks.

Each variant runs in a fresh child process (`run_child`), so one variant's high-water mark can
never hide another's. Inside the child, `Measured` records the extra peak memory and the time of
a block: on CUDA the allocator's peak above what was allocated at the start; on CPU the process's
peak resident set size (ru_maxrss) above the resident set at the start.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

import torch


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Measured:
    """`with Measured(device) as m: ...` then `m.peak_extra_bytes`, `m.seconds`."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self) -> "Measured":
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._base = _rss_bytes()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        self.seconds = time.perf_counter() - self._start
        self.peak_extra_bytes = peak - self._base


def run_child(script: str, variant: str, argv: list[str]) -> dict:
    """Run `script --variant VARIANT argv...` in a fresh process; its last stdout line is JSON."""
    cmd = [sys.executable, os.path.abspath(script), "--variant", variant, *argv]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])
