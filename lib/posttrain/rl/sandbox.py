"""Run untrusted Python (model output) in a separate, limited process.

`run_python(code, limits)` starts ``sys.executable -I`` (isolated mode: no user site, no
``PYTHON*`` variables, the cwd not on ``sys.path``) in a new session with an empty environment
and a fresh temporary cwd, and returns a `SandboxResult` ``(ok, stdout, error)`` with ``error``
one of ``timeout | memory | crash | network`` (None when ``ok``).

Limits, all in `SandboxLimits`:

- wall clock: the whole process group is SIGKILLed after ``timeout_s``;
- CPU time (``RLIMIT_CPU``) and address space (``RLIMIT_AS``), soft = hard so that the code
  cannot raise them back (unless it runs as real root, see below);
- output: stdout and stderr go to files in the temp dir under ``RLIMIT_FSIZE``; a write past
  ``max_output_bytes`` fails (EFBIG; Python ignores SIGXFSZ), reported as a crash, and the
  stdout returned is cut at the cap;
- network: an audit hook installed before the code runs ends the process (exit code
  `NETWORK_EXIT_CODE`) at the first ``socket.*`` event (creation, connect, DNS look-up); process
  spawning (``os.system``, ``subprocess``, ``fork``, ``exec``) and ``ctypes`` raise
  ``PermissionError`` unless ``allow_subprocess``.

The rlimits are set by the child's bootstrap, before the code is compiled, rather than in a
``preexec_fn``: ``preexec_fn`` may deadlock when the parent has threads, and `python_exec`
rewards run sandboxes from a thread pool.

What this is not: an audit hook is in-process and best-effort (code that reaches C, e.g. through
an installed extension module, can bypass it). Real isolation needs a network namespace or a
container (gVisor, Firecracker, nsjail). When ``unshare -n`` (or, unprivileged, ``unshare -rn``)
works on this machine, the child also runs in an empty network namespace (loopback only, down);
`network_namespace_prefix()` says which. Running the trainer as root weakens the rlimits (root
may raise hard limits): use a container with dropped capabilities for untrusted workloads.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ErrorKind = Literal["timeout", "memory", "crash", "network"]

NETWORK_EXIT_CODE = 113
MEMORY_EXIT_CODE = 114

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
    # Allow fork/exec/subprocess inside the sandbox (the process group is still killed).
    allow_subprocess: bool = False
    # Also run in an empty network namespace when `unshare` allows it.
    network_namespace: bool = True

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.cpu_s <= 0:
            raise ValueError("sandbox timeout_s and cpu_s must be > 0")
        if self.memory_bytes < 64 * 2**20:
            raise ValueError(f"sandbox memory_bytes={self.memory_bytes} is below 64 MiB: "
                             "the interpreter itself does not start under that")
        if self.max_output_bytes <= 0:
            raise ValueError("sandbox max_output_bytes must be > 0")


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    stdout: str
    error: ErrorKind | None = None
    detail: str = ""  # the tail of stderr, or why the run was stopped
    wall_s: float = 0.0


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """``("unshare", "-n")`` or ``("unshare", "-rn")`` where one works here, else ``()``."""
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


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` under `limits`; never raises for anything the code does."""
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as tmp:
        tmp_path = Path(tmp)
        source = tmp_path / "main.py"
        source.write_text(code, encoding="utf-8")
        prefix = network_namespace_prefix() if limits.network_namespace else ()
        argv = [*prefix, sys.executable, "-I", "-c", _BOOTSTRAP, str(source), str(limits.cpu_s),
                str(limits.memory_bytes), str(limits.max_output_bytes),
                str(int(limits.allow_subprocess))]
        start = time.monotonic()
        with open(tmp_path / "stdout", "wb") as out, open(tmp_path / "stderr", "wb") as err:
            proc = subprocess.Popen(argv, cwd=tmp, env={}, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            # Also after a normal exit: a background child left in the group must not outlive us.
            _kill_group(proc.pid)
            proc.wait()
        wall_s = time.monotonic() - start
        stdout = _read_capped(tmp_path / "stdout", limits.max_output_bytes)
        stderr = _read_capped(tmp_path / "stderr", limits.max_output_bytes)
    error, detail = _classify(proc.returncode, timed_out, stderr, limits)
    return SandboxResult(ok=error is None, stdout=stdout, error=error, detail=detail,
                         wall_s=wall_s)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(path: Path, max_bytes: int) -> str:
    with open(path, "rb") as f:
        return f.read(max_bytes).decode("utf-8", errors="replace")


def _classify(returncode: int, timed_out: bool, stderr: str,
              limits: SandboxLimits) -> tuple[ErrorKind | None, str]:
    tail = stderr[-2000:]
    if timed_out:
        return "timeout", f"wall-clock timeout after {limits.timeout_s} s"
    if returncode == NETWORK_EXIT_CODE:
        return "network", tail
    if returncode == MEMORY_EXIT_CODE or "MemoryError" in tail or "bad_alloc" in tail:
        return "memory", f"address-space limit of {limits.memory_bytes} bytes: {tail}"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout", f"CPU-time limit of {limits.cpu_s} s"
    if returncode == -signal.SIGXFSZ or "[Errno 27] File too large" in tail:
        return "crash", f"output exceeded {limits.max_output_bytes} bytes"
    if returncode != 0:
        return "crash", f"exit code {returncode}: {tail}"
    return None, ""
