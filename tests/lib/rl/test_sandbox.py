"""The sandbox of model code, tested as an attacker would use it.

Each attack is its own case and asserts that the harm did not happen (a secret is not in the
output, a file is unchanged, a helper process is alive, a listener got no connection), not
only that an error kind came back. Attacks that the in-process audit hook would stop are also
run "unhooked": from a fresh interpreter the sandboxed code starts with ``allow_subprocess``
(exec'd interpreters carry no audit hook), so that the namespaces are what is tested.

The attacks need the isolated sandbox (`isolation() == "bwrap"`): `make setup` installs
bubblewrap; without it they fail, naming what is missing.
"""

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.errors import ConfigError
from posttrain.rl import sandbox
from posttrain.rl.sandbox import IsolationUnavailable, SandboxLimits, run_python

# FAST for code that never ends by itself; ROOMY for code that does, so that a slow start on a
# loaded machine cannot turn the outcome under test into a timeout.
FAST = SandboxLimits(timeout_s=1.0, cpu_s=2, memory_bytes=256 * 2**20)
ROOMY = SandboxLimits(timeout_s=30.0, cpu_s=10, memory_bytes=256 * 2**20)
MODES = ["hooked", "unhooked"]


@pytest.fixture(autouse=True, scope="module")
def _isolated():
    why = sandbox._probe_bwrap()
    assert sandbox.isolation() == "bwrap", f"no isolated sandbox here ({why}): `make setup`"


def attack(payload: str, mode: str, limits: SandboxLimits = ROOMY) -> sandbox.SandboxResult:
    """Run `payload` as the sandboxed code ("hooked"), or exec'd by it into a fresh interpreter
    without the audit hook ("unhooked")."""
    if mode == "hooked":
        return run_python(payload, limits)
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {payload!r}])"
    return run_python(code, SandboxLimits(**{**limits.__dict__, "allow_subprocess": True}))


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (killed, not yet reaped by init) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _host_pids_with(marker: str) -> list[int]:
    """Host processes whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            pass
    return [p for p in found if p != os.getpid() and _alive(p)]


def _gone_within(marker: str, seconds: float = 3.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _host_pids_with(marker):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def helper():
    """A process of the test's, with a secret in its environment; killed afterwards."""
    secret = "helper-secret-" + secrets.token_hex(8)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={"POSTTRAIN_HELPER_SECRET": secret})
    proc.secret = secret
    yield proc
    proc.kill()
    proc.wait()


# --------------------------------------------------------------------------- behaviour


def test_normal_code_returns_stdout():
    r = run_python("import math\nprint(sum(range(10)), math.sqrt(16))", ROOMY)
    assert r.ok and r.error is None and r.stdout == "45 4.0\n" and r.isolation == "bwrap"


