"""No files for in-memory state (issue 30, item 4).

- state_dict() takes the daemon's part of the state through the session's staging area, straight
  out of its pinned memory: no checkpoint file is written, so a daemon without a state directory
  (checkpoints off) serves state_dict() and load_state_dict() (the run continues bit for bit),
  and a process killed in the middle of state_dict() leaves nothing in the state directory.
- load_state_dict() frees each group's engine and daemon session before it makes the new one:
  the daemon's pinned_bytes (GetStats) never exceeds one copy of the optimizer's during a load,
  into a fresh optimizer or into one that has stepped.
- What a state dict can be wrong about (a corrupt daemon state included) is refused before
  anything is freed; a failure after that closes the optimizer and says so.
"""
import contextlib
import io
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

import models
import stallfree
from conftest import PYTHON, child_env
from stallfree import _stallfree
from stallfree._daemon import stallfreed_path
from stallfree.torch import ZenFlowAdamW

# Rounds with an asynchronous daemon Update and a reselection (no warm-up: rounds at once).
ZENFLOW = dict(mode="zenflow", update_interval=4, select_interval=8, topk_ratio=0.1,
               warmup_steps=0)
STEPS = 10
SAVE_AT = 6  # mid-round: round 1's Update pending, round 2 has pushed 2 of 4 gradients


@contextlib.contextmanager
def daemon_without_state_dir():
    """A stallfreed with checkpoints off (--state_dir ''): it has no directory to write to."""
    d = tempfile.mkdtemp(prefix="sf-nostate-", dir="/tmp")
    sock = os.path.join(d, "s.sock")
    proc = subprocess.Popen([stallfreed_path(), "--socket", sock, "--state_dir", "",
                             "--threads", "1", "--log_level", "warning",
                             "--parent_pid", str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "stallfreed exited %s" % proc.returncode
            try:
                if os.path.exists(sock) and _stallfree.Client(sock, 500).health() == "SERVING":
                    break
            except stallfree.Error:
                pass
            assert time.monotonic() < deadline, "stallfreed did not answer"
            time.sleep(0.02)
        yield sock
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def files_under(path):
    return sorted(os.path.join(root, f) for root, _, fs in os.walk(path) for f in fs)


def test_state_dict_needs_no_state_directory():
    """Checkpoints off (no directory at all): state_dict() mid-round and load_state_dict() into
    a fresh optimizer still work, and the loaded run ends bit for bit as the uninterrupted one.
    (Before: FAILED_PRECONDITION, "stallfreed runs without a state directory".)"""
    with daemon_without_state_dir() as sock:
        def factory(groups):
            return ZenFlowAdamW(groups, socket=sock, **ZENFLOW)

        ref = models.train(factory, STEPS, seed=5)
        saved = {}
        models.train(factory, STEPS, seed=5, after_step=models.save_at(SAVE_AT, saved))
        sd = torch.load(io.BytesIO(saved["opt_bytes"]), weights_only=True)
        assert any(v.get("zenflow_daemon", torch.empty(0)).numel() > 0
                   for v in sd["state"].values())
        run = models.train(factory, STEPS, seed=5, start=SAVE_AT + 1, setup=models.resume_from(
            saved, lambda model, opt: opt.load_state_dict(sd)))
        assert run.losses == ref.losses[SAVE_AT:], (run.losses, ref.losses[SAVE_AT:])
        for name in ref.params:
            assert torch.equal(run.params[name], ref.params[name]), name


# A child that saves its optimizer's state over and over, announcing each state_dict() before
# it starts it (with the time), until it is killed.
_SAVER = r"""
import sys, time, torch
from stallfree.torch import ZenFlowAdamW
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
opt = ZenFlowAdamW(model.parameters(), lr=1e-3, socket=sys.argv[1], mode="zenflow",
                   topk_ratio=0.1, update_interval=1, warmup_steps=0)
for _ in range(2):
    model(torch.randn(4, 1024)).square().mean().backward()
    opt.step()
n = 0
while True:
    print("saving %d %.6f" % (n, time.monotonic()), flush=True)
    opt.state_dict()
    n += 1
"""


def test_a_killed_state_dict_leaves_no_file(tmp_path):
    """A trainer killed (SIGKILL) in the middle of state_dict(), twice at random points of it:
    the daemon's state directory holds no file afterwards (before: the checkpoint state_dict()
    had the daemon write was left there for good)."""
    state_dir = str(tmp_path / "state")
    with stallfree.Daemon(state_dir=state_dir, threads=1) as d:
        rng = random.Random(4)
        for _ in range(2):
            log = open(tmp_path / "saver.log", "w+")
            child = subprocess.Popen([PYTHON, "-c", _SAVER, d.socket], stdout=subprocess.PIPE,
                                     stderr=log, env=child_env(), text=True)
            try:
                starts = []
                deadline = time.monotonic() + 60
                while len(starts) < 4:
                    line = child.stdout.readline()
                    assert line, "the saver exited: " + open(tmp_path / "saver.log").read()
                    starts.append(float(line.split()[2]))
                    assert time.monotonic() < deadline
                period = (starts[-1] - starts[0]) / (len(starts) - 1)
                time.sleep(rng.uniform(0.1, 0.9) * period)  # inside a state_dict()
            finally:
                child.kill()
                child.wait()
                log.close()
            # The daemon reclaims the killed process's session; nothing stays on disk.
            deadline = time.monotonic() + 10
            while _stallfree.Client(d.socket).stats()["sessions"] > 0:
                assert time.monotonic() < deadline, "the killed session was not reclaimed"
                time.sleep(0.02)
            assert files_under(state_dir) == []


class PinnedWatch:
    """Samples the daemon's pinned_bytes (GetStats) as fast as it answers, on a thread, while
    the `with` block runs; .peak is the largest value seen, .samples how many."""

    def __init__(self, sock):
        self.client = _stallfree.Client(sock)
        self.peak, self.samples = 0, 0

    def __enter__(self):
        self._stop = threading.Event()
        self._old_interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)  # the sampler gets the GIL between the loader's calls too

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, int(self.client.stats()["pinned_bytes"]))
                self.samples += 1

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._old_interval)


