"""Distribution: process group and device mesh (`env`), FSDP2/TP/AC/compile application
(`parallelize`; each block's TP plan in `tensor_parallel`), a rank's share of the data
(`data_parallel`), and groups of Ray actors forming one torch.distributed job (`worker_group`).

`WorkerGroup` and `WorkerError` need Ray (the `flows` extra), so they are imported on first
use: `from posttrain.distributed import WorkerGroup` works, while importing this package (or
`import *`) does not import Ray.
"""

from posttrain.distributed.env import (build_mesh, close_process_group, free_port, get_device,
                                       init_process_group, local_rank, rank, world_size)
from posttrain.distributed.parallelize import (ParallelConfig, UnsupportedParallelismError,
                                               apply_activation_checkpointing, apply_compile,
                                               apply_expert_parallel, apply_fsdp, apply_tp,
                                               count_params, gather_full_state_dict,
                                               parallelize)

__all__ = [
    "ParallelConfig", "UnsupportedParallelismError",
    "apply_activation_checkpointing", "apply_compile", "apply_expert_parallel",
    "apply_fsdp", "apply_tp", "build_mesh",
    "close_process_group", "count_params", "free_port", "gather_full_state_dict", "get_device",
    "init_process_group", "local_rank", "parallelize", "rank", "world_size",
]


def __getattr__(name: str):
    # Ray is heavy and only the driver needs it: import worker_group on first use
    if name in ("WorkerGroup", "WorkerError"):
        from posttrain.distributed import worker_group
        return getattr(worker_group, name)
    raise AttributeError(f"module 'posttrain.distributed' has no attribute {name!r}")