def test_runs_in_a_private_scratch_dir_with_an_empty_env(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SECRET", "x")
    r = run_python("import os, sys\nprint(sorted(os.environ), sys.flags.isolated, os.getcwd(), "
                   "os.path.exists('left_over'))\nopen('left_over', 'w').write('x')", ROOMY)
    env, isolated, cwd, left_over = r.stdout.rsplit(maxsplit=3)
    # bwrap sets PWD, Python's locale coercion LC_CTYPE; nothing of the trainer's
    assert r.ok and set(eval(env)) <= {"LC_CTYPE", "PWD"}
    assert (isolated, cwd, left_over) == ("1", "/tmp", "False")
    again = run_python("import os\nprint(os.path.exists('left_over'))", ROOMY)
    assert again.stdout == "False\n"          # each run gets a fresh scratch dir


def test_sees_only_what_the_interpreter_needs():
    r = run_python("import os, sys\nprint(sorted(os.listdir('/')))\nprint(sys.path)\n"
                   "import json, ssl, sqlite3, decimal\nprint('stdlib ok')", ROOMY)
    assert r.ok, r.detail
    top, path, ok = r.stdout.splitlines()
    assert set(eval(top)) <= {"dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "root",
                              "sandbox", "tmp", "usr"}
    assert ok == "stdlib ok" and ".venv" not in path
    listing = run_python("import os\nprint(os.listdir(os.path.dirname(os.__file__) + "
                         "'/site-packages'))\nprint(sorted(os.listdir('/usr')))\n"
                         "print(os.listdir('/etc'))", ROOMY)
    site_packages, usr, etc = listing.stdout.splitlines()
    assert site_packages == "[]" and "bin" not in usr and etc == "['ld.so.cache']"


def test_infinite_loop_is_stopped_by_the_wall_clock_timeout():
    start = time.monotonic()
    r = run_python("while True:\n    pass", FAST)
    assert time.monotonic() - start < 5
    assert not r.ok and r.error == "timeout"


@pytest.mark.parametrize("mode", MODES)
def test_cpu_spin_is_stopped_by_the_cpu_limit(mode):
    r = attack("while True:\n    pass", mode, SandboxLimits(timeout_s=30, cpu_s=1))
    assert r.error == "timeout" and r.wall_s < 10


@pytest.mark.parametrize("mode", MODES)
def test_sleep_past_the_limit_is_killed_by_the_wall_clock(mode):
    marker = "sleeper-" + secrets.token_hex(6)
    r = attack(f"import time\n{marker!r}\ntime.sleep(60)", mode,
               SandboxLimits(timeout_s=1.0, cpu_s=2))
    assert r.error == "timeout" and r.wall_s < 4
    assert _gone_within(marker)


@pytest.mark.parametrize("mode", MODES)
def test_memory_exhaustion_is_stopped_by_the_memory_limit(mode):
    def rss_kib() -> int:
        return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])
    before = rss_kib()
    r = attack("x = []\nwhile True:\n    x.append(bytearray(10**7))", mode)
    assert not r.ok and r.error == "memory"
    assert rss_kib() - before < 32 * 1024            # none of it was charged to this process


@pytest.mark.parametrize("mode", MODES)
def test_the_rlimits_cannot_be_raised_back(mode):
    # The trainer runs as root here; inside the sandbox that is nobody without capabilities.
    r = attack("import resource\ninf = resource.RLIM_INFINITY\n"
               "for lim in (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE):\n"
               "    try:\n        resource.setrlimit(lim, (inf, inf))\n"
               "    except (ValueError, OSError) as e:\n        print('refused', e, flush=True)\n"
               "x = bytearray(600 * 2**20)\nprint('ALLOCATED')", mode)
    assert "ALLOCATED" not in r.stdout and r.error == "memory"
    assert r.stdout.count("refused") == 3


@pytest.mark.parametrize("mode", MODES)
def test_stdout_flood_is_capped(mode):
    limits = SandboxLimits(timeout_s=5, max_output_bytes=1000)
    r = attack("import sys\nwhile True:\n    sys.stdout.write('a' * 100_000)", mode, limits)
    assert not r.ok and r.error == "crash" and "output exceeded" in r.detail
    assert len(r.stdout) <= 1000


@pytest.mark.parametrize("mode", MODES)
def test_filling_the_scratch_dir_stops_at_its_size(mode):
    # Files of at most max_output_bytes each (RLIMIT_FSIZE), as many as the tmpfs takes.
    limits = SandboxLimits(timeout_s=30, scratch_bytes=4 * 2**20, max_output_bytes=2**16)
    r = attack("import os\ntotal = 0\ntry:\n    for i in range(10**6):\n"
               "        with open(f'f{i}', 'wb') as f:\n            f.write(b'x' * 2**16)\n"
               "        total += 2**16\nexcept OSError as e:\n    print(total, e.errno)", mode,
               limits)
    total, errno = r.stdout.split()
    assert int(total) <= 4 * 2**20 and errno == "28"       # ENOSPC


def test_network_access_is_reported():
    code = "import socket\ntry:\n    socket.create_connection(('10.255.255.1', 80), timeout=1)\n" \
           "except Exception:\n    print('caught')"
    r = run_python(code, ROOMY)
    assert not r.ok and r.error == "network" and "blocked" in r.detail
    assert "caught" not in r.stdout


def test_crash_is_reported_with_the_traceback_tail():
    r = run_python("print('before')\nraise ValueError('boom')", ROOMY)
    assert not r.ok and r.error == "crash" and "ValueError: boom" in r.detail
    assert r.stdout == "before\n"


