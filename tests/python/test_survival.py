"""A daemon that goes away loses nothing: ZenFlowAdamW's sessions hold their state's memory, and
when stallfreed is started again on the same socket (systemd's Restart=, an upgrade), the next
step() re-attaches them (reattach_timeout) and training goes on at the step it was, bit for bit
with a run that was never interrupted: no step lost, none computed again. That holds for a kill
at any instant: between steps, and inside an Update or a push, which the next daemon finishes
from the session's work journal."""
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

# Rounds of two steps whose Updates the steps wait for.
ROUNDS = dict(mode="zenflow", topk_ratio=0.25, update_interval=2, select_interval=2,
              await_updates=True, warmup_steps=0, **models.FP32)


# Units of the daemon's work slowed (its testing flag --test_unit_delay_us, which it also reads
# from the environment), so that an Update lasts long enough for kills to land inside it.
SLOW_UNITS = "STALLFREE_TEST_UNIT_DELAY_US"


def start_daemon(sock, slow=0):
    """A daemon on `sock` whose units each wait `slow` microseconds (0: none)."""
    saved = {SLOW_UNITS: os.environ.get(SLOW_UNITS)}
    if slow:
        os.environ[SLOW_UNITS] = str(slow)
    try:
        return stallfree.Daemon(socket=sock, threads=1)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def daemon_stats(daemon):
    """The daemon's GetStats counters ({} when it does not answer)."""
    try:
        return stallfree._stallfree.Client(daemon.socket, 1000).stats()
    except stallfree.Error:
        return {}


class Killer:
    """SIGKILLs the daemon in holder[0] (on `sock`) `kills` times, each followed at once by a new
    one on the socket (systemd's Restart=), while the run goes on: the first `aimed` every other
    kill when the daemon says an Update runs (GetStats' updates_running), the others at random
    instants (seeded). `finished` counts the Updates that the new daemons finished for a daemon
    killed inside them (their updates_resumed). The first kill waits until started() says the
    run is training (if given)."""

    def __init__(self, holder, sock, kills=20, pause=(0.05, 0.25), seed=0, slow=2000,
                 started=None, aimed=16):
        import random
        self.holder, self.sock, self.kills, self.pause = holder, sock, kills, pause
        self.slow, self.started, self.aimed = slow, started, aimed
        self.rng = random.Random(seed)
        self.done = self.finished = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _wait_for_update(self):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not self.stop.is_set():
            if daemon_stats(self.holder[0]).get("updates_running", 0) > 0:
                return
            time.sleep(0.002)

    def _run(self):
        deadline = time.monotonic() + 120
        while self.started and not self.started() and time.monotonic() < deadline:
            if self.stop.wait(0.02):
                return
        while self.done < self.kills and not self.stop.is_set():
            if self.done < self.aimed and self.done % 2 == 0:
                self._wait_for_update()
            elif self.stop.wait(self.rng.uniform(*self.pause)):
                break
            if self.stop.is_set():
                break
            self.finished += daemon_stats(self.holder[0]).get("updates_resumed", 0)
            kill(self.holder[0])
            self.holder[0] = start_daemon(self.sock, slow=self.slow)
            self.done += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)
        self.finished += daemon_stats(self.holder[0]).get("updates_resumed", 0)


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


def test_a_private_daemon_that_dies_is_started_again_and_training_goes_on_bit_for_bit(
        monkeypatch):
    """No stallfreed at the socket: ZenFlowAdamW starts a private one, which this process starts
    again on its socket when it dies (SIGKILL before steps 4 and 7); each time it takes the
    sessions back from the memory this process holds, and the run equals one on a daemon never
    killed, exactly."""
    ref_losses, ref_params = train(10)
    monkeypatch.setenv("STALLFREE_SOCKET", os.path.join(tempfile.mkdtemp(dir="/tmp"), "none.sock"))
    model = models.make_model(0)
    opt = ZenFlowAdamW(model.parameters(), reattach_timeout=30, **ROUNDS)
    try:
        assert opt.daemon is not None, "no private daemon"
        losses = []
        for step in range(1, 11):
            if step in (4, 7):
                os.kill(opt.daemon.pid, signal.SIGKILL)
            opt.zero_grad(set_to_none=True)
            loss = models.loss_fn(model, models.batch(0, step))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert opt.daemon.restarts == 2
    finally:
        opt.close()
    assert losses == ref_losses
    for i, (a, b) in enumerate(zip(model.parameters(), ref_params)):
        assert torch.equal(a.detach(), b), "parameter %d differs" % i


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


