"""ZenFlowAdamW under `torchrun --nproc_per_node 2` with transformers' Trainer: DDP over gloo
on CPU (the Trainer wraps the model itself), both ranks' optimizers on one stallfreed.

`python -m torch.distributed.run --nproc_per_node 2 hf_ddp_worker.py` trains the tiny Llama of
test_hf_trainer.py for STEPS = 30 with per_device_train_batch_size 4 (global batch 8, the
accelerate-sharded shuffle of the same seed: step k of the DDP run sees the 8 samples that
step k of a one-process run with batch 8 sees), four times: torch.optim.AdamW; ZenFlowAdamW
zenflow S=1 (fp32 transfers, awaited, warmup_steps 0: reselections every 4 steps); zenflow with
a fixed schedule and fp32 transfers (warm-up 20, then rounds of 4 ending at 24 and 28, the
Update of each applied one round late, a reselection at 20); the defaults with that schedule
(the same with bf16 transfers). The test compares them with the same runs in one process over
the whole batch. And the defaults themselves (update_interval "auto", whose lengths come from
timing, so a one-process run need not choose the same): the two ranks sum the figures they
choose from, so they end bit-identical.

Tolerances.
- The ranks end with bit-identical parameters and losses, and the same hot columns: DDP hands
  both the same averaged gradients, and the hot-column selection is a function of them.
- DDP against one process: the rounding of averaging two half-batch gradients instead of one
  whole-batch gradient is of the order of the kernel rounding for which hf_models.LOSS_RTOL /
  PARAM_ATOL (1e-5 / 1e-5) were derived (test_hf_trainer.py). Measured: AdamW under DDP vs
  AdamW in one process 1.8e-7 relative (losses) / 1.2e-7 (parameters); zenflow S=1 1.2e-7 /
  1.2e-7; zenflow S=4 fp32 1.2e-7 / 1.2e-7. The same tolerances bind ZenFlowAdamW S=1 under
  DDP to AdamW under DDP (measured 1.2e-7 / 1.2e-7).
- The defaults (bf16 transfers) under DDP vs in one process: the losses within LOSS_RTOL
  (measured 4.9e-7) and the same hot columns. The parameters are not compared element-wise:
  the device copy of an offloaded column is the daemon's fp32 value rounded to bf16, so fp32
  rounding noise flips some bf16 roundings (one bf16 ulp, up to 2^-7 |p|), which changes the
  next forward pass and compounds (measured 4.9e-4 at most, of the order of the whole bf16
  effect: bf16 vs fp32 transfers differ by 5e-4 to 9e-4, test_hf_trainer.py).
"""
import json
import os

import pytest
import torch

import hf_models
from conftest import HERE, free_port, run_python
from hf_models import EXACT_MODES, LOSS_RTOL, PARAM_ATOL

STEPS = 30
WORLD = 2
FIXED = dict(update_interval=4, warmup_steps=20)  # the rounds the comparisons expect
RUNS = {
    "adamw": ["adamw", None],
    "zenflow-S1": ["zenflow", EXACT_MODES["zenflow-S1"]],
    "zenflow-S4-fp32": ["zenflow", dict(hf_models.FP32, **FIXED)],
    "zenflow-defaults": ["zenflow", FIXED],
    "zenflow-auto": ["zenflow", {}],  # the defaults: ranks compared with each other only
}
ONE_PROCESS = [name for name in RUNS if name != "zenflow-auto"]


@pytest.fixture(scope="module")
def ddp(daemon, tmp_path_factory):
    """{run name: [rank 0's result, rank 1's result]} of one torchrun."""
    out = tmp_path_factory.mktemp("torchrun")
    run_python("torch.distributed.run", "--nproc_per_node", WORLD, "--master_addr", "127.0.0.1",
               "--master_port", free_port(), os.path.join(HERE, "hf_ddp_worker.py"),
               daemon.socket, out, STEPS, json.dumps(RUNS), module=True, timeout=240)
    return {name: [torch.load(str(out / f"{name}-rank{r}.pt")) for r in range(WORLD)]
            for name in RUNS}


