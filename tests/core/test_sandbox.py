"""The code sandbox, with hostile samples.

Each hostile sample is written so that its check would pass if the attack worked: it must come back
as a failed sample within its limit, leave nothing outside its temporary folder (no file, no process,
no folder in /tmp) and leave the scoring process unharmed. A correct and a wrong sample show that the
harness works both ways.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mergecompose.core.sandbox import (
    SANDBOX_UID,
    TAIL_CHARS,
    TEMP_PREFIX,
    SandboxLimits,
    run_program,
    run_tests,
    run_tests_many,
    sandbox_available,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox needs root (this machine and CI are)")

QUICK = SandboxLimits(wall_seconds=3.0, cpu_seconds=1)
MARGIN_SECONDS = 5.0  # generous: the result comes back within the wall-clock limit plus this


def sample(code: str) -> str:
    """A program written indented in a test, as the sandbox gets it (HumanEval-shaped: code, then `check`)."""
    return textwrap.dedent(code)


def sandbox_processes() -> set[int]:
    """Pids of processes running as the sandbox's uid, on the whole host."""
    pids = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue  # ended while we read
        if int(uid_line.split()[1]) == SANDBOX_UID:
            pids.add(int(status.parent.name))
    return pids


def sandbox_folders() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith(TEMP_PREFIX)}


@pytest.fixture(autouse=True)
def leaves_nothing() -> Iterator[None]:
    """After every test: no temporary folder left in /tmp, no process of the sandbox's uid left."""
    folders, processes = sandbox_folders(), sandbox_processes()
    yield
    assert sandbox_folders() - folders == set()
    assert sandbox_processes() - processes == set()


def test_the_sandbox_works_here() -> None:
    assert sandbox_available() is None


def test_a_correct_sample_passes_with_the_guards_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERGECOMPOSE_SANDBOX_SECRET", "must-not-reach-the-sample")
    program = sample(
        """
        import collections, hashlib, heapq, itertools, math, os, re, string, sys

        def solve(words):
            return collections.Counter(itertools.chain.from_iterable(words)).most_common(1)[0][0]

        def check(candidate):
            assert candidate(["abc", "cd", "c"]) == "c"
            assert heapq.nsmallest(1, [3, 1]) == [1] and math.gcd(12, 18) == 6 and re.fullmatch(r"\\d+", "42")
            assert hashlib.sha256(string.ascii_lowercase.encode()).hexdigest()[:8] == "71c480df"
            assert (os.getuid(), os.getgid(), os.getgroups()) == (65534, 65534, [])
            assert os.getppid() == 1  # pid 1 of a PID namespace is the launcher
            assert os.getcwd() == "/tmp/sample" and os.environ["HOME"] == "/tmp/sample"
            assert "MERGECOMPOSE_SANDBOX_SECRET" not in os.environ
            assert sys.flags.isolated and sys.flags.no_site
            assert os.statvfs("/").f_flag & os.ST_RDONLY and os.statvfs("/").f_flag & os.ST_NOSUID
            assert set(os.listdir("/proc/self/fd")) <= {"0", "1", "2", "3"}  # 3: the listing's own
        """
    )
    result = run_tests(program, "check(solve)", QUICK)
    assert result.status == "passed", result
    assert result.passed and result.returncode == 0
    assert not os.statvfs("/").f_flag & os.ST_RDONLY  # the read-only remounts stayed in the sandbox
    assert result.seconds < QUICK.wall_seconds + MARGIN_SECONDS


def test_a_wrong_sample_fails() -> None:
    program = sample(
        """
        def solve(x):
            return x - 1

        def check(candidate):
            assert candidate(1) == 2
        """
    )
    result = run_tests(program, "check(solve)", QUICK)
    assert (result.status, result.passed, result.returncode) == ("failed", False, 1)
    assert "AssertionError" in result.stderr


@pytest.mark.parametrize("exit_call", ["sys.exit(0)", "os._exit(0)", "raise SystemExit"])
def test_an_early_exit_with_code_0_does_not_pass(exit_call: str) -> None:
    program = f"import os, sys\n\ndef solve(x):\n    return x\n\n{exit_call}\n\ndef check(candidate):\n    pass\n"
    result = run_tests(program, "check(solve)", QUICK)
    assert (result.status, result.returncode) == ("failed", 0)


