"""Worker-seconds per test directory from a `pytest --durations=0` log (tests/README.md's
budgets), then the N most expensive files.

    python -m pytest -n 2 --dist loadfile --durations=0 -m "not long" tests > suite.log
    python tools/suite_budget.py suite.log [N]
"""
import re, sys
from collections import defaultdict
per_dir, per_file = defaultdict(float), defaultdict(float)
for line in open(sys.argv[1]):
    m = re.match(r"\s*([\d.]+)s (setup|call|teardown)\s+(\S+?)::", line)
    if not m:
        continue
    sec, path = float(m.group(1)), m.group(3)
    parts = path.split("/")
    d = "/".join(parts[:3]) if parts[1] == "lib" and len(parts) > 3 else "/".join(parts[:2])
    per_dir[d] += sec
    per_file[path] += sec
total = sum(per_dir.values())
print(f"total worker-seconds {total:.0f}")
for d, s in sorted(per_dir.items(), key=lambda x: -x[1]):
    print(f"{s:8.0f}  {d}")
print()
for f, s in sorted(per_file.items(), key=lambda x: -x[1])[:int(sys.argv[2]) if len(sys.argv) > 2 else 30]:
    print(f"{s:8.0f}  {f}")
