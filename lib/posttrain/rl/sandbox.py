"""Run untrusted Python (model output) in a separate, isolated, limited process.

`run_python(code, limits)` runs ``code`` with the interpreter of ``sys.executable`` in isolated
mode (``-I``: no user site, no ``PYTHON*`` variables, the cwd not on ``sys.path``) and returns
a `SandboxResult` ``(ok, stdout, error)`` with ``error`` one of ``timeout | memory | crash |
network`` (None when ``ok``).

**Isolation** (`isolation()` says which mechanism works here; probed once per process):

- ``"bwrap"``: bubblewrap (Debian package ``bubblewrap``; ``make setup`` installs it), the
  unprivileged sandbox Flatpak uses. The code runs in new user, mount, PID, network, IPC, UTS
  and cgroup namespaces (``--unshare-all --unshare-user``) as uid/gid 65534 with every
  capability dropped and no further user namespaces (``--disable-userns``), in a new session
  (``--new-session``: no TIOCSTI into the trainer's terminal), with an empty environment
  (``--clearenv``). Its filesystem is a read-only root holding only what the interpreter
  needs: the executable, its standard library (``site-packages`` hidden under an empty
  read-only tmpfs), ``libpython``, ``/usr/lib`` and ``/lib*`` (shared libraries) and
  ``/etc/ld.so.cache``; ``/proc`` of its own PID namespace; a minimal read-only ``/dev``;
  the code itself read-only at ``/sandbox/main.py``; and one writable scratch directory,
  ``/tmp`` (its cwd), a private tmpfs of ``scratch_bytes``. Nothing of the trainer (its
  files, home, data, checkpoints, the repository, the venv) is visible; the trainer and every
  other process are in another PID namespace (invisible, unsignalable, not ptraceable); the
  network namespace is empty (loopback down; no abstract unix sockets of the host).
  ``--die-with-parent`` and killing bwrap's process group end the whole PID namespace.
- none: nothing above works here (no ``bwrap``, or user namespaces disabled). Then
  `run_python` refuses (`IsolationUnavailable`) unless the limits say ``isolation: "weak"``,
  which runs the code as a plain child process: rlimits, the audit hook, an empty
  environment, a fresh temporary cwd and, where ``unshare -n``/``-rn`` works
  (`network_namespace_prefix()`), an empty network namespace. Callers check at config time
  with `require_isolation` so that a run fails at launch, not at its first rollout.

**Limits**, all in `SandboxLimits`, inside either mode:

- wall clock: the whole process group (bwrap and so its PID namespace) is SIGKILLed after
  ``timeout_s``;
- CPU time (``RLIMIT_CPU``) and address space (``RLIMIT_AS``), soft = hard so that the code
  cannot raise them back (raising a hard limit needs CAP_SYS_RESOURCE in the host's user
  namespace, which the bwrap sandbox never has; a weak sandbox under a root trainer has it);
- output: stdout and stderr go to files under ``RLIMIT_FSIZE``; a write past
  ``max_output_bytes`` fails (EFBIG; Python ignores SIGXFSZ), reported as a crash, and the
  stdout returned is cut at the cap;
- an audit hook installed before the code runs ends the process (exit code
  `NETWORK_EXIT_CODE`) at the first ``socket.*`` event (creation, connect, DNS look-up), so
  a network attempt is reported as such; process spawning (``os.system``, ``subprocess``,
  ``fork``, ``exec``) raises ``PermissionError`` unless ``allow_subprocess``, and ``ctypes``
  always does. The hook is in-process and best-effort (a child interpreter started with
  ``allow_subprocess`` has none): the namespaces above are the isolation, the hook only makes
  the common failures legible.

The rlimits are set by the child's bootstrap, before the code is compiled, rather than in a
``preexec_fn``: ``preexec_fn`` may deadlock when the parent has threads, and `python_exec`
rewards run sandboxes from a thread pool.

**How it is tested**: tests/lib/rl/test_sandbox.py attacks it, each attack asserting that the
harm did not happen, and each run twice where it matters: as written and from a child
interpreter without the audit hook (``allow_subprocess``): reading and writing files outside,
listing, signalling and ptracing other processes (the test's own and a helper it starts),
reading their environment, connecting to a loopback TCP listener and an abstract unix socket
the test opens, spawning processes, libc through ctypes, TIOCSTI, memory, CPU, sleep and
output floods, filling the scratch directory, leaving a child behind.

**What it does not cover**: kernel exploits (there is no seccomp filter: the code may make any
system call, within its namespaces), CPU and memory side channels, and the host's global
``/proc`` files (``/proc/meminfo``, ``/proc/cpuinfo``) and kernel version, which it can read.
With ``allow_subprocess`` the number of processes is bounded only by the wall clock (no cgroup
``pids.max``). bwrap maps the sandbox's uid to the trainer's: under a root trainer it is host
root without capabilities, so what is visible and owned by root and writable by its owner is
writable (hence ``/proc/sys`` covered read-only); run trainers as a non-root user where you can.
For hostile workloads at scale add a VM boundary (gVisor, Firecracker).
"""