def test_the_marker_is_fresh_for_every_run_and_required() -> None:
    program = "def check():\n    pass\n"
    first, second = run_tests(program, "check()", QUICK), run_tests(program, "check()", QUICK)
    assert first.passed and second.passed and first.stdout.strip() != second.stdout.strip()
    assert run_program("print('mergecompose-marker-1')", "mergecompose-marker-1", QUICK).passed
    assert run_program("print('mergecompose-marker-2')", "mergecompose-marker-1", QUICK).status == "failed"


def test_an_infinite_loop_ends_at_the_cpu_limit() -> None:
    limits = SandboxLimits(wall_seconds=20.0, cpu_seconds=1)  # room for a loaded machine: the CPU limit ends it
    result = run_tests("def check():\n    while True:\n        pass\n", "check()", limits)
    assert result.status == "timeout" and "CPU" in result.detail, result
    assert result.seconds < limits.wall_seconds


def test_a_sleeping_sample_is_killed_at_the_wall_clock_limit() -> None:
    limits = SandboxLimits(wall_seconds=1.5, cpu_seconds=1)
    result = run_tests("import time\n\ndef check():\n    time.sleep(600)\n", "check()", limits)
    assert result.status == "timeout" and "wall-clock" in result.detail, result
    assert result.returncode is None and not result.passed
    assert limits.wall_seconds <= result.seconds < limits.wall_seconds + MARGIN_SECONDS


def test_a_fork_bomb_is_bounded_and_leaves_no_process() -> None:
    # At most 200 forks in all, each child only sleeps: harmless even if the sandbox failed.
    program = sample(
        """
        import os, time

        def check():
            children = 0
            for _ in range(200):
                try:
                    pid = os.fork()
                except OSError:
                    break
                if pid == 0:
                    time.sleep(60)
                    os._exit(0)
                children += 1
            assert children == 200, f"{children} forks allowed"
        """
    )
    result = run_tests(program, "check()", QUICK)
    assert result.status == "failed" and "forks allowed" in result.stderr, result
    assert int(result.stderr.split("AssertionError: ")[1].split()[0]) < QUICK.processes
    assert result.seconds < QUICK.wall_seconds + MARGIN_SECONDS


def test_processes_a_passing_sample_leaves_behind_are_killed() -> None:
    # A child in a session of its own (out of the sample's process group) still dies with the namespace.
    program = sample(
        """
        import os, time

        def check():
            if os.fork() == 0:
                os.setsid()
                time.sleep(600)
                os._exit(0)
        """
    )
    assert run_tests(program, "check()", QUICK).passed  # the autouse fixture finds no process left


@pytest.mark.parametrize(
    ("body", "limits"),
    [
        ("block = bytearray(4 << 30)", QUICK),
        ("blocks = []\n    while True:\n        blocks.append(bytearray(16 << 20))", SandboxLimits(3.0, 2, 256 << 20)),
    ],
    ids=["one-allocation", "growing"],
)
def test_a_memory_hog_fails_at_the_address_space_limit(body: str, limits: SandboxLimits) -> None:
    result = run_tests(f"def check():\n    {body}\n", "check()", limits)
    assert result.status == "failed" and "MemoryError" in result.stderr, result


def test_a_large_file_or_output_fails_at_the_file_size_limit() -> None:
    limits = SandboxLimits(wall_seconds=3.0, cpu_seconds=1, file_size_bytes=1 << 20)
    to_file = "def check():\n    open('big', 'wb').write(bytes(2 << 20))\n"
    to_stdout = "import sys\n\ndef check():\n    sys.stdout.write('x' * (2 << 20))\n    sys.stdout.flush()\n"
    for program in (to_file, to_stdout):
        result = run_tests(program, "check()", limits)
        assert result.status == "failed" and "File too large" in result.stderr, result
        assert len(result.stdout) <= TAIL_CHARS


