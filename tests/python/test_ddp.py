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
import torch

import models
from conftest import run_ranks as run_ranks_of
from ddp_worker import ZENFLOW
from stallfree.torch import ZenFlowAdamW

STEPS = 12  # selections at steps 1, 3, 5, 7, 9, 11: five reselections
SEED = 5
WORLD = 2
LOSS_RTOL = models.LOSS_RTOL
PARAM_ATOL = models.PARAM_ATOL


def run_ranks(mode, tmp_path):
    run_ranks_of("ddp_worker.py", WORLD, [mode, STEPS, SEED, tmp_path], tmp_path)
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


def check_selections(ranks, key):
    """At every selection step, each rank's hot set is the top-k of the per-column scores
    `key` recorded by that rank (its own gradient's, or the ranks' mean gradient's), and the
    ranks' own gradients alone would have selected differently (else the check is vacuous)."""
    timings = ranks[0]["timings"]
    selection_steps = [1] + [i + 1 for i, t in enumerate(timings) if t["reselected"] and i > 0]
    assert len(selection_steps) >= 4, timings
    local_topk_differs = False
    checked = 0
    for step in selection_steps:
        for rank in range(WORLD):
            hot = ranks[0]["hot"][step - 1][rank]  # as rank 0 gathered it
            for name, cols in hot.items():
                k = len(cols)
                local = [sorted(r["scores"][step - 1][name].topk(k).indices.tolist())
                         for r in ranks]
                local_topk_differs |= local[0] != local[1]
                total = ranks[rank][key][step - 1][name]
                top = total.topk(k + 1).values
                if k < total.numel() and (top[k - 1] - top[k]) <= 1e-4 * top[k - 1]:
                    continue  # a near-tie at the cut: rounding may decide it
                assert cols == sorted(total.topk(k).indices.tolist()), (step, rank, name, cols)
                checked += 1
    assert local_topk_differs, "the ranks' local selections never differed: test is vacuous"
    assert checked >= len(selection_steps) * 2 * WORLD, checked


def test_reduce_gradients_without_ddp_matches_ddp(tmp_path, daemon):
    """Without DDP, reduce_gradients=True: the ranks' gradients differ, ZenFlowAdamW averages
    them (reduce-scatter); the hot sets agree and are the top-k of the mean gradient's scores,
    and the run equals the DDP run within PARAM_ATOL (DDP divides each rank's gradient by the
    world size before summing, the reduce-scatter sums then divides: rounding only)."""
    ranks = run_ranks("reduce", tmp_path)
    assert_same_hot_sets(ranks)
    check_selections(ranks, "mean_scores")
    ddp = run_ranks("ddp", tmp_path)
    for name, p in ddp[0]["params"].items():
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
        assert (ranks[0]["params"][name] - p).abs().max().item() <= PARAM_ATOL, name
    for step in range(STEPS):
        assert models.rel_diff(ranks[0]["losses"][step], ddp[0]["losses"][step]) <= LOSS_RTOL


def test_scores_are_reduced_over_the_process_group_only(tmp_path):
    """process_group= a group of each rank alone (as a tensor-parallel rank's data-parallel
    group would be): no score crosses to the other rank, so each rank's hot set is the top-k of
    its own scores, and the two differ."""
    ranks = run_ranks("own-group", tmp_path)
    check_selections(ranks, "scores")
    assert any(ranks[0]["hot"][s][0] != ranks[0]["hot"][s][1] for s in range(STEPS))
