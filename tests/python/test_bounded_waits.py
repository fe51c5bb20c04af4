"""Bounded waits (issue 30): ZenFlowAdamW's calls to stallfreed are bounded by rpc_timeout.

A daemon stopped with SIGSTOP in the middle of training makes step() raise stallfree.Error
(code DEADLINE_EXCEEDED) naming the socket, the call and the bound within rpc_timeout (plus the
1 s health check that tells a stopped daemon from a busy one), instead of hanging; after SIGCONT
the documented way on (load the model's and the optimizer's state_dict() saved before) continues
the run exactly as an uninterrupted one."""
import copy
import os
import signal
import threading
import time

import pytest
import torch

import stallfree
from stallfree.torch import ZenFlowAdamW

RPC_TIMEOUT = 2.0


def _stopped(pid):
    """Whether every thread of `pid` is stopped (SIGSTOP takes effect asynchronously)."""
    tasks = "/proc/%d/task" % pid
    for tid in os.listdir(tasks):
        with open(os.path.join(tasks, tid, "stat")) as f:
            line = f.read()
        if line[line.rindex(")") + 2] != "T":
            return False
    return True


def _make(socket):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    # A fixed round (the automatic one is chosen from timings) and a short warm-up: the two runs
    # compared below take the same steps.
    opt = ZenFlowAdamW(model.named_parameters(), lr=1e-2, socket=socket, warmup_steps=2,
                       update_interval=2, rpc_timeout=RPC_TIMEOUT)
    return model, opt


def _step(model, opt, t):
    g = torch.Generator().manual_seed(t)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()


def test_rpc_timeout_is_validated_and_reported(monkeypatch):
    monkeypatch.delenv("STALLFREE_RPC_TIMEOUT", raising=False)
    with stallfree.Daemon(threads=1) as d:
        model = torch.nn.Linear(4, 4)
        with pytest.raises(ValueError, match="rpc_timeout"):
            ZenFlowAdamW(model.parameters(), socket=d.socket, rpc_timeout=0)
        with ZenFlowAdamW(model.parameters(), socket=d.socket, rpc_timeout=7.5) as opt:
            assert opt.rpc_timeout == 7.5
        with ZenFlowAdamW(model.parameters(), socket=d.socket) as opt:
            assert opt.rpc_timeout == 120.0  # the client library's default


def test_stopped_daemon_raises_within_rpc_timeout_and_the_run_recovers_after_sigcont():
    with stallfree.Daemon(threads=1) as d:
        reference, ref_opt = _make(d.socket)
        for t in range(1, 11):
            _step(reference, ref_opt, t)
        ref_opt.close()

        model, opt = _make(d.socket)
        for t in range(1, 6):
            _step(model, opt, t)
        saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        os.kill(d.pid, signal.SIGSTOP)
        # Should a step hang after all (the bug this guards against), the daemon goes on after
        # 30 s, so that the step returns, the test fails on the time it took, and no stopped
        # daemon outlives the test (it runs in its own session: Bazel's kill does not reach it).
        safety = threading.Timer(30, os.kill, (d.pid, signal.SIGCONT))
        safety.start()
        try:
            deadline = time.monotonic() + 5
            while not _stopped(d.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _stopped(d.pid)
            t0 = time.monotonic()
            # A step may only hand its work to the engine's copy thread; the first one that
            # waits for the daemon raises.
            with pytest.raises(stallfree.Error) as raised:
                for t in range(6, 10):
                    _step(model, opt, t)
            took = time.monotonic() - t0
        finally:
            safety.cancel()
            os.kill(d.pid, signal.SIGCONT)
        err = raised.value
        assert err.code == "DEADLINE_EXCEEDED"
        # rpc_timeout, the health check's second, and slack for a loaded machine.
        assert RPC_TIMEOUT * 0.9 <= took < RPC_TIMEOUT + 1 + 3, took
        msg = str(err)
        assert "stallfreed at %s (pid %d) did not answer" % (d.socket, d.pid) in msg, msg
        assert "within 2 s" in msg and "rpc_timeout" in msg, msg
        assert "it is stopped (SIGSTOP; kill -CONT %d resumes it)" % d.pid in msg, msg
        assert "load the model's and this optimizer's state_dict() saved before" in msg, msg

        # The documented way on, once the daemon answers again: the saved state into this very
        # optimizer (fresh daemon sessions) and the model; then the run equals the
        # uninterrupted one bit for bit.
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        for t in range(6, 11):
            _step(model, opt, t)
        opt.close()
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(a, b), name
