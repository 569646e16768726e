"""The config schema is read without the library's heavy modules (issue 33): in one fresh
process, every bundled config is built with its kind's schema (`posttrain.config.registry`)
and checked as `posttrain validate` checks it (`steps.validate.check`), and every flow's
``Config`` is parsed as Metaflow parses it when the flow is launched
(`flows/_posttrain_flow.parse_config` on the flow's default config), and neither torch nor
transformers (nor numpy, pyarrow) is imported. The wall time of one `posttrain validate` is
printed, not asserted (the machine is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "transformers", "numpy", "pyarrow")

_PROBE = """
import ast, json, sys
from pathlib import Path
from posttrain.config.registry import kind_of, schema
from steps import validate
from _posttrain_flow import parse_config

configs = sorted(p.as_posix() for p in Path("configs").rglob("*.yaml"))
for path in configs:
    kind = kind_of(path)
    assert isinstance(validate.load(path, kind), schema(kind)), path
    validate.check(path, kind)

# each flow's Config(..., default=<yaml>, parser=parse_config(<SCHEMA>)), read from its source
flows = []
for path in sorted(Path("flows").glob("*_flow.py")):
    tree = ast.parse(path.read_text())
    names = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(node.value, ast.Constant)}
    for call in ast.walk(tree):
        kw = {k.arg: k.value for k in getattr(call, "keywords", ())}
        parser = kw.get("parser")
        if isinstance(parser, ast.Call) and getattr(parser.func, "id", "") == "parse_config":
            dotted = names[parser.args[0].id]
            resolved = parse_config(dotted)(Path(kw["default"].value).read_text())
            assert resolved and isinstance(resolved, dict), (path, dotted)
            flows.append(f"{path.name}:{dotted}")
print(json.dumps({"configs": len(configs), "flows": flows,
                  "loaded": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": f"{ROOT}/lib:{ROOT}:{ROOT}/flows"})


def test_configs_validate_and_flows_parse_without_heavy_imports():
    out = _run(["-c", _PROBE])
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["configs"] >= 25
    assert len(got["flows"]) >= 12, got["flows"]       # every flow, the pipeline's three too
    assert got["loaded"] == [], got["loaded"]

    start = time.perf_counter()
    out = _run(["-m", "steps.cli", "validate", "--config", "configs/grpo/tiny.yaml"])
    wall = time.perf_counter() - start
    assert out.returncode == 0, out.stderr
    print(f"posttrain validate --config configs/grpo/tiny.yaml: {wall:.2f} s wall")