@pytest.fixture(scope="module")
def single(daemon, tmp_path_factory):
    """The same runs in this process, one rank with the whole batch."""
    results = {}
    for name in ONE_PROCESS:
        optimizer, config = RUNS[name]
        if config is not None:
            config = dict(config, socket=daemon.socket)
        results[name] = hf_models.train("llama", optimizer, config, max_steps=STEPS,
                                        out_dir=str(tmp_path_factory.mktemp(name)))
    return results


@pytest.mark.parametrize("name", list(RUNS))
def test_ranks_end_identical(name, ddp):
    ranks = ddp[name]
    assert all(r["world"] == WORLD for r in ranks)
    assert sorted(ranks[0]["losses"]) == list(range(1, STEPS + 1))
    assert ranks[0]["losses"] == ranks[1]["losses"]
    for pname, p in ranks[0]["params"].items():
        assert torch.equal(ranks[1]["params"][pname], p), pname
    if name != "adamw":
        for r in ranks:
            assert r["optimizer"] == "ZenFlowAdamW"
            assert [t["step"] for t in r["timings"]] == list(range(1, STEPS + 1))
            assert all(t["bytes_to_host"] > 0 for t in r["timings"])
        assert ranks[0]["hot"] and ranks[0]["hot"] == ranks[1]["hot"]
        # The same round lengths (with "auto": chosen from the figures both ranks summed).
        lengths = [[t["interval"] for t in r["timings"]] for r in ranks]
        assert lengths[0] == lengths[1]
        if name == "zenflow-auto":
            print(f"zenflow-auto: round lengths {sorted(set(lengths[0]))} on both ranks")


@pytest.mark.parametrize("name", ["adamw", "zenflow-S1", "zenflow-S4-fp32"])
def test_ddp_matches_one_process(name, ddp, single):
    loss, param, worst = hf_models.compare(ddp[name][0], single[name])
    print(f"{name}: DDP vs one process: losses {loss:.3g}, parameters {param:.3g} ({worst})")
    assert loss <= LOSS_RTOL and param <= PARAM_ATOL
    assert single[name]["losses"][STEPS] < single[name]["losses"][1] - 1.0
    if name != "adamw":
        assert ddp[name][0]["hot"] == single[name]["hot"]
    if name == "zenflow-S1":
        assert sum(t["reselected"] for t in ddp[name][0]["timings"]) >= 5
    if name == "zenflow-S4-fp32":
        timings = ddp[name][0]["timings"]
        assert [t["step"] for t in timings if t["boundary"] and t["step"] > 20] == [24, 28]


def test_ddp_zenflow_tracks_ddp_adamw(ddp):
    loss, param, worst = hf_models.compare(ddp["zenflow-S1"][0], ddp["adamw"][0])
    print(f"DDP zenflow S=1 vs DDP AdamW: losses {loss:.3g}, parameters {param:.3g} ({worst})")
    assert loss <= LOSS_RTOL and param <= PARAM_ATOL


def test_ddp_zenflow_defaults_match_one_process(ddp, single):
    got, ref = ddp["zenflow-defaults"][0], single["zenflow-defaults"]
    timings = got["timings"]
    assert [t["step"] for t in timings if t["boundary"] and t["step"] > 20] == [24, 28]
    assert [t["step"] for t in timings if t["reselected"]] == [20]
    assert got["hot"] == ref["hot"]
    loss, param, worst = hf_models.compare(got, ref)
    print(f"zenflow defaults: DDP vs one process: losses {loss:.3g}, parameters {param:.3g} "
          f"({worst})")
    assert loss <= LOSS_RTOL, loss


def torchrun(daemon, out, runs, steps=STEPS):
    run_python("torch.distributed.run", "--nproc_per_node", WORLD, "--master_addr", "127.0.0.1",
               "--master_port", free_port(), os.path.join(HERE, "hf_ddp_worker.py"),
               daemon.socket, out, steps, json.dumps(runs), module=True, timeout=240)
    return {name: [torch.load(str(out / f"{name}-rank{r}.pt")) for r in range(WORLD)]
            for name in runs}


