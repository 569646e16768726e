"""`posttrain.ops.compiler.outside_graphs`: code compiled graphs must not trace, marked without
importing `torch._dynamo` (about 1.1 s) where nothing compiles.

Bugs these catch: a `torch.compiler.disable` decorator back in the model stack (every process
that imports the models pays the compiler's import again: the subprocess sees it loaded); a mark
that dynamo does not honour (the compiled function traces the marked call and bakes its Python
result into the graph: the call count and the second result show it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]

_EAGER = """
import json, sys
import torch
from posttrain.models import ModelArgs, build_model
from posttrain.models.args import DeltaNetArgs
base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
            num_kv_heads=1, head_dim=16)
kinds = [ModelArgs(family="qwen3", qk_norm=True, **base),
         ModelArgs(family="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=16, **base),
         ModelArgs(family="qwen3_5", norm_offset=True, attn_output_gate=True,
                   partial_rotary_factor=0.25,
                   layer_types=("linear_attention", "full_attention"),
                   linear_attention=DeltaNetArgs(num_k_heads=2, num_v_heads=2, head_k_dim=8,
                                                 head_v_dim=8, chunk_size=4), **base)]
for args in kinds:
    model = build_model(args, seed=0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    model(ids, document_lengths=[[5, 7], [12]]).square().mean().backward()
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules}))
"""


def test_the_models_run_eagerly_without_importing_the_compiler():
    out = subprocess.run([sys.executable, "-c", _EAGER], cwd=ROOT, capture_output=True,
                         text=True, env={"PYTHONPATH": f"{ROOT}/lib", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"dynamo": False}


def test_a_compiled_caller_runs_the_marked_function_outside_its_graphs():
    from posttrain.ops.compiler import outside_graphs

    calls = []

    @outside_graphs
    def scale_by_a_python_list(x: torch.Tensor) -> torch.Tensor:
        calls.append(len(calls))          # a Python side effect a graph would not repeat
        return x * float(len(calls))

    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    f = torch.compile(lambda x: scale_by_a_python_list(x + 1) - 1, backend=counting)
    x = torch.ones(3)
    assert f(x).tolist() == [1.0, 1.0, 1.0]               # (1 + 1) * 1 - 1
    assert f(x).tolist() == [3.0, 3.0, 3.0]               # (1 + 1) * 2 - 1: ran again
    assert calls == [0, 1]
    # the graph breaks at the call: `x + 1` and `- 1` compiled on either side, not the call
    assert len(graphs) == 2
    assert all("mul" not in str(g.graph) for g in graphs), [str(g.graph) for g in graphs]
    torch._dynamo.reset()
