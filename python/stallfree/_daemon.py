"""Private stallfreed processes, and where the node's shared one listens."""

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

from . import _stallfree
from ._stallfree import Error
from ._syslibs import missing_library_hint

_HERE = os.path.dirname(os.path.abspath(__file__))


def _shipped(name, env):
    """The binary `name`: $`env` if set, else the one shipped next to this module (in the
    wheel, and in bazel-bin/python/stallfree/)."""
    path = os.environ.get(env) or os.path.join(_HERE, name)
    if not os.access(path, os.X_OK):
        raise Error(
            "no %s binary at %s: install the stallfree wheel (`make wheel` builds it; it ships "
            "stallfreed and stallfreectl), or build the package with `bazel build "
            "//python:stallfree_package`, or set %s to a %s binary" % (name, path, env, name))
    return path


def stallfreed_path():
    """The stallfreed binary: $STALLFREE_STALLFREED, else the one shipped in this package."""
    return _shipped("stallfreed", "STALLFREE_STALLFREED")


def stallfreectl_path():
    """The stallfreectl binary: $STALLFREE_STALLFREECTL, else the one shipped in this package."""
    return _shipped("stallfreectl", "STALLFREE_STALLFREECTL")


def default_socket():
    """Where the node's daemon listens by default (stallfreed's own default):
    $XDG_RUNTIME_DIR/stallfree/stallfreed.sock, else /run/stallfree/stallfreed.sock."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(xdg, "stallfree") if xdg else "/run/stallfree"
    return os.path.join(base, "stallfreed.sock")


_live = weakref.WeakSet()


@atexit.register
def _stop_all():
    for d in list(_live):
        d.close()


class Daemon:
    """A private stallfreed, started now and stopped by close() (or `with`, or at exit).

    socket: where it listens (default: a fresh temporary directory's stallfreed.sock);
    state_dir: its checkpoint directory (default: inside that temporary directory);
    threads: optimizer worker threads (0: all cores); log_level: its log level (its log goes to
    `log_path`). The daemon runs with --parent_pid, so it stops by itself when this process
    dies, even by SIGKILL: it never outlives its parent. restart_on_exit: when it exits without
    close() (a crash, a kill), it is started again on the same socket and state directory (at
    most 100 times; `restarts` counts them), and takes back the sessions of this process, whose
    memory this process holds.
    """

    def __init__(self, socket=None, state_dir=None, threads=0, log_level="warning",
                 pinned_mib=0, startup_timeout=30.0, restart_on_exit=False):
        self._dir = tempfile.mkdtemp(prefix="stallfree-", dir="/tmp")
        self.socket = socket or os.path.join(self._dir, "stallfreed.sock")
        self.state_dir = state_dir or os.path.join(self._dir, "state")
        self.log_path = os.path.join(self._dir, "stallfreed.log")
        self._proc = None
        self._args = [stallfreed_path(), "--socket", self.socket, "--state_dir", self.state_dir,
                      "--threads", str(int(threads)), "--log_level", log_level,
                      "--pinned_mib", str(int(pinned_mib)), "--parent_pid", str(os.getpid())]
        self._startup_timeout = startup_timeout
        self._lock = threading.Lock()
        self._closing = False
        self.restarts = 0
        self._start("wb")
        _live.add(self)
        if restart_on_exit:
            threading.Thread(target=self._keep, name="stallfreed keeper", daemon=True).start()

    def _start(self, mode):
        with open(self.log_path, mode) as log:
            # Its own session: a Ctrl-C in the terminal reaches the trainer, which then closes
            # the daemon in order, instead of killing the daemon under a running step.
            self._proc = subprocess.Popen(self._args, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self._proc.pid
        deadline = time.monotonic() + self._startup_timeout
        while True:
            if self._proc.poll() is not None:
                why = self._log_tail()
                self._cleanup()
                hint = missing_library_hint(why)  # e.g. libcivetweb1, which only it needs
                raise Error("stallfreed exited with code %d while starting (socket %s): %s%s"
                            % (self._proc.returncode, self.socket, why,
                               "\n" + hint if hint else ""))
            if os.path.exists(self.socket):
                try:
                    if _stallfree.Client(self.socket, 500).health() == "SERVING":
                        break
                except Error:
                    pass
            if time.monotonic() > deadline:
                self.close()
                raise Error("stallfreed did not answer on %s within %.0f s (log: %s)"
                            % (self.socket, self._startup_timeout, self.log_path))
            time.sleep(0.02)

    # A daemon that keeps dying right after its start is not started again for ever.
    _MAX_RESTARTS = 100

    def _keep(self):
        """restart_on_exit: starts the daemon again, on the same socket and state directory, when
        it exits unless close() stopped it; the sessions of this process's optimizers wait for
        it (reattach_timeout) and it takes them back from the memory this process holds."""
        while True:
            proc = self._proc
            if proc is None:
                return
            code = proc.wait()
            with self._lock:
                if self._closing or self._proc is not proc:
                    return
                if self.restarts >= self._MAX_RESTARTS:
                    print("stallfree: the private stallfreed (pid %d) exited with code %d; it "
                          "was started again %d times already: not again (log: %s)"
                          % (proc.pid, code, self.restarts, self.log_path), file=sys.stderr)
                    return
                print("stallfree: the private stallfreed (pid %d) exited with code %d; starting "
                      "it again on %s" % (proc.pid, code, self.socket), file=sys.stderr)
                try:
                    self._start("ab")
                except Error as e:
                    print("stallfree: the private stallfreed did not start again: %s" % e,
                          file=sys.stderr)
                    return
                self.restarts += 1

    def _log_tail(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-2000:].decode("utf-8", "replace").strip()
        except OSError:
            return "(no log)"

    @property
    def running(self):
        return self._proc is not None and self._proc.poll() is None

    def close(self, timeout=10.0):
        """Stops the daemon (SIGTERM: it finishes running updates) and removes its directory."""
        with self._lock:
            self._closing = True
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        _live.discard(self)
        self._cleanup()

    def _cleanup(self):
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self):
        return "stallfree.Daemon(socket=%r, pid=%r)" % (self.socket, self.pid)
