"""What a rank has to fit into: GPU memory by kind, a CPU process's share of the machine's
RAM, and the memory a CPU process holds before training anything."""

from __future__ import annotations

import os

from posttrain.errors import ConfigError

MiB, GiB = 1 << 20, 1 << 30

# Device memory as `nvidia-smi` reports it (total), by the kind names configs use (`run.gpu`,
# `posttrain plan --gpu`).
GPU_MEMORY_BYTES: dict[str, int] = {
    "h200": 143_771 * MiB,
    "h100-94g": 95_830 * MiB,      # H100 NVL
    "h100-80g": 81_559 * MiB,
    "a100-80g": 81_920 * MiB,
    "a100-40g": 40_960 * MiB,
    "l40s": 46_068 * MiB,
    "a10g": 23_028 * MiB,
    "l4": 23_034 * MiB,
    "b200": 183_359 * MiB,
}

# What the CUDA context, cuBLAS/NCCL workspaces and the caching allocator's rounding take
# beside the tensors torch counts in max_memory_allocated: the fit check keeps this free.
GPU_RESERVE_BYTES = 2 * GiB

# A CPU process's resident memory before the model: the interpreter, torch, transformers,
# pyarrow, the tokenizer, the data loader's threads and buffers and (inline) the driver's own
# work (prepare, the metrics writer, evaluation). Calibrated as the measured peak (ru_maxrss)
# less the plan's model parts on the bundled tiny configs, whose model parts are a few MB
# (tests/lib/plan/test_memory.py), on a 2-core AMD EPYC, torch 2.13 CPU, Python 3.11:
#   inline       one loader recipe's rank in the driver process (`run.launcher: inline`, SFT):
#                0.546 GB measured on the tiny SFT (0.671 before the packer stopped copying
#                the shuffle buffer at every row, `posttrain.data.stream.capture`)
#   inline_rl    GRPO's rank in the driver process (no packing loader thread; its engine is
#                counted as a part)
#   ray_worker   a Ray trainer actor (ray and its gRPC threads on top of the trainer):
#                rank 0 of the tiny config on 2 Ray ranks, 0.683 GB measured (before that
#                change; not measured again, so it may predict high by up to ~0.1 GB)
CPU_BASELINE_BYTES: dict[str, int] = {
    "inline": int(0.46 * GiB),
    "inline_rl": int(0.36 * GiB),
    "ray_worker": int(0.59 * GiB),
}


def gpu_bytes(kind: str) -> int:
    """Memory of one GPU of `kind`."""
    key = kind.lower()
    if key not in GPU_MEMORY_BYTES:
        raise ConfigError(f"run.gpu / --gpu: unknown GPU kind {kind!r}; known: "
                          f"{', '.join(sorted(GPU_MEMORY_BYTES))}")
    return GPU_MEMORY_BYTES[key]


def cpu_baseline(process: str) -> int:
    if process not in CPU_BASELINE_BYTES:
        raise ValueError(f"process kind {process!r}: one of {sorted(CPU_BASELINE_BYTES)}")
    return CPU_BASELINE_BYTES[process]


def machine_ram_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_bytes_per_process(processes: int) -> int:
    """This machine's RAM shared by `processes` ranks."""
    return machine_ram_bytes() // max(1, processes)
