import os
import time
from pathlib import Path

import pytest

from posttrain.rl.sandbox import SandboxLimits, run_python

# FAST for code that never ends by itself; ROOMY for code that does, so that a slow start on a
# loaded machine cannot turn the outcome under test into a timeout.
FAST = SandboxLimits(timeout_s=1.0, cpu_s=2, memory_bytes=256 * 2**20)
ROOMY = SandboxLimits(timeout_s=30.0, cpu_s=10, memory_bytes=256 * 2**20)


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (killed, not yet reaped by init) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _gone_within(pid: int, seconds: float = 3.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_alive_probe():
    assert _alive(os.getpid())


def test_normal_code_returns_stdout():
    r = run_python("import math\nprint(sum(range(10)), math.sqrt(16))", ROOMY)
    assert r.ok and r.error is None and r.stdout == "45 4.0\n"


def test_runs_isolated_in_a_temp_dir_with_an_empty_env(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SECRET", "x")
    r = run_python("import os, sys\nprint('POSTTRAIN_SECRET' in os.environ, 'HOME' in os.environ,"
                   " sys.flags.isolated, os.getcwd())", ROOMY)
    secret, home, isolated, cwd = r.stdout.split()
    assert (secret, home, isolated) == ("False", "False", "1")
    assert "posttrain-sandbox-" in cwd and cwd != os.getcwd()
    assert not Path(cwd).exists()  # removed afterwards


def test_infinite_loop_is_stopped_by_the_wall_clock_timeout():
    start = time.monotonic()
    r = run_python("while True:\n    pass", FAST)
    assert time.monotonic() - start < 5
    assert not r.ok and r.error == "timeout"


def test_cpu_limit_stops_a_loop_under_a_long_wall_clock():
    r = run_python("while True:\n    pass", SandboxLimits(timeout_s=30, cpu_s=1))
    assert r.error == "timeout" and "CPU" in r.detail and r.wall_s < 10


def test_unbounded_allocation_is_stopped_by_the_memory_limit():
    r = run_python("x = []\nwhile True:\n    x.append(bytearray(10**7))", ROOMY)
    assert not r.ok and r.error == "memory"


@pytest.mark.parametrize("code", [
    "import socket\ns = socket.socket()\ns.connect(('10.255.255.1', 80))",
    # Catching the exception does not help: the first socket event ends the process.
    "import socket\ntry:\n    socket.create_connection(('example.com', 80), timeout=1)\n"
    "except Exception:\n    print('caught')",
    "import urllib.request\nurllib.request.urlopen('http://10.255.255.1', timeout=1)",
])
def test_network_access_fails_and_is_reported(code):
    r = run_python(code, ROOMY)
    assert not r.ok and r.error == "network" and "blocked" in r.detail
    assert "caught" not in r.stdout


def test_crash_is_reported_with_the_traceback_tail():
    r = run_python("print('before')\nraise ValueError('boom')", ROOMY)
    assert not r.ok and r.error == "crash" and "ValueError: boom" in r.detail
    assert r.stdout == "before\n"


def test_process_spawning_is_blocked_by_default():
    r = run_python("import os\nos.system('echo escaped')", ROOMY)
    assert r.error == "crash" and "not allowed" in r.detail and "escaped" not in r.stdout


def test_output_is_capped():
    limits = SandboxLimits(timeout_s=2, max_output_bytes=1000)
    r = run_python("print('a' * 100_000)", limits)
    assert not r.ok and r.error == "crash" and "output exceeded" in r.detail
    assert len(r.stdout) <= 1000


@pytest.mark.parametrize("parent_tail", ["import time\ntime.sleep(60)", "pass"])
def test_no_child_is_left_behind(parent_tail):
    # The grandchild would sleep for a minute; the whole process group must be killed both when
    # the parent times out and when it exits normally.
    code = ("import os, sys, time\npid = os.fork()\nif pid == 0:\n    time.sleep(60)\n"
            "    os._exit(0)\nprint(pid, flush=True)\n" + parent_tail)
    limits = SandboxLimits(timeout_s=1.0, allow_subprocess=True)
    r = run_python(code, limits)
    assert r.wall_s < 5
    grandchild = int(r.stdout.split()[0])
    assert grandchild != os.getpid() and _gone_within(grandchild)
