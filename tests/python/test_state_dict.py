"""state_dict() / load_state_dict() of ZenFlowAdamW in zenflow mode with asynchronous daemon
Updates (update_interval=4, no await): saved after step 6 (mid-round: round 1's Update was
started at the step-4 boundary and its parameters are not applied until step 8; round 2 has
pushed 2 of its 4 gradients), loaded in a fresh process (over another daemon), continued to step
14 (through a reselection at step 9 and the boundaries at 8 and 12): the losses and the final
parameters must equal the uninterrupted run's bit for bit. Also with land_lag 3 (round 1's
Update lands at step 7, after the save).
"""
import json

import pytest
import torch

import models
import stallfree
from conftest import run_python
from stallfree.torch import ZenFlowAdamW

STEPS = 14
SAVE_AT = 6
SEED = 3
# No engine warm-up: the rounds begin at once.
ZENFLOW = dict(mode="zenflow", update_interval=4, select_interval=8, topk_ratio=0.1,
               warmup_steps=0)
CONFIGS = {
    "fp32": dict(ZENFLOW, grad_dtype="fp32", param_dtype="fp32"),
    "bf16": dict(ZENFLOW),  # the default transfers (grad_dtype, param_dtype "bf16")
    # Round 1's Update (boundary 4) lands at the end of step 7, so the step-6 state still holds
    # it pending: the resumed engine must land it at step 7, not at the boundary at 8.
    "land_lag": dict(ZENFLOW, land_lag=3),
}


def factory(daemon, config):
    return lambda groups: ZenFlowAdamW(groups, socket=daemon.socket, **config)


def record(path=None):
    def after_step(step, model, opt, extra):
        extra.setdefault("timings", []).append(dict(opt.last_timings))
        if path is not None and step == SAVE_AT:
            torch.save({"step": step, "seed": SEED, "model": model.state_dict(),
                        "opt": opt.state_dict(), "sched": extra["sched"].state_dict()}, path)

    return after_step


def assert_bitwise_equal(run_losses, run_params, ref_losses, ref_params, what):
    assert run_losses == ref_losses, (what, run_losses, ref_losses)  # exact float equality
    assert run_params.keys() == ref_params.keys()
    for name in ref_params:
        a, b = run_params[name], ref_params[name]
        assert torch.equal(a, b), (what, name, (a - b).abs().max().item())


@pytest.fixture(scope="module")
def checkpoints(daemon, tmp_path_factory):
    """Per config: the uninterrupted run, and a run that saved its state after SAVE_AT."""
    out = {}
    for name, config in CONFIGS.items():
        path = str(tmp_path_factory.mktemp("ckpt") / f"{name}.pt")
        ref = models.train(factory(daemon, config), STEPS, seed=SEED, after_step=record())
        saved = models.train(factory(daemon, config), STEPS, seed=SEED, after_step=record(path))
        out[name] = (ref, saved, path)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resume_in_fresh_process_is_bit_exact(name, checkpoints, tmp_path):
    ref, saved, path = checkpoints[name]
    timings = ref.extra["timings"]
    # The checkpoint is mid-round with an Update outstanding, and the continuation crosses
    # boundaries and a reselection.
    assert [t["boundary"] for t in timings] == [s % 4 == 0 for s in range(1, STEPS + 1)]
    assert not timings[SAVE_AT - 1]["boundary"]
    assert timings[8 - 1]["reselected"], timings
    assert ref.losses[-1] < ref.losses[0] - 0.25  # it trains (4.19 -> 3.84), not stays put

    # Asking for the state dict does not change the run's own trajectory.
    assert_bitwise_equal(saved.losses, saved.params, ref.losses, ref.params, "saving run")

    out = tmp_path / "resumed.pt"
    proc = run_python("resume_child.py", path, json.dumps(CONFIGS[name]), STEPS, out,
                      tmp_path / "child-state", timeout=180)
    resumed = torch.load(str(out))
    assert len(resumed["losses"]) == STEPS - SAVE_AT, proc.stdout
    assert_bitwise_equal(resumed["losses"], resumed["params"], ref.losses[SAVE_AT:], ref.params,
                         f"{name} resumed in a fresh process")


def test_load_into_optimizer_over_other_model_fails(checkpoints, daemon):
    """The same parameter count and groups, other shapes (hidden 40 instead of 48): torch's own
    check (group sizes) passes, the optimizer must refuse."""
    _, _, path = checkpoints["fp32"]
    ckpt = torch.load(path)
    model = models.make_model(SEED, hidden=40)
    opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket, **CONFIGS["fp32"])
    try:
        with pytest.raises((stallfree.Error, ValueError)):
            opt.load_state_dict(ckpt["opt"])
    finally:
        opt.close()
