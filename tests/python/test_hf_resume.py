"""Trainer checkpoints with ZenFlowAdamW: `save_steps`, then `trainer.train(
resume_from_checkpoint=...)` in a fresh process over another stallfreed continues exactly as
the uninterrupted run: every logged loss and every final parameter bit for bit.

The runs (hf_models.train, as in test_hf_trainer.py): the tiny Llama and the tiny GPT-2 (with
its dropout 0.1: the Trainer saves and restores the RNG states, so the masks continue too),
STEPS = 40 steps over 2.5 epochs of the shuffled data set, a checkpoint every SAVE_AT = 30 steps
(checkpoint-30, mid-epoch: the resumed Trainer skips the epoch's first 14 batches).
ZenFlowAdamW with its defaults but a fixed round (the automatic round's lengths come from
timing, so two runs need not choose the same; resuming it is test_zenflow_reference.py's) and
warm-up (mode zenflow, bf16 transfers, topk_ratio 0.1, update_interval 4, select_interval 16,
warmup_steps 20: steps 1-20 are awaited single-step rounds, then rounds of
4 steps end at 24, 28, 32, 36, 40, with reselections at 20 and 36) and in sync-offload (bf16
transfers, the default). Step 30 is mid-round: round 29-32 has pushed 2 of its 4 gradients and
the Update the step-28 boundary started is still outstanding (applied at step 32); the
continuation crosses the boundaries 32, 36 and 40 and the reselection at 36.
The Trainer writes the optimizer's state_dict with torch.save and reads it back with
torch.load(weights_only=True).
"""
import json
import os

import pytest
import torch

import hf_models
from conftest import run_python

STEPS = 40
SAVE_AT = 30
CASES = {
    ("llama", "zenflow"): dict(update_interval=4, warmup_steps=20),
    ("gpt2", "zenflow"): dict(update_interval=4, warmup_steps=20),
    ("llama", "sync-offload"): dict(mode="sync-offload"),
    ("gpt2", "sync-offload"): dict(mode="sync-offload"),
}


def assert_bitwise_equal(got, ref, steps, what):
    for step in steps:
        assert got["losses"][step] == ref["losses"][step], (what, step, got["losses"][step],
                                                            ref["losses"][step])
    assert got["params"].keys() == ref["params"].keys()
    for name, p in ref["params"].items():
        assert torch.equal(got["params"][name], p), (
            what, name, (got["params"][name] - p).abs().max().item())


@pytest.mark.parametrize("kind,mode", list(CASES))
def test_resume_from_checkpoint_in_fresh_process_is_exact(kind, mode, daemon, tmp_path):
    config = CASES[(kind, mode)]
    with_socket = dict(config, socket=daemon.socket)
    ref = hf_models.train(kind, "zenflow", with_socket, max_steps=STEPS,
                          out_dir=str(tmp_path / "ref"))
    saving = hf_models.train(kind, "zenflow", with_socket, max_steps=STEPS,
                             out_dir=str(tmp_path / "saving"), save_steps=SAVE_AT)
    steps = list(range(1, STEPS + 1))

    timings = ref["timings"]
    assert [t["step"] for t in timings] == steps
    if mode == "zenflow":
        # Warm-up, then rounds of 4; the checkpoint is mid-round; the continuation crosses
        # boundaries and a reselection.
        assert [s for s in steps if timings[s - 1]["boundary"]] == \
            list(range(1, 21)) + [24, 28, 32, 36, 40]
        assert [s for s in steps if timings[s - 1]["reselected"]] == [20, 36]
        assert timings[36 - 1]["migrated_columns"] > 0
        assert not timings[SAVE_AT - 1]["boundary"]
    assert ref["losses"][STEPS] < ref["losses"][1] - 1.0  # it trains

    # Saving checkpoints does not change the run.
    assert_bitwise_equal(saving, ref, steps, "the run that saved")

    checkpoint = tmp_path / "saving" / f"checkpoint-{SAVE_AT}"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        assert (checkpoint / name).is_file(), sorted(os.listdir(checkpoint))
    opt_state = torch.load(str(checkpoint / "optimizer.pt"), weights_only=True)
    assert isinstance(opt_state, dict) and opt_state["state"]

    # A fresh process with its own stallfreed: a new Trainer, resume_from_checkpoint.
    kwargs = dict(kind=kind, optimizer="zenflow", config=config, max_steps=STEPS,
                  out_dir=str(tmp_path / "resumed"), resume_from=str(checkpoint),
                  socket_daemon_state=str(tmp_path / "child-daemon"))
    out = tmp_path / "resumed.pt"
    proc = run_python("hf_models.py", json.dumps(kwargs), out, timeout=240)
    resumed = torch.load(str(out))
    # It ran steps 31..40 itself, with the optimizer's state restored (the engine's step
    # counter continues at 31: a fresh optimizer would report steps 1..10).
    assert [t["step"] for t in resumed["timings"]] == list(range(SAVE_AT + 1, STEPS + 1)), \
        proc.stderr[-2000:]
    assert_bitwise_equal(resumed, ref, range(SAVE_AT + 1, STEPS + 1),
                         f"{kind} {mode} resumed in a fresh process")
    # ... and it had something to do: every weight matrix moved after the checkpoint. (Not
    # necessarily every vector: with bf16 transfers a norm's gain near 1, where a bf16 ulp is
    # 2^-7, can keep its bf16 value through the last steps' small learning rates.)
    from safetensors.torch import load_file
    saved_weights = load_file(str(checkpoint / "model.safetensors"))
    matrices = [n for n, p in ref["params"].items() if p.dim() >= 2]
    assert len(matrices) >= 8 and all(n in saved_weights for n in matrices)
    still = [n for n in matrices if torch.equal(saved_weights[n], ref["params"][n])]
    assert not still, still