def pinned(sock):
    return int(_stallfree.Client(sock).stats()["pinned_bytes"])


def pinned_settled(sock, want, timeout=5.0):
    """pinned(sock) once it equals `want`, or after `timeout` seconds: a closed session's memory
    is freed once its queued work has run (CloseSession returns before that, offload.proto)."""
    deadline = time.monotonic() + timeout
    got = pinned(sock)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.02)
        got = pinned(sock)
    return got


def test_load_state_dict_holds_one_copy_of_pinned_memory(daemon):
    """load_state_dict() into a fresh optimizer (a resume) and into one that has stepped (an
    update still running in the daemon): the daemon never pins more than 1.1 x what the
    optimizer pins on its own (before: a second session of every group was registered and
    restored before the old one closed, 2 x). The loaded optimizer goes on as its source."""
    assert pinned(daemon.socket) == 0
    src_model = models.make_model(2)
    src = ZenFlowAdamW(models.param_groups(src_model), socket=daemon.socket, **ZENFLOW)
    models.plain_steps(src_model, src, SAVE_AT, seed=2)
    sd = src.state_dict()
    model_sd = {k: v.clone() for k, v in src_model.state_dict().items()}
    one_copy = pinned(daemon.socket)
    assert one_copy > 0
    src.close()
    assert pinned_settled(daemon.socket, 0) == 0

    model = models.make_model(7)
    opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket, **ZENFLOW)
    try:
        assert pinned(daemon.socket) == one_copy
        model.load_state_dict(model_sd)
        with PinnedWatch(daemon.socket) as fresh:
            opt.load_state_dict(sd)
        assert fresh.samples > 0
        assert fresh.peak <= 1.1 * one_copy, ("fresh", fresh.peak, one_copy, fresh.samples)
        assert pinned_settled(daemon.socket, one_copy) == one_copy
        # Two more steps (the second is round 2's boundary: its Update runs in the daemon while
        # the state is loaded again).
        models.plain_steps(model, opt, 2, seed=3)
        model.load_state_dict(model_sd)
        with PinnedWatch(daemon.socket) as stepped:
            opt.load_state_dict(sd)
        assert stepped.peak <= 1.1 * one_copy, ("stepped", stepped.peak, one_copy)
        assert pinned_settled(daemon.socket, one_copy) == one_copy
        # And it goes on exactly as an optimizer that loaded the state once.
        twin_model = models.make_model(7)
        twin = ZenFlowAdamW(models.param_groups(twin_model), socket=daemon.socket, **ZENFLOW)
        try:
            twin_model.load_state_dict(model_sd)
            twin.load_state_dict(sd)
            assert models.plain_steps(model, opt, 4, seed=9) == \
                models.plain_steps(twin_model, twin, 4, seed=9)
            for (name, a), b in zip(model.named_parameters(), twin_model.parameters()):
                assert torch.equal(a, b), name
        finally:
            twin.close()
    finally:
        opt.close()
    assert pinned(daemon.socket) == 0


