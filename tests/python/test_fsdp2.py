"""ZenFlowAdamW on FSDP2 (torch.distributed.fsdp.fully_shard) parameters, gloo ranks on the CPU
(dp_worker.py with WRAP "fsdp2" and "hsdp").

Each rank's engine works on its own rows of every parameter (the DTensor's local shard), with
the gradient FSDP2 reduce-scattered; the column scores are summed over the shard group (and,
under HSDP, over the replicate group, over which the local rows are partitioned as over DDP's
replicas), so every rank selects the same hot columns. The tolerances are test_partition.py's:
the exact configurations must equal torch.optim.AdamW in one process on the whole batch within
models.PARAM_ATOL / LOSS_RTOL (FSDP2 adds only the rounding of averaging L partial-batch
gradients, as DDP does), and the zenflow defaults equal the one process within
test_partition.DEFAULTS_LOSS_RTOL.
"""
import json

import pytest

import models
from conftest import run_ranks
from test_partition import (DEFAULTS_LOSS_RTOL, DEFAULTS_STEPS, EXACT, FIXED_ROUND, SEED, STEPS,
                            assert_equals_adamw, assert_ranks_agree, train_ranks)


@pytest.fixture(scope="module")
def adamw():
    return {odd: models.train(models.adamw_factory(), STEPS, seed=SEED,
                              model=models.make_model(SEED, odd=odd)) for odd in (False, True)}


@pytest.mark.parametrize("wrap,world", [("fsdp2", 2), ("fsdp2", 4), ("hsdp", 4)])
def test_exact_configurations_equal_adamw_on_the_whole_batch(daemon, adamw, tmp_path, wrap,
                                                             world):
    runs = {k: v for k, v in EXACT.items() if not v.get("_odd")}
    result = train_ranks(world, tmp_path, [daemon.socket], runs, wrap=wrap)
    for run, ranks in result.items():
        assert_ranks_agree(ranks)
        assert_equals_adamw(ranks, adamw[False])


def test_zenflow_defaults_equal_one_process(daemon, tmp_path):
    """The zenflow defaults (rounds of 4 after the warm-up, bf16 transfers) on FSDP2 with 2 and 4
    ranks and on HSDP (2 x 2) equal the one process on the whole batch within the defaults'
    tolerance (test_partition.py's), with the same hot columns as it at every step."""
    from stallfree.torch import ZenFlowAdamW

    def record_hot(step, model, opt, extra):
        extra.setdefault("hot", []).append(
            {n: opt.hot_columns(p) for n, p in model.named_parameters() if p.dim() == 2})

    ref = models.train(lambda g: ZenFlowAdamW(g, socket=daemon.socket, **FIXED_ROUND),
                       DEFAULTS_STEPS, seed=SEED, after_step=record_hot)
    for wrap, world in (("fsdp2", 2), ("fsdp2", 4), ("hsdp", 4)):
        ranks = train_ranks(world, tmp_path / f"{wrap}{world}", [daemon.socket],
                            {"defaults": FIXED_ROUND}, wrap=wrap,
                            steps=DEFAULTS_STEPS)["defaults"]
        assert_ranks_agree(ranks)
        losses = [sum(r["losses"][s] for r in ranks) / world for s in range(DEFAULTS_STEPS)]
        diff = max(models.rel_diff(a, b) for a, b in zip(losses, ref.losses))
        print("zenflow defaults, %s on %d ranks vs one process: losses %.3g" % (wrap, world, diff))
        assert diff <= DEFAULTS_LOSS_RTOL, (wrap, world, diff)
        assert ranks[0]["hot"] == ref.extra["hot"], (wrap, world)


def test_uneven_shards(daemon, tmp_path):
    """TinyLM of width 66 on 4 FSDP2 ranks: FSDP2 cuts each 66-row weight into 17, 17, 17 and 15
    rows (the last rank's block short): the exact configurations equal AdamW on the whole batch."""
    width = dict(vocab=66, d=66, hidden=66)
    ref = models.train(models.adamw_factory(), STEPS, seed=SEED,
                       model=models.make_model(SEED, **width))
    runs = {k: dict(v, _width=66) for k, v in EXACT.items() if not v.get("_odd")}
    result = train_ranks(4, tmp_path, [daemon.socket], runs, wrap="fsdp2")
    for run, ranks in result.items():
        assert_ranks_agree(ranks)
        assert_equals_adamw(ranks, ref)


def test_a_parameter_some_ranks_hold_none_of_is_refused_on_every_rank(daemon, tmp_path):
    """TinyLM(odd=True) on 4 FSDP2 ranks: its [2, 3, d] weight has 2 rows in dimension 0, so
    ranks 2 and 3 hold none of it (the model's cube, the first parameter of its first group).
    Every rank refuses it at construction, naming it (none waits
    in a collective for the others)."""
    runs = {"odd": dict(EXACT["zenflow-S1"], _odd=True)}
    codes, outputs = run_ranks("dp_worker.py", 4, [STEPS, SEED, tmp_path, daemon.socket,
                                                   json.dumps(runs), "fsdp2"],
                               tmp_path, expect=[1, 1, 1, 1])
    for out in outputs:
        assert "parameter 'param_groups[0][0]' (shape [2, 3, 32]) has 2 rows in dimension 0, " \
               "too few for FSDP2's 4 shards: ranks 2..3" in out, out[-2000:]
