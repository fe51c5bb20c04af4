"""The private daemon: ZenFlowAdamW(socket=None) starts one when nothing answers at the resolved
socket and it does not outlive its parent (normal exit or SIGKILL); stallfree.Daemon as a
context manager; an explicit socket that nothing serves is an error naming it."""
import os
import re
import shutil
import signal
import socket as sock
import stat
import subprocess
import time

import pytest

import models
import stallfree
from conftest import PYTHON, HERE, child_env, run_python
from stallfree.torch import ZenFlowAdamW


def process_gone(pid):
    """True when pid no longer runs: no /proc entry, or a zombie (it has exited; its parent,
    the child python, is dead already, so it waits only for init to reap it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except FileNotFoundError:
        return True
    return re.search(r"^State:\s+Z", status, re.M) is not None


def wait_gone(pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process_gone(pid):
            return True
        time.sleep(0.1)
    return process_gone(pid)


def parse(stdout):
    out = {}
    for line in stdout.splitlines():
        key, _, value = line.partition(" ")
        out[key] = value
    return out


def check_child_output(out, env_socket):
    pid = int(out["DAEMON_PID"])
    assert "stallfreed" in out["DAEMON_CMDLINE"], out
    assert out["OPT_SOCKET"] == out["DAEMON_SOCKET"], out
    losses = [float(x) for x in out["LOSSES"].split()]
    assert len(losses) == 6 and all(x == x for x in losses), out  # 6 finite steps
    assert losses[-1] < losses[0], out  # it trains
    return pid


def private_daemon_lines(stderr, pid, socket):
    """The stderr lines that announce the private daemon."""
    return [l for l in stderr.splitlines()
            if re.search(r"stallfreed|daemon", l, re.I) and (str(pid) in l or socket in l
                                                             or re.search(r"start", l, re.I))]


def stale_socket(path):
    """A unix socket file that nothing listens on (as a crashed daemon leaves behind)."""
    s = sock.socket(sock.AF_UNIX)
    s.bind(path)
    s.close()
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    return path


def test_private_daemon_started_and_stopped_at_exit(sock_dir):
    # $STALLFREE_SOCKET names a stale socket file: nothing answers there.
    env_socket = stale_socket(os.path.join(sock_dir, "nobody-listens.sock"))
    proc = run_python("daemon_child.py", "exit", env=child_env(STALLFREE_SOCKET=env_socket),
                      timeout=120)
    out = parse(proc.stdout)
    pid = check_child_output(out, env_socket)
    lines = private_daemon_lines(proc.stderr, pid, out["DAEMON_SOCKET"])
    assert len(lines) == 1, proc.stderr
    assert wait_gone(pid), f"private stallfreed {pid} outlived its parent's normal exit"


def test_private_daemon_stops_when_parent_is_killed(tmp_path, sock_dir):
    env_socket = os.path.join(sock_dir, "nobody-listens.sock")  # no such file
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        child = subprocess.Popen([PYTHON, os.path.join(HERE, "daemon_child.py"), "hang"],
                                 env=child_env(STALLFREE_SOCKET=env_socket), stdout=out,
                                 stderr=err)
    pid = None
    try:
        deadline = time.monotonic() + 120
        while "READY" not in out_path.read_text():
            assert child.poll() is None and time.monotonic() < deadline, (
                child.poll(), out_path.read_text(), err_path.read_text())
            time.sleep(0.2)
        out = parse(out_path.read_text())
        pid = check_child_output(out, env_socket)
        assert not process_gone(pid)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert wait_gone(pid), f"private stallfreed {pid} outlived its SIGKILLed parent"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if pid is not None and not process_gone(pid):
            os.kill(pid, signal.SIGTERM)  # do not leak it into the rest of the suite
        # The killed parent could not remove its Daemon's temporary directory (the socket's
        # directory, /tmp/stallfree-*: the daemon's log); remove it here.
        daemon_dir = os.path.dirname(parse(out_path.read_text()).get("DAEMON_SOCKET", ""))
        if os.path.basename(daemon_dir).startswith("stallfree-"):
            shutil.rmtree(daemon_dir, ignore_errors=True)


def test_daemon_context_manager(tmp_path):
    state_dir = tmp_path / "state"
    with stallfree.Daemon(state_dir=str(state_dir), threads=1) as d:
        assert isinstance(d.socket, str) and isinstance(d.pid, int)
        assert stat.S_ISSOCK(os.stat(d.socket).st_mode)  # it serves when the constructor returns
        assert not process_gone(d.pid)
        assert d.state_dir == str(state_dir)
        model = models.make_model(0)
        with ZenFlowAdamW(models.param_groups(model), socket=d.socket, update_interval=1,
                          await_updates=True) as opt:
            assert opt.daemon is None  # it uses the running daemon, starts none
            assert opt.socket == d.socket
            losses = models.plain_steps(model, opt, 3)
            assert losses[-1] < losses[0]
        pid = d.pid
    # close() sends SIGTERM and waits: the daemon has exited (and been reaped) when it returns.
    assert not os.path.exists(f"/proc/{pid}")


@pytest.mark.parametrize("kind", ["missing", "stale"])
def test_explicit_socket_nobody_serves_is_an_error(kind, sock_dir):
    assert issubclass(stallfree.Error, RuntimeError)
    path = os.path.join(sock_dir, "nothing-here.sock")
    if kind == "stale":
        stale_socket(path)
    model = models.make_model(0)
    with pytest.raises(stallfree.Error) as err:
        ZenFlowAdamW(models.param_groups(model), socket=path)
    assert path in str(err.value)
    # ... and it did not start a daemon there instead.
    assert os.path.exists(path) == (kind == "stale")
    if kind == "stale":
        with pytest.raises(ConnectionRefusedError):
            with sock.socket(sock.AF_UNIX) as s:
                s.connect(path)