@pytest.mark.parametrize("tail", ["import time\ntime.sleep(60)", "pass"])
def test_no_child_is_left_behind(tail):
    # A grandchild that would sleep for a minute must die with the sandbox both when the code
    # times out and when it exits normally.
    marker = "orphan-" + secrets.token_hex(6)
    code = ("import os, sys\nif os.fork() == 0:\n    os.execv(sys.executable, [sys.executable, "
            f"'-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "import time\ntime.sleep(0.3)\n" + tail)
    r = run_python(code, SandboxLimits(timeout_s=1.5, allow_subprocess=True))
    assert r.wall_s < 5
    assert _gone_within(marker)


# --------------------------------------------------------------------------- attacks


@pytest.mark.parametrize("mode", MODES)
def test_cannot_read_files_outside(tmp_path, mode):
    secret = "file-secret-" + secrets.token_hex(8)
    target = tmp_path / "secret.txt"
    target.write_text(secret)
    target.chmod(0o644)
    repo = Path(__file__).resolve().parents[3]
    r = attack("import os\nfor p in %r:\n    try:\n        print(open(p).read())\n"
               "    except OSError as e:\n        print('no', e.errno)\n"
               "for d in %r:\n    try:\n        print(os.listdir(d))\n"
               "    except OSError as e:\n        print('no', e.errno)\n"
               % ([str(target), str(repo / "pyproject.toml"), "/etc/passwd",
                   "/proc/1/root" + str(target)],
                  [str(tmp_path), str(repo), "/work", "/root", os.path.expanduser("~"),
                   os.path.dirname(sys.executable)]), mode)
    assert r.ok, r.detail
    assert secret not in r.stdout and "posttrain" not in r.stdout and "root:" not in r.stdout
    assert "secret.txt" not in r.stdout and "README" not in r.stdout
    assert "activate" not in r.stdout                 # the venv's bin


@pytest.mark.parametrize("mode", MODES)
def test_cannot_write_files_outside(tmp_path, mode):
    existing = tmp_path / "existing.txt"
    existing.write_text("original")
    existing.chmod(0o666)
    tmp_path.chmod(0o777)
    new = tmp_path / "pwned.txt"
    targets = [str(existing), str(new), "/pwned", "/usr/lib/pwned", "/etc/ld.so.cache",
               "/sandbox/main.py", os.path.dirname(os.__file__) + "/pwned.py"]
    r = attack("for p in %r:\n    try:\n        open(p, 'a').write('pwned')\n"
               "        print('WROTE', p)\n    except OSError as e:\n        print('no', e.errno)"
               % targets, mode)
    assert r.ok, r.detail
    assert existing.read_text() == "original" and not new.exists()
    assert not Path("/pwned").exists() and not Path("/usr/lib/pwned").exists()
    assert not Path(os.path.dirname(os.__file__), "pwned.py").exists()
    assert "WROTE" not in r.stdout


@pytest.mark.parametrize("mode", MODES)
def test_cannot_see_other_processes(helper, mode):
    r = attack("import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
               "print(len(pids))\nfor p in pids:\n    try:\n"
               "        print(p, open(f'/proc/{p}/cmdline', 'rb').read())\n"
               "    except OSError:\n        pass\n"
               f"print(os.path.exists('/proc/{helper.pid}'), os.path.exists('/proc/{os.getpid()}'))",
               mode)
    assert r.ok, r.detail
    lines = r.stdout.splitlines()
    # the sandbox's own: bwrap's init, the code (and, unhooked, nothing more: exec replaced it)
    assert int(lines[0]) <= 2
    assert "pytest" not in r.stdout and "time.sleep(60)" not in r.stdout
    if helper.pid > 2 and os.getpid() > 2:
        assert lines[-1] == "False False"


@pytest.mark.parametrize("mode", MODES)
def test_cannot_signal_the_parent_or_other_processes(helper, mode):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *a: received.append(a))
    try:
        r = attack(f"import os, signal\nfor pid, sig in (({os.getpid()}, signal.SIGUSR1), "
                   f"(os.getppid(), signal.SIGKILL), ({helper.pid}, signal.SIGKILL)):\n"
                   "    try:\n        os.kill(pid, sig)\n        print('SENT', pid)\n"
                   "    except OSError as e:\n        print('no', e.errno)\n"
                   f"try:\n    os.killpg({os.getpgid(helper.pid)}, signal.SIGKILL)\n"
                   "except OSError as e:\n    print('no', e.errno)\nprint('end')", mode)
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not received and _alive(helper.pid) and helper.poll() is None
    assert r.stdout.rstrip().endswith("end")


