"""ZenFlowAdamW through accelerate: Accelerator(cpu=True).prepare(model, optimizer, dataloader,
scheduler) and the plain loop of accelerate's documentation (hf_models.accelerate_train:
accelerator.backward, clip_grad_norm_ at 1.0, optimizer.step, scheduler.step, zero_grad; a
shuffling DataLoader with accelerate's seedable sampler), on the tiny Llama and GPT-2 of
test_hf_trainer.py with the same hyper-parameters, STEPS = 30.

- sync-offload and zenflow S=1 (fp32 transfers, awaited, hf_models.EXACT_MODES) track
  torch.optim.AdamW in the same loop within hf_models.LOSS_RTOL / PARAM_ATOL (1e-5 relative /
  1e-5 absolute, derived in test_hf_trainer.py). Re-measured in this loop: stallfree 1.1e-7 /
  1.2e-7 (Llama), 1.9e-7 / 1.8e-6 (GPT-2); AdamW with 1-ulp noise after every step (3 trials)
  2.1e-7 / 1.5e-6 and 1.3e-7 / 2.5e-6; AdamW with lr 1% too high 3.2e-3 / 5.2e-4 and
  3.2e-3 / 1.2e-3 (checked here too), eps 1e-6 8.9e-5 / 6.0e-3 and 1.1e-4 / 1.2e-2.
- accelerator.save_state after step 30 (mid-round for the zenflow defaults with a fixed round,
  as an automatic one's lengths come from timing and two runs need not choose the same: warm-up 20, rounds
  of 4 ending at 24, 28, 32, 36, 40, an Update outstanding at 30, a reselection at 36), then in
  a fresh process over another stallfreed: prepare, accelerator.load_state, skip_first_batches,
  steps 31..40: the losses and the final parameters equal the uninterrupted run's bit for bit.
  accelerate loads the optimizer's state with torch.load(weights_only=True). GPT-2 runs here
  without dropout: in this loop (unlike the Trainer) the DataLoader iterator that
  skip_first_batches makes after load_state draws its base seed from torch's global RNG, so
  the dropout masks after a resume differ even with torch.optim.AdamW (measured: losses off by
  1e-3 from step 31 on) - a property of the loop, not of the optimizer.
"""
import json

import pytest
import torch

import hf_models
from conftest import run_python
from hf_models import EXACT_MODES, LOSS_RTOL, MODELS, PARAM_ATOL

STEPS = 30
RESUME_STEPS = 40
SAVE_AT = 30


@pytest.fixture(scope="module")
def references():
    return {}


def reference(references, kind, **kw):
    key = (kind, tuple(sorted(kw.items())))
    if key not in references:
        references[key] = hf_models.accelerate_train(kind, "adamw", max_steps=STEPS, **kw)
    return references[key]


@pytest.mark.parametrize("mode", EXACT_MODES)
@pytest.mark.parametrize("kind", MODELS)
def test_tracks_torch_adamw(kind, mode, daemon, references):
    ref = reference(references, kind)
    run = hf_models.accelerate_train(kind, "zenflow", dict(EXACT_MODES[mode],
                                                           socket=daemon.socket),
                                     max_steps=STEPS)
    loss, param, worst = hf_models.compare(run, ref)
    print(f"{kind} {mode} vs AdamW: losses {loss:.3g}, parameters {param:.3g} ({worst})")
    assert run["optimizer"] == "ZenFlowAdamW" and ref["optimizer"] == "AdamW"
    assert [t["step"] for t in run["timings"]] == list(range(1, STEPS + 1))
    assert all(t["bytes_to_host"] > 0 for t in run["timings"])
    if mode.startswith("zenflow"):
        assert sum(t["reselected"] for t in run["timings"]) >= 5
    assert ref["losses"][STEPS] < ref["losses"][1] - 1.0
    for step in ref["losses"]:
        assert hf_models.rel_diff(run["losses"][step], ref["losses"][step]) <= LOSS_RTOL, step
    for name, d in hf_models.max_abs_diff(run["params"], ref["params"]).items():
        assert d <= PARAM_ATOL, (name, d)

    if mode == "zenflow-S1":
        # The same comparison rejects AdamW with lr 1% too high.
        off = reference(references, kind, lr=hf_models.LR * 1.01)
        loss, param, _ = hf_models.compare(off, ref)
        assert loss > 20 * LOSS_RTOL and param > 20 * PARAM_ATOL, (loss, param)


RESUME_CASES = {
    # The defaults with a fixed round (update_interval 4) and warm-up (20).
    ("llama", "zenflow"): dict(update_interval=4, warmup_steps=20),
    ("gpt2", "zenflow"): dict(update_interval=4, warmup_steps=20),
    ("llama", "sync-offload"): dict(mode="sync-offload"),
}


@pytest.mark.parametrize("kind,mode", list(RESUME_CASES))
def test_save_state_load_state_in_fresh_process_is_exact(kind, mode, daemon, tmp_path):
    config = RESUME_CASES[(kind, mode)]
    run = dict(max_steps=RESUME_STEPS, dropout=0.0)
    ref = hf_models.accelerate_train(kind, "zenflow", dict(config, socket=daemon.socket), **run)
    state = tmp_path / "state"
    saving = hf_models.accelerate_train(kind, "zenflow", dict(config, socket=daemon.socket),
                                        save_at=SAVE_AT, save_dir=str(state), **run)
    timings = ref["timings"]
    assert [t["step"] for t in timings] == list(range(1, RESUME_STEPS + 1))
    if mode == "zenflow":
        assert [t["step"] for t in timings if t["boundary"] and t["step"] > 20] == \
            [24, 28, 32, 36, 40]
        assert [t["step"] for t in timings if t["reselected"]] == [20, 36]
    assert saving["losses"] == ref["losses"]
    for name, p in ref["params"].items():
        assert torch.equal(saving["params"][name], p), name

    kwargs = dict(run, loop="accelerate", kind=kind, optimizer="zenflow", config=config,
                  resume_from=str(state), socket_daemon_state=str(tmp_path / "child-daemon"))
    out = tmp_path / "resumed.pt"
    proc = run_python("hf_models.py", json.dumps(kwargs), out, timeout=240)
    resumed = torch.load(str(out))
    assert [t["step"] for t in resumed["timings"]] == list(range(SAVE_AT + 1, RESUME_STEPS + 1)), \
        proc.stderr[-2000:]
    assert sorted(resumed["losses"]) == list(range(SAVE_AT + 1, RESUME_STEPS + 1))
    for step, loss in resumed["losses"].items():
        assert loss == ref["losses"][step], (step, loss, ref["losses"][step])
    for name, p in ref["params"].items():
        assert torch.equal(resumed["params"][name], p), (
            name, (resumed["params"][name] - p).abs().max().item())
    # The continuation was not empty: every weight matrix moved after the saved state (the
    # weights accelerate's save_state wrote at step 30 differ from the run's final ones).
    from safetensors.torch import load_file
    saved_weights = load_file(str(state / "model.safetensors"))
    matrices = [n for n, p in ref["params"].items() if p.dim() >= 2]
    assert len(matrices) >= 8 and all(n in saved_weights for n in matrices)
    still = [n for n in matrices if torch.equal(saved_weights[n], ref["params"][n])]
    assert not still, still
