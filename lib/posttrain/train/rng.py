"""Capture and restore every random generator a training step draws from, as plain JSON.

Resuming must reproduce the draws an uninterrupted run would make (dropout masks, sampling,
shuffles), so a checkpoint stores the state of Python's `random`, NumPy's global generator, the
torch CPU generator and, where present, every CUDA device's generator. Byte states are base64
so the result goes through `json.dumps` unchanged.
"""

from __future__ import annotations

import base64
import random
import warnings

import numpy as np
import torch

_FORMAT = 1


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode("ascii")


def _decode(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng() -> dict:
    """This process's generator states as a JSON-serializable dict."""
    py_version, py_internal, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state = {
        "format": _FORMAT,
        "python": [py_version, list(py_internal), py_gauss],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch_cpu": _encode(torch.get_rng_state()),
        "torch_cuda": None,
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict) -> None:
    """Set the generators to a state from `capture_rng`.

    CUDA states are restored only when this process sees the same number of devices as the one
    that captured them; otherwise they are skipped with a warning (CPU generators are still set).
    """
    if state.get("format") != _FORMAT:
        raise ValueError(f"RNG state has format {state.get('format')!r}, expected {_FORMAT}")
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_internal), py_gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_kind, np.asarray(np_keys, dtype=np.uint32), np_pos, np_has_gauss,
                         np_gauss))
    torch.set_rng_state(_decode(state["torch_cpu"]))
    cuda = state.get("torch_cuda")
    if cuda is None:
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        warnings.warn(f"RNG state holds {len(cuda)} CUDA generator(s) but this process sees {have} "
                      "CUDA device(s); CUDA generators are not restored")
        return
    torch.cuda.set_rng_state_all([_decode(s) for s in cuda])