@pytest.mark.parametrize("mode", MODES)
def test_cannot_read_another_process_environment(helper, monkeypatch, mode):
    mine = "own-secret-" + secrets.token_hex(8)
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", mine)
    paths = [f"/proc/{helper.pid}/environ", f"/proc/{os.getpid()}/environ", "/proc/1/environ",
             "/proc/self/environ", f"/proc/{os.getppid()}/environ"]
    r = attack("for p in %r:\n    try:\n        print(open(p, 'rb').read())\n"
               "    except OSError as e:\n        print('no', e.errno)\n"
               "import os\nprint(dict(os.environ))" % paths, mode)
    assert r.ok, r.detail
    assert helper.secret not in r.stdout and mine not in r.stdout


@pytest.mark.parametrize("mode", MODES)
def test_cannot_reach_a_loopback_listener(mode):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        r = attack(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), "
                   "timeout=2).sendall(b'pwned')\n    print('CONNECTED')\n"
                   "except OSError as e:\n    print('no', e)", mode)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert "CONNECTED" not in r.stdout
    assert r.error == "network" if mode == "hooked" else r.ok


@pytest.mark.parametrize("mode", MODES)
def test_cannot_reach_an_abstract_unix_socket(mode):
    # Abstract unix sockets live in the network namespace, not the filesystem (bwrap's docs).
    name = "\0posttrain-test-" + secrets.token_hex(6)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(name)
        listener.listen(1)
        listener.settimeout(0.5)
        r = attack(f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n"
                   f"    s.connect({name!r})\n    s.sendall(b'pwned')\n    print('CONNECTED')\n"
                   "except OSError as e:\n    print('no', e)", mode)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert "CONNECTED" not in r.stdout


SPAWNS = {
    "subprocess": "import subprocess, sys\n"
                  "subprocess.run([sys.executable, '-c', CHILD])",
    "os.system": "import os, sys\nos.system(f'{sys.executable} -c \"{CHILD}\"')",
    "posix_spawn": "import os, sys\npid = os.posix_spawn(sys.executable, "
                   "[sys.executable, '-c', CHILD], {})\nos.waitpid(pid, 0)",
    "fork": "import os\npid = os.fork()\nif pid == 0:\n    exec(CHILD)\n    os._exit(0)\n"
            "os.waitpid(pid, 0)",
}


@pytest.mark.parametrize("how", sorted(SPAWNS))
def test_spawning_processes_is_blocked_by_default(how):
    # The child would leave a mark in the scratch dir; it must never have run.
    code = ("CHILD = \"open('/tmp/child_ran', 'w').write('x')\"\ntry:\n"
            + "".join("    " + line + "\n" for line in SPAWNS[how].splitlines())
            + "except Exception as e:\n    print('blocked', type(e).__name__)\n"
              "import os\nprint('RAN' if os.path.exists('/tmp/child_ran') else 'never ran')")
    r = run_python(code, ROOMY)
    assert r.ok, r.detail
    assert r.stdout.splitlines() == ["blocked PermissionError", "never ran"]


@pytest.mark.parametrize("mode", MODES)
def test_libc_through_ctypes_has_no_effect_outside(helper, tmp_path, mode):
    tmp_path.chmod(0o777)
    marker = tmp_path / "ctypes_pwned"
    r = attack("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               f"print('kill', libc.kill({helper.pid}, 9))\n"
               f"print('system', libc.system(b'touch {marker}'))\n"
               f"fd = libc.open(b'{marker}', 0o101, 0o644)\nprint('open', fd)", mode)
    time.sleep(0.1)
    assert _alive(helper.pid) and not marker.exists()
    if mode == "hooked":
        assert r.error == "crash" and "not allowed" in r.detail
    else:
        assert "open -1" in r.stdout


@pytest.mark.parametrize("mode", MODES)
def test_cannot_ptrace_another_process(helper, mode):
    r = attack("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               f"print(libc.ptrace(16, {helper.pid}, 0, 0), ctypes.get_errno())\n"   # ATTACH
               f"print(libc.ptrace(16, {os.getpid()}, 0, 0), ctypes.get_errno())", mode)
    time.sleep(0.1)
    status = Path(f"/proc/{helper.pid}/status").read_text()
    assert "TracerPid:\t0\n" in status and _alive(helper.pid)
    if mode == "unhooked":
        assert [line.split()[0] for line in r.stdout.splitlines()] == ["-1", "-1"]


