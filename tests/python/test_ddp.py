"""ZenFlowAdamW under torch.distributed: 2 ranks over gloo, each with its own private stallfreed
(ddp_worker.py).

Tolerance: the DDP run's parameters must match torch.optim.AdamW trained in one process on the
whole global batch within PARAM_ATOL = 1e-5 (absolute, element-wise), the tolerance derived in
test_adamw_equivalence.py (kernel rounding amplified by Adam: <= 2.6e-6 measured after 20
steps). DDP adds the rounding of averaging the two half-batch gradients instead of one
whole-batch gradient; emulated with torch alone (two half-batch backward passes, averaged,
AdamW) over these 12 steps it moves the parameters by at most 2.4e-7 and the losses by 1.2e-7
relative, while an lr 1% off moves them by 1.1e-3.
"""
import os
import subprocess
import time

import pytest
import torch

import models
from conftest import HERE, PYTHON, child_env, free_port
from ddp_worker import ZENFLOW
from stallfree.torch import ZenFlowAdamW

STEPS = 12  # selections at steps 1, 3, 5, 7, 9, 11: five reselections
SEED = 5
WORLD = 2
LOSS_RTOL = models.LOSS_RTOL
PARAM_ATOL = models.PARAM_ATOL


def run_ranks(mode, tmp_path):
    port = free_port()
    procs, logs = [], []
    for rank in range(WORLD):
        log = open(tmp_path / f"{mode}-rank{rank}.log", "w+")
        cmd = [PYTHON, os.path.join(HERE, "ddp_worker.py"), mode, port, STEPS, SEED,
               tmp_path / f"{mode}-rank{rank}.pt", tmp_path / f"{mode}-state{rank}"]
        procs.append(subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
                                      env=child_env(RANK=rank, WORLD_SIZE=WORLD,
                                                    LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1",
                                                    MASTER_PORT=port)))
        logs.append(log)
    # Wait for both; when one fails, give the other 10 s, then stop it (a rank blocked in a
    # collective would otherwise wait for gloo's timeout).
    deadline, failed_at = time.monotonic() + 240, None
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + 10:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if codes != [0] * WORLD:
        pytest.fail(f"ranks exited {codes}\n" + "\n".join(
            f"--- rank {r}\n{o}" for r, o in enumerate(outputs)))
    return [torch.load(str(tmp_path / f"{mode}-rank{rank}.pt")) for rank in range(WORLD)]


def assert_same_hot_sets(ranks):
    for step in range(STEPS):
        gathered = [r["hot"][step] for r in ranks]
        # What each rank gathered is the same list, and in it both ranks' hot sets agree.
        assert gathered[0] == gathered[1], step
        assert gathered[0][0] == gathered[0][1], (step + 1, gathered[0])
        for name, cols in gathered[0][0].items():
            assert cols == sorted(set(cols)) and len(cols) >= 1, (step + 1, name, cols)


def test_ddp_matches_single_process_whole_batch(tmp_path, daemon):
    ranks = run_ranks("ddp", tmp_path)
    assert ranks[0]["daemon_socket"] != ranks[1]["daemon_socket"]  # two private daemons
    assert_same_hot_sets(ranks)
    timings = ranks[0]["timings"]
    reselections = [t for t in timings[1:] if t["reselected"]]
    assert len(reselections) >= 3, timings
    assert sum(t["migrated_columns"] for t in reselections) > 0, timings
    # The hot set really moves between selections (else "identical" would be trivial).
    hot = ranks[0]["hot"]
    assert any(hot[s][0] != hot[s - 1][0] for s in range(1, STEPS)), hot

    # One process with the same global batch: ZenFlowAdamW with the ranks' configuration, and
    # torch.optim.AdamW (which the zero-staleness configuration must equal within tolerance).
    single = models.train(lambda g: ZenFlowAdamW(g, socket=daemon.socket, **ZENFLOW), STEPS,
                          seed=SEED)
    single_diffs = models.max_abs_diff(ranks[0]["params"], single.params)
    print("DDP vs one-process ZenFlowAdamW:", {n: f"{d:.3g}" for n, d in single_diffs.items()})
    for name, d in single_diffs.items():
        assert d <= PARAM_ATOL, (name, d)
    for step in range(STEPS):
        global_loss = sum(r["losses"][step] for r in ranks) / WORLD
        assert models.rel_diff(global_loss, single.losses[step]) <= LOSS_RTOL, step + 1
    ref = models.train(models.adamw_factory(), STEPS, seed=SEED)
    for step in range(STEPS):
        global_loss = sum(r["losses"][step] for r in ranks) / WORLD
        assert models.rel_diff(global_loss, ref.losses[step]) <= LOSS_RTOL, (
            step + 1, global_loss, ref.losses[step])
    for name in ref.params:
        # DDP keeps the replicas identical: same averaged gradients, same hot sets.
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
    diffs = models.max_abs_diff(ranks[0]["params"], ref.params)
    print("DDP vs whole-batch AdamW:", {n: f"{d:.3g}" for n, d in diffs.items()})
    for name, d in diffs.items():
        assert d <= PARAM_ATOL, (name, d)


def check_selections(ranks, reduced):
    """At every selection step, each rank's hot set is the top-k of the SUM of both ranks'
    per-column scores (sum of squared gradients) when `reduced`, else of its own scores."""
    timings = ranks[0]["timings"]
    selection_steps = [1] + [i + 1 for i, t in enumerate(timings) if t["reselected"] and i > 0]
    assert len(selection_steps) >= 4, timings
    local_topk_differs = False
    checked = 0
    for step in selection_steps:
        for rank in range(WORLD):
            hot = ranks[0]["hot"][step - 1][rank]  # as rank 0 gathered it
            for name, cols in hot.items():
                scores = [r["scores"][step - 1][name] for r in ranks]
                k = len(cols)
                local = [sorted(s.topk(k).indices.tolist()) for s in scores]
                local_topk_differs |= local[0] != local[1]
                total = scores[0] + scores[1] if reduced else scores[rank]
                top = total.topk(k + 1).values
                if k < total.numel() and (top[k - 1] - top[k]) <= 1e-4 * top[k - 1]:
                    continue  # a near-tie at the cut: rounding may decide it
                assert cols == sorted(total.topk(k).indices.tolist()), (step, rank, name, cols)
                checked += 1
    assert local_topk_differs, "the ranks' local selections never differed: test is vacuous"
    assert checked >= len(selection_steps) * 2 * WORLD, checked


def test_selection_all_reduces_scores_without_ddp(tmp_path):
    """Without DDP the ranks' gradients differ; the hot sets must still agree, and be the top-k
    of the SUM of both ranks' per-column scores."""
    ranks = run_ranks("local", tmp_path)
    assert_same_hot_sets(ranks)
    check_selections(ranks, reduced=True)


def test_scores_are_reduced_over_the_process_group_only(tmp_path):
    """process_group= a group of each rank alone (as a tensor-parallel rank's data-parallel
    group would be): no score crosses to the other rank, so each rank's hot set is the top-k of
    its own scores, and the two differ."""
    ranks = run_ranks("own-group", tmp_path)
    check_selections(ranks, reduced=False)
    assert any(ranks[0]["hot"][s][0] != ranks[0]["hot"][s][1] for s in range(STEPS))