def test_a_write_to_the_home_folder_fails_and_leaves_nothing() -> None:
    name = f"{TEMP_PREFIX}probe-{os.getpid()}-{time.monotonic_ns()}"
    targets = [Path.home() / name, Path.home() / ".cache" / name]
    paths = [str(target) for target in targets]
    program = f"def check():\n    for target in {paths!r}:\n        open(target, 'w').write('x')\n"
    result = run_tests(program, "check()", QUICK)
    assert result.status == "failed" and ("PermissionError" in result.stderr or "OSError" in result.stderr), result
    assert not any(target.exists() for target in targets)


def test_writes_to_the_scratch_folders_stay_in_the_sandbox() -> None:
    # /tmp and its kind are writable inside, on a tmpfs of the sample's own that ends with it.
    name = f"{TEMP_PREFIX}probe-{os.getpid()}-{time.monotonic_ns()}"
    folders = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"]
    program = sample(
        f"""
        import os

        def check():
            for folder in {folders!r}:
                open(os.path.join(folder, {name!r}), "w").write("x")
            open({name!r}, "w").write("x")  # the sample's own folder
            assert sorted(os.listdir("/tmp")) == [{name!r}, "sample"]
        """
    )
    result = run_tests(program, "check()", QUICK)
    assert result.passed, result
    assert not any(os.path.exists(os.path.join(folder, name)) for folder in folders)


def test_killing_the_parent_or_the_scoring_process_fails() -> None:
    program = sample(
        f"""
        import os, signal

        def check():
            killed = []
            for pid in (os.getppid(), {os.getpid()}):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
                killed.append(pid)
            assert killed, "no kill got through"
        """
    )
    result = run_tests(program, "check()", QUICK)
    assert result.status == "failed" and "no kill got through" in result.stderr, result  # the launcher reported
    killing_everything = run_tests(
        "import os, signal\n\ndef check():\n    os.kill(-1, signal.SIGKILL)\n", "check()", QUICK
    )
    # kill(-1) spares the caller and pid 1; in the namespace nothing else exists to receive it.
    assert killing_everything.status == "failed" and "ProcessLookupError" in killing_everything.stderr
    os.kill(os.getpid(), 0)


def test_a_connect_to_a_local_listener_fails() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        listener.settimeout(10)
        connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5).sendall(b'x')"
        subprocess.run([sys.executable, "-c", connect], check=True, timeout=30)  # unsandboxed: it connects
        listener.accept()[0].close()
        program = f"import socket\n\ndef check():\n    {connect.split('; ')[1]}\n"
        result = run_tests(program, "check()", QUICK)
        assert result.status == "failed" and "OSError" in result.stderr, result
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()


def test_samples_run_concurrently_in_order() -> None:
    good, bad = "def check(x):\n    assert x == 1\n", "def check(x):\n    assert x == 2\n"
    exits = "import sys\nsys.exit(0)\n" + good
    results = run_tests_many([(good, "check(1)"), (bad, "check(1)"), (exits, "check(1)"), (good, "check(1)")], QUICK, 2)
    assert [result.status for result in results] == ["passed", "failed", "failed", "passed"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SandboxLimits(wall_seconds=0), "`wall_seconds` must be finite and > 0, got 0"),
        (lambda: SandboxLimits(wall_seconds=float("inf")), "`wall_seconds` must be finite"),
        (lambda: SandboxLimits(cpu_seconds=1.5), "`cpu_seconds` must be an integer >= 1, got 1.5"),
        (lambda: SandboxLimits(address_space_bytes=1024), "`address_space_bytes` must be an integer >= 67108864"),
        (lambda: SandboxLimits(processes=0), "`processes` must be an integer >= 1, got 0"),
        (lambda: run_tests("pass", " "), "`check_call` must be a non-empty Python statement"),
        (lambda: run_program("pass", "short"), "`marker` must be 8 or more characters"),
        (lambda: run_tests_many([("pass", "check()")], workers=0), "`workers` must be an integer >= 1, got 0"),
        (lambda: run_tests_many([("pass",)]), r"`samples\[0\]` must be a \(program, check_call\) pair"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]