def test_cannot_create_namespaces_to_regain_capabilities():
    # unshare(CLONE_NEWUSER) would give it root with all capabilities in a new namespace.
    r = attack("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "print(libc.unshare(0x10000000), libc.unshare(0x00020000))", "unhooked")
    assert r.stdout.split() == ["-1", "-1"]


@pytest.mark.parametrize("mode", MODES)
def test_cannot_inject_into_a_terminal_with_tiocsti(mode):
    # The escape bwrap's --new-session closes (CVE-2017-5226): push keystrokes into the
    # controlling terminal's input. The sandbox has no controlling terminal to push into.
    r = attack("import fcntl, os, termios\nfor fd in (0, 1, 2):\n    try:\n"
               "        fcntl.ioctl(fd, termios.TIOCSTI, b'x')\n        print('INJECTED', fd)\n"
               "    except OSError as e:\n        print('no', e.errno)\ntry:\n"
               "    os.open('/dev/tty', os.O_RDWR)\n    print('TTY')\nexcept OSError as e:\n"
               "    print('no', e.errno)", mode)
    assert r.ok, r.detail
    assert "INJECTED" not in r.stdout and "TTY" not in r.stdout


@pytest.mark.parametrize("mode", MODES)
def test_cannot_write_proc_or_sys_knobs(mode):
    r = attack("for p, v in (('/proc/self/oom_score_adj', '-1000'), ('/proc/sysrq-trigger', 'h'),"
               " ('/proc/sys/kernel/hostname', 'pwned'), ('/proc/sys/vm/drop_caches', '1')):\n"
               "    try:\n        with open(p, 'w') as f:\n            f.write(v)\n"
               "        print('WROTE', p)\n    except OSError as e:\n        print('no', e.errno)\n"
               "print(open('/proc/self/oom_score_adj').read().strip())", mode)
    assert r.ok, r.detail
    # the sysctls are global (drop_caches) or the sandbox's own (hostname): none is writable
    assert "WROTE" not in r.stdout and r.stdout.split()[-1] != "-1000"
    assert socket.gethostname() != "pwned"


# --------------------------------------------------------------------------- detection


def test_detection_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert sandbox._probe_bwrap.__wrapped__() == "no `bwrap` on PATH"


@pytest.fixture
def no_isolation(monkeypatch):
    monkeypatch.setattr(sandbox, "isolation", lambda: None)
    monkeypatch.setattr(sandbox, "_probe_bwrap", lambda: "no `bwrap` on PATH")


def test_without_isolation_code_refuses_to_run(no_isolation):
    with pytest.raises(IsolationUnavailable, match=r"bubblewrap.*no `bwrap` on PATH.*weak"):
        run_python("print(1)", ROOMY)


def test_the_weak_mode_runs_only_when_asked(no_isolation):
    r = run_python("print(1)", SandboxLimits(timeout_s=30, isolation="weak"))
    assert r.ok and r.stdout == "1\n" and r.isolation == "weak"


def test_code_rewards_and_the_python_tool_refuse_at_config_time(no_isolation):
    from posttrain.rl.environment import EnvironmentConfig
    from posttrain.rl.rewards import RewardSpec
    with pytest.raises(ConfigError, match=r"python_exec.*bubblewrap.*"
                                          r"rewards\.functions\[python_exec\]\.params\.isolation"):
        RewardSpec("python_exec")
    with pytest.raises(ConfigError, match=r"bubblewrap.*environment\.params\.isolation: weak"):
        EnvironmentConfig(kind="tools", params={"tools": ["calculator", "python"]})
    # the calculator alone runs no code; the weak mode is accepted when asked for
    EnvironmentConfig(kind="tools", params={"tools": ["calculator"]})
    RewardSpec("python_exec", params={"isolation": "weak"})
    EnvironmentConfig(kind="tools", params={"tools": ["python"], "isolation": "weak"})


def test_run_counts_record_the_mechanism():
    before = sandbox.run_counts().get("bwrap", 0)
    run_python("pass", ROOMY)
    assert sandbox.run_counts()["bwrap"] == before + 1