from __future__ import annotations

import collections
import functools
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ErrorKind = Literal["timeout", "memory", "crash", "network"]
IsolationMode = Literal["required", "weak"]

NETWORK_EXIT_CODE = 113
MEMORY_EXIT_CODE = 114
# Where the code file and the scratch directory appear inside a bwrap sandbox.
SANDBOX_CODE = "/sandbox/main.py"
SANDBOX_SCRATCH = "/tmp"
# The unprivileged uid/gid the code runs as inside the sandbox's user namespace.
SANDBOX_UID = 65534

# Runs in the child before the untrusted code. Nothing the hook needs is reachable from the
# code's globals: the hook is a closure, and gc/frame introspection that could find it is blocked.
_BOOTSTRAP = r"""
import os, resource, sys
_cpu_s, _as_bytes, _out_bytes, _allow_proc = (int(a) for a in sys.argv[2:6])
resource.setrlimit(resource.RLIMIT_CPU, (_cpu_s, _cpu_s))
resource.setrlimit(resource.RLIMIT_AS, (_as_bytes, _as_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (_out_bytes, _out_bytes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

def _make_hook(exit_=os._exit, write=os.write, allow_proc=bool(_allow_proc)):
    proc_events = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "subprocess.Popen", "pty.spawn", "ctypes.dlopen",
                   "ctypes.dlsym", "ctypes.cdata", "gc.get_objects", "gc.get_referrers",
                   "gc.get_referents", "sys._current_frames")
    def hook(event, args):
        if event.startswith("socket."):
            write(2, ("sandbox: network access blocked (%%s)\n" %% event).encode())
            exit_(%(net)d)
        if event in proc_events and (not allow_proc or event.startswith(("ctypes", "gc", "sys"))):
            raise PermissionError("sandbox: %%s is not allowed" %% event)
    return hook

sys.addaudithook(_make_hook())
del _make_hook
with open(sys.argv[1], encoding="utf-8") as _f:
    _code = compile(_f.read(), "<sandboxed>", "exec")
try:
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
except MemoryError:
    os.write(2, b"MemoryError\n")
    os._exit(%(mem)d)
""" % {"net": NETWORK_EXIT_CODE, "mem": MEMORY_EXIT_CODE}



@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20
    max_output_bytes: int = 64 * 2**10
    # The private writable /tmp of a bwrap sandbox (a tmpfs: host memory, so bounded).
    scratch_bytes: int = 16 * 2**20
    # Allow fork/exec/subprocess inside the sandbox (the whole sandbox is still killed).
    allow_subprocess: bool = False
    # "required": refuse to run without an isolation mechanism (`isolation()`); "weak": then
    # run with the rlimits and the audit hook only (module docstring).
    isolation: IsolationMode = "required"
    # Weak mode only: also run in an empty network namespace when `unshare` allows it.
    network_namespace: bool = True

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.cpu_s <= 0:
            raise ValueError("sandbox timeout_s and cpu_s must be > 0")
        if self.memory_bytes < 64 * 2**20:
            raise ValueError(f"sandbox memory_bytes={self.memory_bytes} is below 64 MiB: "
                             "the interpreter itself does not start under that")
        if self.max_output_bytes <= 0 or self.scratch_bytes <= 0:
            raise ValueError("sandbox max_output_bytes and scratch_bytes must be > 0")
        if self.isolation not in ("required", "weak"):
            raise ValueError(f"sandbox isolation must be 'required' or 'weak', got "
                             f"{self.isolation!r}")


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    stdout: str
    error: ErrorKind | None = None
    detail: str = ""  # the tail of stderr, or why the run was stopped
    wall_s: float = 0.0
    isolation: str = ""  # the mechanism it ran under: "bwrap", or "weak"


