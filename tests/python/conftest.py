"""pytest configuration for the stallfree Python tests.

Run with the project's Python environment (`make deps` makes .venv/):
    .venv/bin/python -m pytest tests/python
The package is imported as installed, else from $STALLFREE_PYTHONPATH, else from
<repository>/bazel-bin/python (where `bazel build //python:stallfree_package` puts it).
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PKG_PATH = os.path.join(os.path.dirname(os.path.dirname(HERE)), "bazel-bin", "python")

try:
    import stallfree  # noqa: F401
except ImportError:
    sys.path.insert(0, os.environ.get("STALLFREE_PYTHONPATH", DEFAULT_PKG_PATH))
    import stallfree  # noqa: F401
import stallfree.torch  # noqa: F401,E402

# testing/python: support shared with the benchmarks (zenflow_reference.ReferenceZenFlow).
TESTING_PY = os.path.join(os.path.dirname(os.path.dirname(HERE)), "testing", "python")
for path in (TESTING_PY, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

# 2 cores shared with a build: keep torch single-threaded (models.train and the child scripts
# call torch.set_num_threads(1) too). Do NOT put OMP_NUM_THREADS into the children's
# environment: with OMP_NUM_THREADS=1 set at start-up, torch 1.13's CPU backward rounds
# differently from a process that calls torch.set_num_threads(1) at run time (measured: the
# same 14 AdamW steps end with ~2500 parameters 1 ulp apart), which would break the bit-exact
# comparisons between a parent and its child. Children inherit the parent's environment as is.
torch.set_num_threads(1)

# The directory stallfree was imported from, for child processes.
PKG_PATH = os.path.dirname(os.path.dirname(os.path.abspath(stallfree.__file__)))
# Children run in this same interpreter (the project's virtual environment).
PYTHON = sys.executable


# Under the sanitizers (run_pytest.sh sets STALLFREE_SANITIZED when the package is built with
# them): every daemon this process starts is checked for a sanitizer's report in its log when it
# is closed (before its directory goes), and the run fails on one, the report shown. A test that
# kills daemons and starts new ones would otherwise take a daemon the sanitizer stopped for one
# it killed.
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "WARNING: ThreadSanitizer",
                   ": runtime error: ")
sanitizer_reports = []


def sanitizer_report(text):
    """The first sanitizer report in `text` (up to 8,000 characters), or ""."""
    at = min((i for i in (text.find(m) for m in SANITIZER_MARKS) if i >= 0), default=-1)
    if at < 0:
        return ""
    return text[text.rfind("\n", 0, at) + 1:][:8000]


if os.environ.get("STALLFREE_SANITIZED") == "1":
    _daemon_cleanup = stallfree.Daemon._cleanup

    def _checked_cleanup(self):
        try:
            with open(self.log_path, "rb") as f:
                report = sanitizer_report(f.read().decode("utf-8", "replace"))
        except OSError:
            report = ""
        if report:
            sanitizer_reports.append("stallfreed on %s (pid %s):\n%s" % (self.socket, self.pid,
                                                                         report))
        _daemon_cleanup(self)

    stallfree.Daemon._cleanup = _checked_cleanup


@pytest.fixture(autouse=True)
def no_sanitizer_report():
    """Fails the test during which a closed daemon's log held a sanitizer's report."""
    seen = len(sanitizer_reports)
    yield
    if len(sanitizer_reports) > seen:
        pytest.fail("a daemon stopped on a sanitizer's report:\n" +
                    "\n".join(sanitizer_reports[seen:]), pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    """Daemons closed after the last test (module fixtures, exit) are checked here."""
    if sanitizer_reports and session.exitstatus == 0:
        print("\n".join(["a daemon stopped on a sanitizer's report:"] + sanitizer_reports),
              file=sys.stderr)
        session.exitstatus = 1


def child_env(**extra):
    """The environment for a child Python: the package and this directory on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PKG_PATH, HERE])
    env.pop("STALLFREE_SOCKET", None)
    # A child that aborts (a C++ std::terminate, SIGSEGV) prints every thread's Python stack.
    env["PYTHONFAULTHANDLER"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port():
    """A TCP port free on loopback now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(script, *args, timeout=120, env=None, check=True, module=False):
    """Runs `script` (a file in this directory, or source text; with module=True a module, as
    `python -m`) in a fresh interpreter (this one); returns the CompletedProcess (text
    stdout/stderr). Output goes through files, not pipes, so a grandchild (a daemon) that
    inherits them cannot keep this call waiting. check: fail the test on a non-zero exit,
    showing the child's output."""
    path = os.path.join(HERE, script)
    if module:
        cmd = [PYTHON, "-m", script]
    else:
        cmd = [PYTHON, path] if os.path.exists(path) else [PYTHON, "-c", script]
    cmd += [str(a) for a in args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        rc = subprocess.run(cmd, env=env or child_env(), stdout=out, stderr=err,
                            timeout=timeout).returncode
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(cmd, rc, out.read(), err.read())
    if check and proc.returncode != 0:
        pytest.fail(f"child {cmd} exited {proc.returncode}\n"
                    f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def run_ranks(script, world, args, log_dir, *, env=None, timeout=240, expect=None):
    """Starts `world` ranks of `script` (this directory) with the torch.distributed environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on a free loopback port; PORT is also the
    first argument) and waits for them. When one exits, the others get 10 s, then are killed (a
    rank blocked in a collective would otherwise wait for its timeout). expect: the exit codes
    required (default all 0; the test fails otherwise, showing every rank's output). Returns
    (exit codes, outputs)."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        log = open(os.path.join(str(log_dir), f"{os.path.splitext(script)[0]}-rank{rank}.log"),
                   "w+")
        cmd = [PYTHON, os.path.join(HERE, script), port] + list(args)
        procs.append(subprocess.Popen(
            [str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
            env=child_env(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank,
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **(env or {}))))
        logs.append(log)
    deadline, ended_at = time.monotonic() + timeout, None
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if ended_at is None and any(p.poll() not in (None, 0) for p in procs):
                ended_at = time.monotonic()
            if ended_at is not None and time.monotonic() > ended_at + 10:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if codes != (expect or [0] * world):
        pytest.fail(f"ranks exited {codes}\n" + "\n".join(
            f"--- rank {r}\n{o}" for r, o in enumerate(outputs)))
    return codes, outputs


@pytest.fixture
def sock_dir():
    """A short directory for unix socket paths (sun_path holds at most 107 bytes; pytest's
    tmp_path can be longer, e.g. under Bazel's TEST_TMPDIR)."""
    path = tempfile.mkdtemp(prefix="sf-test-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A private stallfreed for the test module (its own socket and state_dir)."""
    state_dir = tmp_path_factory.mktemp("stallfreed-state")
    with stallfree.Daemon(state_dir=str(state_dir), threads=1) as d:
        yield d