def test_four_ddp_ranks_partitioned_on_one_daemon_survive_20_kills_bit_for_bit(tmp_path):
    """4 DDP ranks, their ZenFlowAdamW partitioned over them (a quarter of the offloaded state in
    each rank's session) on one shared daemon, SIGKILLed 20 times while they train (8 of them
    aimed at a running Update, the others at random instants) and started again each time: each
    rank re-attaches its own session whenever it next needs it, the Updates cut short are
    finished by the next daemon (at least 5 of them), and every rank's losses and final
    parameters equal an uninterrupted run's exactly."""
    steps = 24

    def ranks(kills):
        out = tmp_path / ("kills%d" % kills)
        out.mkdir()
        sock = os.path.join(tempfile.mkdtemp(prefix="stallfree-ddp-", dir="/tmp"), "d.sock")
        # A rank's session is small (a few units): each unit waits 20 ms.
        holder = [start_daemon(sock, slow=20000 if kills else 0)]
        killer = Killer(holder, sock, kills, seed=1, slow=20000,
                        started=lambda: (out / "training").exists())
        try:
            if kills:
                with killer:
                    run_ranks("survival_worker.py", 4, [sock, steps, out], out)
            else:
                run_ranks("survival_worker.py", 4, [sock, steps, out], out)
        finally:
            holder[0].close()
        assert killer.done == kills, "the run ended after %d of its kills" % killer.done
        if kills:
            assert killer.finished >= 5, killer.finished
        return [torch.load(str(out / ("rank%d.pt" % r))) for r in range(4)]

    ref, got = ranks(0), ranks(20)
    for r in range(4):
        assert got[r]["losses"] == ref[r]["losses"], r
        for name, a in ref[r]["params"].items():
            assert torch.equal(got[r]["params"][name], a), (r, name)


def test_a_hugging_face_trainer_run_survives_20_kills_bit_for_bit(tmp_path):
    """transformers' Trainer with ZenFlowAdamW (zenflow, its Updates awaited) on a shared daemon
    that is SIGKILLed 20 times during the run (8 of them aimed at a running Update, the others at
    random instants) and started again each time: the Trainer never notices, the Updates cut
    short are finished by the next daemon (at least 5 of them), and its logged losses and final
    parameters equal an uninterrupted run's exactly."""
    import transformers
    import hf_models

    sock = os.path.join(tempfile.mkdtemp(prefix="stallfree-hf-", dir="/tmp"), "d.sock")
    holder = [start_daemon(sock)]
    config = dict(hf_models.EXACT_MODES["zenflow-S1"], socket=sock, reattach_timeout=60)
    steps = 30
    try:
        ref = hf_models.train("llama", "zenflow", config, max_steps=steps,
                              out_dir=str(tmp_path / "ref"))
        holder[0].close()
        holder[0] = start_daemon(sock, slow=2000)
        training = threading.Event()

        class Started(transformers.TrainerCallback):  # the kills begin after the first step
            def on_step_end(self, args, state, control, **kw):
                training.set()

        with Killer(holder, sock, 20, seed=2, started=training.is_set) as killer:
            got = hf_models.train("llama", "zenflow", config, max_steps=steps,
                                  out_dir=str(tmp_path / "got"), callbacks=[Started()])
    finally:
        holder[0].close()
    assert killer.done == 20, "the run ended after %d of its kills" % killer.done
    assert killer.finished >= 5, killer.finished
    assert len(ref["losses"]) == steps
    assert got["losses"] == ref["losses"]
    for name, a in ref["params"].items():
        assert torch.equal(got["params"][name], a), name