class IsolationUnavailable(ValueError):
    """No isolation mechanism works here and the limits did not accept the weak mode."""


def require_isolation(mode: IsolationMode, key: str) -> str | None:
    """The mechanism sandboxes will run under (`isolation()`), or None when `mode` is "weak"
    and none works; raises `IsolationUnavailable` naming config `key` (the switch that
    accepts the weak mode) when `mode` is "required" and none works. Call it at config time."""
    if mode not in ("required", "weak"):
        raise ValueError(f"{key} must be 'required' or 'weak', got {mode!r}")
    found = isolation()
    if found is None and mode == "required":
        raise IsolationUnavailable(
            f"running model code needs an isolated sandbox: bubblewrap (`apt-get install "
            f"bubblewrap`, or `make setup` as root) with working user namespaces; none works "
            f"here ({_why_not()}). Set {key}: weak to run it with rlimits and an audit hook "
            "only (no filesystem or process isolation)")
    return found


@functools.cache
def isolation() -> str | None:
    """``"bwrap"`` when a bubblewrap sandbox starts here (probed once: a real run of the
    interpreter inside it), else None."""
    return "bwrap" if _probe_bwrap() is None else None


def _why_not() -> str:
    return _probe_bwrap() or "it works"


@functools.cache
def _probe_bwrap() -> str | None:
    """None when a bwrap sandbox runs the interpreter here, else why not."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "no `bwrap` on PATH"
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-probe-") as tmp:
        code = Path(tmp) / "main.py"
        code.write_text("", encoding="utf-8")
        try:
            done = subprocess.run([*_bwrap_argv(bwrap, code, SandboxLimits()), "-c", "pass"],
                                  capture_output=True, timeout=30, env={})
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"`bwrap` failed to start: {e}"
    if done.returncode != 0:
        return f"`bwrap` exited {done.returncode}: {done.stderr.decode(errors='replace')[-300:]}"
    return None


def _bwrap_argv(bwrap: str, code: Path, limits: SandboxLimits) -> list[str]:
    """bwrap's command line up to the interpreter (module docstring, "bwrap")."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--cap-drop", "ALL",
            "--die-with-parent", "--new-session", "--clearenv", "--hostname", "sandbox"]
    for path in ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32",
                 "/usr/lib64"):
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    if os.path.exists("/etc/ld.so.cache"):
        argv += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for path in _interpreter_paths():
        argv += ["--ro-bind", path, path]
    for hidden in _site_packages():
        argv += ["--tmpfs", hidden, "--remount-ro", hidden]
    argv += ["--proc", "/proc"]
    # bwrap covers the writable /proc/irq and /proc/bus, but not /proc/sys: its directories
    # are read-only and so skipped, while the sysctl files are writable by their owner, host
    # root, which is who the sandbox's uid is when the trainer runs as root.
    for knob in ("/proc/sys", "/proc/sysrq-trigger"):
        if os.path.exists(knob):
            argv += ["--ro-bind", knob, knob]
    argv += ["--dev", "/dev", "--remount-ro", "/dev",
             "--size", str(limits.scratch_bytes), "--tmpfs", SANDBOX_SCRATCH,
             "--ro-bind", str(code), SANDBOX_CODE, "--chdir", SANDBOX_SCRATCH,
             "--remount-ro", "/", _interpreter()]
    return argv


def _interpreter() -> str:
    """The real interpreter behind ``sys.executable`` (a venv's python is a link to it): run
    directly, it has only the standard library on its path, not the venv's packages."""
    return os.path.realpath(sys.executable)


