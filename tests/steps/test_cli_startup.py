"""`posttrain --help` and every `posttrain <command> --help` import neither torch nor
transformers (issue 33): the parser is built from `steps.arguments`, and a command's step
module is imported only when the command runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
from steps.arguments import COMMANDS
from steps.cli import main
loaded = {}
for argv in [["--help"]] + [[name, "--help"] for name in COMMANDS]:
    try:
        main(argv)
    except SystemExit:
        pass
    loaded[" ".join(argv)] = sorted(m for m in ("torch", "transformers", "numpy", "pyarrow")
                                    if m in sys.modules)
import gc
loaded["young collection every"] = gc.get_threshold()[0]    # posttrain.process, set by main
print(json.dumps(loaded))
"""


def test_help_imports_no_heavy_module():
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": f"{ROOT}/lib:{ROOT}"})
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded.pop("young collection every") == 20_000
    assert len(loaded) >= 13
    assert all(mods == [] for mods in loaded.values()), loaded
