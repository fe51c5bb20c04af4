"""A daemon that goes away loses nothing: ZenFlowAdamW's sessions hold their state's memory, and
when stallfreed is started again on the same socket (systemd's Restart=, an upgrade), the next
step() re-attaches them (reattach_timeout) and training goes on at the step it was, bit for bit
with a run that was never interrupted: no step lost, none computed again."""
import os
import signal
import tempfile
import threading
import time

import torch

import models
import stallfree
from conftest import run_ranks
from stallfree.torch import ZenFlowAdamW

# Rounds of two steps whose Updates the steps wait for: between two steps the daemon is idle, so
# the kill never lands inside an Update (a state torn there is not taken back yet).
ROUNDS = dict(mode="zenflow", topk_ratio=0.25, update_interval=2, select_interval=2,
              await_updates=True, warmup_steps=0, **models.FP32)


def kill(daemon):
    os.kill(daemon.pid, signal.SIGKILL)
    for _ in range(500):
        try:
            os.kill(daemon.pid, 0)
        except ProcessLookupError:
            break
        if os.waitpid(daemon.pid, os.WNOHANG)[0] == daemon.pid:
            break
        time.sleep(0.01)
    daemon.close()


def train(steps, kill_before=(), stop=kill):
    """`steps` steps of the test model on a daemon at a fixed socket; before each step of
    kill_before the daemon is stopped by `stop` (SIGKILL; or close(): SIGTERM, as an upgrade's
    systemctl restart) and a new one started on the socket. Returns the losses and the final
    parameters."""
    sock = os.path.join(tempfile.mkdtemp(prefix="stallfree-survival-", dir="/tmp"), "d.sock")
    daemon = stallfree.Daemon(socket=sock, threads=1)
    try:
        model = models.make_model(0)
        opt = ZenFlowAdamW(model.parameters(), socket=sock, reattach_timeout=30, **ROUNDS)
        losses = []
        for step in range(1, steps + 1):
            if step in kill_before:
                stop(daemon)
                daemon = stallfree.Daemon(socket=sock, threads=1)
            opt.zero_grad(set_to_none=True)
            loss = models.loss_fn(model, models.batch(0, step))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        opt.close()
        return losses, [p.detach().clone() for p in model.parameters()]
    finally:
        daemon.close()


def test_a_daemon_killed_between_steps_is_waited_for_and_training_goes_on_bit_for_bit():
    """SIGKILL in the middle of a round (before step 4: one of its two steps pushed) and at a
    round's boundary (before step 7): each time the next step waits for the daemon started
    again, which takes the sessions back; every loss and every final parameter equal the
    uninterrupted run's exactly."""
    ref_losses, ref_params = train(10)
    losses, params = train(10, kill_before=(4, 7))
    assert losses == ref_losses
    for i, (a, b) in enumerate(zip(params, ref_params)):
        assert torch.equal(a, b), "parameter %d differs" % i


def test_a_daemon_restarted_mid_run_hands_the_sessions_to_its_successor_bit_for_bit():
    """An upgrade's restart: the daemon stopped with SIGTERM (it finishes its running work and
    exits, leaving the sessions' state to the processes that hold it) mid-round and a new one
    started on the socket; the run equals the uninterrupted one exactly."""
    ref_losses, ref_params = train(8)
    losses, params = train(8, kill_before=(4,), stop=lambda d: d.close())
    assert losses == ref_losses
    for i, (a, b) in enumerate(zip(params, ref_params)):
        assert torch.equal(a, b), "parameter %d differs" % i


def test_with_reattach_timeout_0_a_lost_daemon_raises_at_once():
    """reattach_timeout=0: the step after the kill raises stallfree.Error (UNAVAILABLE) naming
    the socket within a few seconds, instead of waiting for a daemon."""
    with stallfree.Daemon(threads=1) as d:
        model = models.make_model(0)
        opt = ZenFlowAdamW(model.parameters(), socket=d.socket, reattach_timeout=0, **ROUNDS)
        opt.zero_grad(set_to_none=True)
        models.loss_fn(model, models.batch(0, 1)).backward()
        opt.step()
        os.kill(d.pid, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            for step in range(2, 5):
                opt.zero_grad(set_to_none=True)
                models.loss_fn(model, models.batch(0, step)).backward()
                opt.step()
            raise AssertionError("no error after the daemon's kill")
        except stallfree.Error as e:
            assert str(e).startswith("stallfreed at %s went away (" % d.socket), e
        assert time.monotonic() - t0 < 10


def test_four_ddp_ranks_partitioned_on_one_daemon_survive_its_kill_bit_for_bit(tmp_path):
    """4 DDP ranks, their ZenFlowAdamW partitioned over them (a quarter of the offloaded state in
    each rank's session) on one shared daemon, SIGKILLed before step 5 (mid-round) while the
    ranks wait, and started again: each rank re-attaches its own session, and every rank's
    losses and final parameters equal an uninterrupted run's exactly."""
    steps = 8

    def ranks(kill_at):
        out = tmp_path / ("kill%d" % kill_at)
        out.mkdir()
        sock = os.path.join(tempfile.mkdtemp(prefix="stallfree-ddp-", dir="/tmp"), "d.sock")
        daemon = [stallfree.Daemon(socket=sock, threads=1)]

        def restart():
            deadline = time.monotonic() + 120
            while not (out / "paused").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            if not (out / "paused").exists():
                return
            kill(daemon[0])
            daemon[0] = stallfree.Daemon(socket=sock, threads=1)
            (out / "resumed").touch()

        killer = threading.Thread(target=restart, daemon=True)
        if kill_at:
            killer.start()
        try:
            run_ranks("survival_worker.py", 4, [sock, steps, kill_at, out], out)
        finally:
            if kill_at:
                killer.join(5)
            daemon[0].close()
        if kill_at:
            assert (out / "resumed").exists()
        return [torch.load(str(out / ("rank%d.pt" % r))) for r in range(4)]

    ref, got = ranks(0), ranks(5)
    for r in range(4):
        assert got[r]["losses"] == ref[r]["losses"], r
        for name, a in ref[r]["params"].items():
            assert torch.equal(got[r]["params"][name], a), (r, name)


def test_a_hugging_face_trainer_run_survives_its_daemon_bit_for_bit(tmp_path):
    """transformers' Trainer with ZenFlowAdamW (zenflow, its Updates awaited) on a shared daemon
    that a callback SIGKILLs and starts again after step 4 of 10: the Trainer never notices, and
    its logged losses and final parameters equal an uninterrupted run's exactly."""
    import transformers
    import hf_models

    sock = os.path.join(tempfile.mkdtemp(prefix="stallfree-hf-", dir="/tmp"), "d.sock")
    holder = [stallfree.Daemon(socket=sock, threads=1)]

    class KillAfterStep4(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 4:
                kill(holder[0])
                holder[0] = stallfree.Daemon(socket=sock, threads=1)

    config = dict(hf_models.EXACT_MODES["zenflow-S1"], socket=sock, reattach_timeout=60)
    try:
        ref = hf_models.train("llama", "zenflow", config, max_steps=10,
                              out_dir=str(tmp_path / "ref"))
        got = hf_models.train("llama", "zenflow", config, max_steps=10,
                              out_dir=str(tmp_path / "got"), callbacks=[KillAfterStep4()])
    finally:
        holder[0].close()
    assert len(ref["losses"]) == 10
    assert got["losses"] == ref["losses"]
    for name, a in ref["params"].items():
        assert torch.equal(got["params"][name], a), name