@functools.cache
def _interpreter_paths() -> tuple[str, ...]:
    """The executable, the standard library and libpython (when shared), at their paths."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    paths = {_interpreter(), sysconfig.get_path("stdlib", vars=base),
             sysconfig.get_path("platstdlib", vars=base)}
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and soname:
        paths.add(os.path.join(libdir, soname))
    covered = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib/", "/usr/lib32/", "/usr/lib64/")
    return tuple(sorted(p for p in paths
                        if p and os.path.exists(p) and not p.startswith(covered)))


@functools.cache
def _site_packages() -> tuple[str, ...]:
    """The base interpreter's site-packages inside what is bound: hidden in the sandbox."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    return tuple(sorted({p for p in (sysconfig.get_path(k, vars=base)
                                     for k in ("purelib", "platlib")) if os.path.isdir(p)}))


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """Weak mode: ``("unshare", "-n")`` or ``("unshare", "-rn")`` where one works here, else
    ``()``."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ((unshare, "-n"), (unshare, "-rn")):
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0:
            return prefix
    return ()


_RUNS: collections.Counter[str] = collections.Counter()
_RUNS_LOCK = threading.Lock()


def run_counts() -> dict[str, int]:
    """How many sandboxes this process has run, by mechanism ("bwrap", "weak")."""
    with _RUNS_LOCK:
        return dict(_RUNS)


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` under `limits`; never raises for anything the code does (raises
    `IsolationUnavailable` when no mechanism works and `limits.isolation` is "required")."""
    mechanism = require_isolation(limits.isolation, "sandbox isolation") or "weak"
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as tmp:
        tmp_path = Path(tmp)
        source = tmp_path / "main.py"
        source.write_text(code, encoding="utf-8")
        if mechanism == "bwrap":
            argv = [*_bwrap_argv(shutil.which("bwrap") or "bwrap", source, limits), "-I",
                    "-c", _BOOTSTRAP, SANDBOX_CODE]
            cwd = "/"
        else:
            prefix = network_namespace_prefix() if limits.network_namespace else ()
            argv = [*prefix, sys.executable, "-I", "-c", _BOOTSTRAP, str(source)]
            cwd = tmp
        argv += [str(limits.cpu_s), str(limits.memory_bytes), str(limits.max_output_bytes),
                 str(int(limits.allow_subprocess))]
        start = time.monotonic()
        with open(tmp_path / "stdout", "wb") as out, open(tmp_path / "stderr", "wb") as err:
            proc = subprocess.Popen(argv, cwd=cwd, env={}, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            # Also after a normal exit: a background child left in the group must not outlive
            # us (bwrap: killing it ends its PID namespace, --die-with-parent).
            _kill_group(proc.pid)
            proc.wait()
        wall_s = time.monotonic() - start
        stdout = _read_capped(tmp_path / "stdout", limits.max_output_bytes)
        stderr = _read_capped(tmp_path / "stderr", limits.max_output_bytes)
    with _RUNS_LOCK:
        _RUNS[mechanism] += 1
    error, detail = _classify(proc.returncode, timed_out, stderr, limits)
    return SandboxResult(ok=error is None, stdout=stdout, error=error, detail=detail,
                         wall_s=wall_s, isolation=mechanism)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(path: Path, max_bytes: int) -> str:
    with open(path, "rb") as f:
        return f.read(max_bytes).decode("utf-8", errors="replace")


def _signalled(returncode: int, sig: int) -> bool:
    """Killed by `sig`: directly (-sig) or reported by bwrap as 128 + sig."""
    return returncode in (-sig, 128 + sig)


def _classify(returncode: int, timed_out: bool, stderr: str,
              limits: SandboxLimits) -> tuple[ErrorKind | None, str]:
    tail = stderr[-2000:]
    if timed_out:
        return "timeout", f"wall-clock timeout after {limits.timeout_s} s"
    if returncode == NETWORK_EXIT_CODE:
        return "network", tail
    if returncode == MEMORY_EXIT_CODE or "MemoryError" in tail or "bad_alloc" in tail:
        return "memory", f"address-space limit of {limits.memory_bytes} bytes: {tail}"
    if _signalled(returncode, signal.SIGXCPU) or _signalled(returncode, signal.SIGKILL):
        return "timeout", f"CPU-time limit of {limits.cpu_s} s"
    if _signalled(returncode, signal.SIGXFSZ) or "[Errno 27] File too large" in tail:
        return "crash", f"output exceeded {limits.max_output_bytes} bytes"
    if returncode != 0:
        return "crash", f"exit code {returncode}: {tail}"
    return None, ""
