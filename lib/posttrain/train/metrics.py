"""Training metrics: real tokens/s, padding fraction, MFU, memory; JSONL and a progress bar.

MFU = achieved model FLOPs / peak FLOPs. Model FLOPs per token come from the model layer
(`posttrain.models.flops`); "achieved" counts real tokens only (padding excluded), so packing
and padding compare honestly. The peak is taken from a table of dense bf16 tensor-core figures
for common accelerators, or measured once on CPUs with a matmul probe (what this machine can
actually do with the dtype, not a datasheet number).
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.train.host_heap import resident_bytes

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from vendor datasheets.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200": 989.0, "H100 SXM": 989.0, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.0,
    "H800": 989.0, "GH200": 989.0, "B200": 2250.0, "B100": 1750.0, "A100": 312.0,
    "A800": 312.0, "L40S": 362.0, "L40": 181.0, "L4": 121.0, "A10G": 70.0, "A10": 125.0,
    "RTX 4090": 165.0, "RTX 6000 Ada": 364.0, "MI300X": 1307.0, "MI250X": 383.0,
}


def device_peak_flops(device: torch.device | str | None = None,
                      dtype: torch.dtype = torch.bfloat16) -> tuple[float, str]:
    """(peak FLOP/s, how it was obtained) for `device`."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
            if key.lower() in name.lower():
                return PEAK_BF16_TFLOPS[key] * 1e12, f"table:{key}"
        return measure_matmul_flops(device, dtype), f"measured:{name}"
    return measure_matmul_flops(device, torch.float32 if dtype == torch.bfloat16 else dtype), \
        f"measured:cpu:{torch.get_num_threads()}threads"


_MEASURED: dict[tuple[str, torch.dtype], float] = {}


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 1024,
                         repeats: int = 5) -> float:
    """Best-of-`repeats` square-matmul FLOP/s: the practical peak of this device and dtype."""
    key = (str(device), dtype)
    if key not in _MEASURED:
        gen = torch.Generator(device=device).manual_seed(0)   # leaves the global RNG alone
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        _MEASURED[key] = 2 * n**3 / best
    return _MEASURED[key]


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak accelerator memory on CUDA, else the process's peak resident set size: Linux's
    VmHWM, which starts afresh at exec, where ru_maxrss keeps the high-water mark of the
    process that forked it (a trainer started by a large parent would report the parent's)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resident_bytes()[1] or int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def batch_counts(batches: list[dict[str, Any]]) -> dict[str, float]:
    """Real, padding and loss tokens of micro-batches (sum them over ranks for a step's)."""
    return {"real_tokens": float(sum(int(b["num_real_tokens"]) for b in batches)),
            "pad_tokens": float(sum(int(b["num_pad_tokens"]) for b in batches)),
            "loss_tokens": float(sum(int(b["num_loss_tokens"]) for b in batches))}


def step_metrics(counts: dict[str, float], *, seconds: float, data_wait_s: float,
                 flops: float, peak_flops: float, device: torch.device | None) -> dict[str, Any]:
    """The throughput metrics of one optimizer step, from the `batch_counts` of all of its
    (global) micro-batches, the same for every recipe: real and loss tokens, padding fraction,
    real tokens/s, time waiting for data, MFU (`flops` the step executed over `seconds`,
    against the peak of all devices) and peak memory."""
    real, pad = int(counts["real_tokens"]), int(counts["pad_tokens"])
    return {"real_tokens": real, "loss_tokens": int(counts["loss_tokens"]),
            "padding_fraction": pad / max(real + pad, 1),
            "real_tokens_per_s": real / seconds, "data_wait_s": data_wait_s,
            "step_total_s": seconds, "step_flops": flops,
            "mfu": flops / seconds / peak_flops if peak_flops else 0.0,
            "peak_memory_bytes": peak_memory_bytes(device)}


class MetricsWriter:
    """Appends one JSON object per line; optional TensorBoard mirror, and other mirrors
    (`add_mirror`: the experiment trackers, `posttrain.train.trackers.Trackers`)."""

    def __init__(self, path: str | Path | None, tensorboard_dir: str | None = None):
        self.path = Path(path) if path else None
        self._mirrors: list[Any] = []
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("metrics.tensorboard_dir is set but tensorboard is not "
                                  "installed: pip install tensorboard") from e
            self._tb = SummaryWriter(tensorboard_dir)

    def write(self, record: dict[str, Any]) -> None:
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record, default=float) + "\n")
        if self._tb is not None:
            step = int(record.get("step", 0))
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)
        for mirror in self._mirrors:
            mirror.write(record)

    def add_mirror(self, mirror: Any) -> None:
        """Also send every record to `mirror.write(record)`; `mirror.close(ok)` at the end."""
        if mirror is not None:
            self._mirrors.append(mirror)

    def close(self, ok: bool = True) -> None:
        """`ok`: whether the run succeeded (a tracker's run is marked finished or failed)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for mirror in self._mirrors:
            mirror.close(ok)
        self._mirrors = []


def read_metrics(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
