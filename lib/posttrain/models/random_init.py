"""A random Hugging Face checkpoint from a tiny config (`model.init`: tests and the bundled
tiny runs start from one), written where a run keeps its base model.

Kept apart from the engine so a driver that only launches ranks (the Ray launcher) writes it
without importing the training stack.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib import metadata
from pathlib import Path

import torch

from posttrain.config.model import ModelInitConfig

__all__ = ["write_random_hf_model"]


def write_random_hf_model(init: ModelInitConfig, vocab_size: int, out_dir: str | Path,
                          tokenizer_dir: str | None = None) -> str:
    """Create a random HF checkpoint from a tiny config (deterministic for `init.seed`); the
    process's torch generator is left seeded with `init.seed` and advanced by the init.

    With POSTTRAIN_INIT_CACHE set to a directory, the checkpoint is kept there under a key of
    everything that decides its bytes (`init`, the vocabulary, the source of the tiny configs
    and of this builder, the torch and transformers versions, the CPU's kernel set). A later
    call with that key copies it, and sets the generator to the state the build left, instead
    of importing transformers' model code to build it again (the test suite sets it: its
    driver processes would each pay that import)."""
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    tmp = out.with_name(out.name + ".tmp")
    cached = _init_cache_entry(init, vocab_size)
    if cached is not None and (cached / "config.json").is_file():
        shutil.copytree(cached, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(_RNG))
        torch.set_rng_state(torch.frombuffer(bytearray((cached / _RNG).read_bytes()),
                                             dtype=torch.uint8))
    else:
        from transformers import AutoModelForCausalLM

        from posttrain.models.verify import tiny_hf_config
        config = tiny_hf_config(init.family, **{"initializer_range": 0.02,
                                                "vocab_size": vocab_size, **init.overrides})
        torch.manual_seed(init.seed)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)
        if cached is not None:
            _keep(tmp, torch.get_rng_state(), cached)
    if tokenizer_dir:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
    tmp.rename(out)
    return str(out)


_RNG = "torch_rng_state.bin"     # in a cache entry: the generator's state after the build


def _init_cache_entry(init: ModelInitConfig, vocab_size: int) -> Path | None:
    """Where POSTTRAIN_INIT_CACHE keeps the checkpoint of `init` (None: no cache)."""
    root = os.environ.get("POSTTRAIN_INIT_CACHE")
    if not root:
        return None
    import posttrain.models.verify as tiny_configs
    key = json.dumps({"family": init.family, "overrides": init.overrides, "seed": init.seed,
                      "vocab_size": vocab_size, "torch": metadata.version("torch"),
                      "transformers": metadata.version("transformers"),
                      # the sampling kernels the CPU runs (ATEN_CPU_CAPABILITY)
                      "cpu": torch.backends.cpu.get_cpu_capability(),
                      "code": [hashlib.sha256(Path(f).read_bytes()).hexdigest()
                               for f in (tiny_configs.__file__, __file__)]},
                     sort_keys=True, default=str)
    return Path(root) / hashlib.sha256(key.encode()).hexdigest()[:32]


def _keep(built: Path, rng_state: torch.Tensor, entry: Path) -> None:
    """Copy the checkpoint in `built` and the generator state to the cache `entry`, whole or
    not at all (a concurrent writer of the same key writes the same bytes; the first rename
    wins)."""
    part = entry.with_name(f"{entry.name}.{os.getpid()}.part")
    shutil.copytree(built, part, dirs_exist_ok=True)
    (part / _RNG).write_bytes(rng_state.numpy().tobytes())
    try:
        part.rename(entry)
    except OSError:                 # another process kept it first
        shutil.rmtree(part, ignore_errors=True)
