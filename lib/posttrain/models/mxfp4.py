"""MXFP4 checkpoint tensors (OCP Microscaling FP4, GPT-OSS's expert weights), dequantized on load.

A quantized matrix W [..., R, C] is stored as two tensors next to each other:

    W_blocks  uint8 [..., R, C / 32, 16]   two 4-bit E2M1 codes per byte, low nibble first
    W_scales  uint8 [..., R, C / 32]       one E8M0 exponent per block of 32 values, bias 127

    W[..., r, 32 g + j] = E2M1[code_j of block (r, g)] * 2 ** (scales[..., r, g] - 127)

E2M1 (sign, two exponent bits, one mantissa bit) codes the values +-{0, .5, 1, 1.5, 2, 3, 4, 6},
so every weight is exact in bf16. transformers stores the GPT-OSS expert parameters transposed
([E, in, out]) against the quantized layout ([E, out, in / 32, 16]); `read` returns the
parameter as transformers' `convert_moe_packed_tensors` does, the last two dims swapped.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from posttrain.errors import PosttrainError

BLOCKS, SCALES = "_blocks", "_scales"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_ROWS_PER_CHUNK = 1 << 18     # blocks of 32 values a step: bounds the int64 indices built


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [..., R, C] from `blocks` [..., R, C/32, 16] and `scales` [..., R, C/32] (see above)."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise PosttrainError(f"MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales "
                             f"{tuple(scales.shape)} do not pair up (want uint8 [..., G, 16], "
                             "[..., G])")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes_NB, exps_N = blocks.reshape(-1, 16), scales.reshape(-1).to(torch.int32) - 127
    out = torch.empty(codes_NB.shape[0], 32, dtype=dtype)
    for start in range(0, codes_NB.shape[0], _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        nibbles = torch.stack((codes_NB[rows] & 0x0F, codes_NB[rows] >> 4), dim=-1)
        values = lut[nibbles.reshape(-1, 32).long()]
        out[rows] = torch.ldexp(values, exps_N[rows, None]).to(dtype)
    return out.reshape(*blocks.shape[:-2], -1)


def quantized_names(names: dict[str, Path]) -> dict[str, tuple[Path, Path]]:
    """Checkpoint tensors stored as MXFP4 pairs: logical name -> (blocks file, scales file)."""
    pairs = {}
    for name, file in names.items():
        if name.endswith(BLOCKS):
            base = name.removesuffix(BLOCKS)
            if base + SCALES not in names:
                raise PosttrainError(f"MXFP4 tensor '{name}' ({file}) has no '{base}{SCALES}'")
            pairs[base] = (file, names[base + SCALES])
    return pairs


def read(name: str, blocks_file: Path, scales_file: Path,
         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The dequantized parameter `name` [..., C, R] (transposed, see the module docstring)."""
    with safe_open(blocks_file, framework="pt", device="cpu") as f:
        blocks = f.get_tensor(name + BLOCKS)
    with safe_open(scales_file, framework="pt", device="cpu") as f:
        scales = f.get_tensor(name + SCALES)
    return dequantize(blocks, scales, dtype).transpose(-1, -2).contiguous()