def test_a_two_rank_checkpoint_resumes_on_two_ranks_and_on_one(daemon, tmp_path):
    """The script builds the optimizer before its TrainingArguments (so before torchrun's
    torch.distributed exists): it still partitions over the two ranks once the Trainer has
    initialised them. The Trainer saves checkpoint-30 mid-round (round 29-32, fp32 transfers
    and the fixed schedule of zenflow-S4-fp32) from its main process only; the optimizer
    consolidated both ranks' shares before, so its optimizer.pt holds both. Resumed from it
    with two ranks, steps 31-40 and the final parameters equal the uninterrupted run's bit for
    bit; in one process over the whole batch, within the tolerances of DDP against one process
    (LOSS_RTOL / PARAM_ATOL, the module docstring). (Before, the optimizer built first did not
    partition, and a partitioned one's checkpoint held rank 0's share, which rank 1 refused.)"""
    config = dict(hf_models.FP32, **FIXED)
    saved = torchrun(daemon, tmp_path, {"saved": ["zenflow", config, dict(
        save_steps=30, optimizer_first=True)]})["saved"]
    assert [r["partition"] for r in saved] == [{"world": 2, "rank": 0}, {"world": 2, "rank": 1}]
    ckpt = str(tmp_path / "saved" / "checkpoint-30")
    opt = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    metas = [json.loads(bytes(e["zenflow_meta"].tolist()).decode())
             for e in opt["state"].values() if "zenflow_meta" in e]
    assert metas and all(m["partition"]["world"] == 2 and "consolidated" in m for m in metas)
    resumed = torchrun(daemon, tmp_path, {"resumed": ["zenflow", config, dict(
        resume_from=ckpt)]})["resumed"]
    after = range(31, STEPS + 1)
    for r in range(WORLD):
        assert [resumed[r]["losses"][s] for s in after] == [saved[r]["losses"][s] for s in after]
        for name, p in saved[r]["params"].items():
            assert torch.equal(resumed[r]["params"][name], p), (r, name)
    one = hf_models.train("llama", "zenflow", dict(config, socket=daemon.socket),
                          max_steps=STEPS, out_dir=str(tmp_path / "one"), resume_from=ckpt)
    for s in after:
        assert one["losses"][s] == pytest.approx(saved[0]["losses"][s], rel=LOSS_RTOL), s
    for name, p in saved[0]["params"].items():
        assert torch.allclose(one["params"][name], p, rtol=0, atol=PARAM_ATOL), name


def test_accelerate_save_state_of_two_ranks_resumes_exactly(daemon, tmp_path):
    """accelerate's loop on two ranks (Accelerator(cpu=True) over gloo; each rank a batch of its
    own): accelerator.save_state at step 8, mid-round (warm-up 2, rounds of 4 ending at 6, 10),
    writes the main process's optimizer state_dict(); every rank calls save_state, so the
    optimizer consolidates both ranks' shares into it. Resumed with accelerator.load_state on
    two ranks, steps 9-12 and the final parameters equal the uninterrupted run's bit for bit
    (before, rank 1 refused rank 0's share)."""
    config = dict(hf_models.FP32, update_interval=4, warmup_steps=2)
    save = str(tmp_path / "state")
    saved = torchrun(daemon, tmp_path, {"saved": ["zenflow", config, dict(
        accelerate=True, save_at=8, save_dir=save)]}, steps=12)["saved"]
    assert [r["partition"] for r in saved] == [{"world": 2, "rank": 0}, {"world": 2, "rank": 1}]
    resumed = torchrun(daemon, tmp_path, {"resumed": ["zenflow", config, dict(
        accelerate=True, resume_from=save)]}, steps=12)["resumed"]
    for r in range(WORLD):
        assert [resumed[r]["losses"][s] for s in range(9, 13)] == \
            [saved[r]["losses"][s] for s in range(9, 13)]
        for name, p in saved[r]["params"].items():
            assert torch.equal(resumed[r]["params"][name], p), (r, name)