def test_a_corrupt_daemon_state_is_refused_before_anything_is_freed(daemon):
    """One flipped bit in the daemon's part of a state dict: DATA_LOSS, and the optimizer is as
    it was (its engines, its pinned memory) and steps on as its twin."""
    twins = []
    for _ in range(2):
        model = models.make_model(0)
        opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket, **ZENFLOW)
        models.plain_steps(model, opt, 3)
        twins.append((model, opt))
    (model, opt), (twin_model, twin) = twins
    try:
        sd = opt.state_dict()
        entry = next(v for v in sd["state"].values() if v.get("zenflow_daemon") is not None
                     and v["zenflow_daemon"].numel() > 0)
        blob = entry["zenflow_daemon"].clone()
        blob[blob.numel() // 2] ^= 4
        entry["zenflow_daemon"] = blob
        engines = list(opt._engines)
        before = pinned(daemon.socket)
        with pytest.raises(stallfree.Error, match="DATA_LOSS"):
            opt.load_state_dict(sd)
        assert opt._engines == engines and pinned(daemon.socket) == before
        for m, o in twins:
            models.plain_steps(m, o, 4, seed=5)
        for (name, a), b in zip(model.named_parameters(), twin_model.parameters()):
            assert torch.equal(a, b), name
    finally:
        opt.close()
        twin.close()


def test_a_load_that_fails_after_freeing_closes_the_optimizer_and_says_so(daemon, monkeypatch):
    """A failure once a group's previous engine is freed (here: making group 1's new engine, as
    a daemon that went away or a pinned budget taken meanwhile would fail it) cannot give the
    previous state back: the optimizer closes every engine and says what happened and what to
    do; the daemon holds none of its memory."""
    model = models.make_model(0)
    opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket, **ZENFLOW)
    models.plain_steps(model, opt, 3)
    sd = opt.state_dict()
    make = opt._make_engine

    def failing(gi, *args):
        if gi == 1:
            raise stallfree.Error("UNAVAILABLE: the daemon went away (test)")
        return make(gi, *args)

    monkeypatch.setattr(opt, "_make_engine", failing)
    with pytest.raises(stallfree.Error) as err:
        opt.load_state_dict(sd)
    msg = str(err.value)
    assert "param_groups[1]" in msg and "the daemon went away (test)" in msg, msg
    assert "closed" in msg and "new ZenFlowAdamW" in msg, msg
    with pytest.raises(stallfree.Error, match="closed"):
        models.plain_steps(model, opt, 1)
    assert pinned_settled(daemon.socket, 0) == 0
    opt.close()  # a no-op now
