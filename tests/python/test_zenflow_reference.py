"""ZenFlowAdamW (the C++ engine and stallfreed) against ReferenceZenFlow (zenflow_reference.py:
plain PyTorch, written from ARCHITECTURE.md, calling nothing of stallfree), on TinyLM with two
param groups and a cosine schedule, fp32 transfers, 48 steps, in every combination of awaited /
asynchronous updates and S = 1 / 4, with a reselection every 2S steps (>= 5 reselections), and
with the default warm-up of 20 steps running into rounds.

Bit for bit. The reference does AdamW as kernels/optimizer.h states it, one correctly rounded
fp32 operation at a time with its constants rounded from double once (zenflow_reference.py,
_adamw_), and the daemon's round gradient as it accumulates it (scale 1/S in fp32): so the
losses and the parameters must be equal, not close. A reference that is wrong by the smallest
amount (its lr off by 1e-6 relative, a few fp32 ulps), or wrong in the algorithm (no staleness,
cold gradients summed instead of averaged), differs (test_a_slightly_wrong_reference_differs).
"""
import copy

import pytest
import torch

import models
from stallfree.torch import ZenFlowAdamW
from zenflow_reference import ReferenceZenFlow

STEPS = 48
SEED = 11


def config(S, await_updates, predict_cold=True):
    # No engine warm-up, so the rounds begin at once; rounds land predicted (the engine's
    # default) unless asked.
    return dict(topk_ratio=0.25, update_interval=S, select_interval=2 * S,
                await_updates=await_updates, warmup_steps=0, predict_cold=predict_cold)


def run_engine(daemon, S, await_updates, record_hot=None, predict_cold=True):
    return models.train(
        lambda g: ZenFlowAdamW(g, betas=(0.9, 0.999), eps=1e-8, grad_dtype="fp32",
                               param_dtype="fp32", socket=daemon.socket,
                               **config(S, await_updates, predict_cold)),
        STEPS, seed=SEED, after_step=record_hot)


def run_reference(S, await_updates, record_hot=None, **overrides):
    cfg = dict(config(S, await_updates))
    cfg.update(overrides)
    return models.train(lambda g: ReferenceZenFlow(g, betas=(0.9, 0.999), eps=1e-8, **cfg),
                        STEPS, seed=SEED, after_step=record_hot)


def assert_bit_for_bit(eng, ref, what):
    for step, (a, b) in enumerate(zip(eng.losses, ref.losses), 1):
        assert a == b, (what, step, a, b)
    for name, p in ref.params.items():
        assert torch.equal(eng.params[name], p), (what, name,
                                                  (eng.params[name] - p).abs().max().item())
    print(f"{what}: the losses and parameters of all {len(eng.losses)} steps equal")


def hot_recorder():
    log = []

    def after_step(step, model, opt, extra):
        log.append({n: opt.hot_columns(p) for n, p in model.named_parameters() if p.dim() == 2})
        if hasattr(opt, "reselections"):
            extra["reselections"] = opt.reselections

    return log, after_step


@pytest.mark.parametrize("S", [1, 4])
@pytest.mark.parametrize("await_updates", [True, False], ids=["awaited", "async"])
def test_engine_equals_reference(daemon, S, await_updates):
    eng_hot, eng_rec = hot_recorder()
    ref_hot, ref_rec = hot_recorder()
    eng = run_engine(daemon, S, await_updates, eng_rec)
    ref = run_reference(S, await_updates, ref_rec)
    assert ref.extra["reselections"] >= 3, ref.extra
    # The same hot sets at every step (the reselections really move columns).
    assert eng_hot == ref_hot
    assert any(ref_hot[i] != ref_hot[i - 1] for i in range(1, STEPS))
    assert_bit_for_bit(eng, ref, f"S={S} awaited={await_updates}")


def test_rounds_landed_as_computed_equal_the_reference(daemon):
    """predict_cold=False with rounds of one step: each lands as the daemon computed it, bit
    for bit; and that is not the default's trajectory (which predicts rounds of one step)."""
    eng = run_engine(daemon, 1, False, predict_cold=False)
    ref = run_reference(1, False, predict_cold=False)
    assert_bit_for_bit(eng, ref, "S=1 without the prediction")
    default = run_reference(1, False)
    assert max(models.max_abs_diff(eng.params, default.params).values()) > 0
    assert eng.losses[-1] < eng.losses[0] - 0.3  # it trains


@pytest.mark.parametrize("land_lag", [1, 2])
@pytest.mark.parametrize("transfers", ["direct", "buffered"])
def test_land_lag_equals_reference(daemon, land_lag, transfers):
    """Rounds of S = 4 whose update lands land_lag steps after its boundary (not at the next
    boundary), through the pinned slots straight and through device buffers (the prefetch
    then runs in the step before the landing), bit for bit; and it is not the default's
    trajectory."""
    cfg = dict(config(4, False), land_lag=land_lag)
    eng = models.train(lambda g: ZenFlowAdamW(g, betas=(0.9, 0.999), eps=1e-8, grad_dtype="fp32",
                                              param_dtype="fp32", transfers=transfers,
                                              socket=daemon.socket, **cfg), STEPS, seed=SEED)
    ref = run_reference(4, False, land_lag=land_lag)
    assert_bit_for_bit(eng, ref, f"S=4 land_lag={land_lag} {transfers}")
    default = run_reference(4, False)
    assert max(models.max_abs_diff(eng.params, default.params).values()) > 0


def test_the_warm_up_into_rounds_equals_the_reference(daemon):
    """The warm-up path: 20 warm-up steps (S = 1, awaited), then asynchronous rounds of 4 with
    a reselection every 8 steps, bit for bit."""
    cfg = dict(topk_ratio=0.25, update_interval=4, select_interval=8, await_updates=False,
               warmup_steps=20, predict_cold=True)
    eng = models.train(lambda g: ZenFlowAdamW(g, betas=(0.9, 0.999), eps=1e-8, **models.FP32,
                                              socket=daemon.socket, **cfg), STEPS, seed=SEED)
    ref = models.train(lambda g: ReferenceZenFlow(g, betas=(0.9, 0.999), eps=1e-8, **cfg),
                       STEPS, seed=SEED)
    assert_bit_for_bit(eng, ref, "warm-up 20, then S=4 asynchronous")


def test_a_slightly_wrong_reference_differs(daemon):
    """Equality is not vacuous: a reference wrong by a few ulps of lr, or in the algorithm,
    differs from the engine."""
    eng = run_engine(daemon, 4, False)
    wrong = {
        "lr 1e-6 off": run_reference(4, False, lr_scale=1 + 1e-6),
        "lr 1% off": run_reference(4, False, lr_scale=1.01),
        "no staleness": run_reference(4, True),
        "summed, not averaged": run_reference(4, False, cold_scale=4.0),
    }
    for what, ref in wrong.items():
        loss = max(models.rel_diff(a, b) for a, b in zip(eng.losses, ref.losses))
        par = max(models.max_abs_diff(eng.params, ref.params).values())
        print(f"{what}: loss rel {loss:.2e}, params {par:.2e}")
        assert par > 0, what


def test_reference_bf16_model_shows_the_rounding_of_its_fp32_masters():
    """The reference with a bf16 model (ARCHITECTURE.md, "Precision"), S = 1 awaited (every
    column current after every step): each value the model shows is exactly its fp32 master
    rounded to bf16, hot and cold columns and parameters wholly on the device alike; and
    training on fp32 masters is not training on the bf16 values: a model that rebuilds its
    masters from them each step (the drifting recipe) ends elsewhere."""
    def check(step, model, opt, extra):
        for p in model.parameters():
            st = opt.state[p]
            sp = st.get("split")
            master = st["master"] if sp is None else sp.master.view(p.shape)
            assert torch.equal(p.data, master.to(torch.bfloat16)), step

    def drift(step, model, opt, extra):
        for p in model.parameters():
            st = opt.state[p]
            sp = st.get("split")
            if sp is None:
                st["master"].copy_(p.data.float())
            else:
                sp.master.copy_(p.data.view(-1, sp.cols).float())

    cfg = dict(config(1, True))

    def bf16_run(after_step):
        model = models.make_model(SEED).to(torch.bfloat16)
        return models.train(lambda g: ReferenceZenFlow(g, betas=(0.9, 0.999), eps=1e-8, **cfg),
                            STEPS, seed=SEED, model=model, after_step=after_step)

    exact, drifting = bf16_run(check), bf16_run(drift)
    fp32 = run_reference(1, True)
    gap = max(models.rel_diff(a, b) for a, b in zip(exact.losses, fp32.losses))
    drift_gap = max(models.rel_diff(a, b) for a, b in zip(drifting.losses, exact.losses))
    print(f"bf16 model vs fp32 model: loss rel {gap:.2e}; drifting masters vs fp32 masters "
          f"{drift_gap:.2e}")
    assert exact.losses[-1] < exact.losses[0] - 0.3  # it trains
    assert drift_gap > 1e-3


def _resizes(intervals, W):
    """The reference's `resize` from the engine's per-step round lengths (one list per param
    group, step 1 first): where the length after step t differs from step t's."""
    return {gi: {t: seq[t] for t in range(W, len(seq)) if seq[t] != seq[t - 1]}
            for gi, seq in enumerate(intervals)}


def test_automatic_round_equals_reference_through_a_state_dict(daemon):
    """update_interval "auto" (the default): whatever round lengths the engines choose from the
    daemon's pace and the caller's (they come from timing), the reference replaying those
    choices equals the run bit for bit; and so does a run resumed from a state_dict taken after
    step 11 (not a round boundary for any length above 1) into a new optimizer, whose length
    comes back from the state dict."""
    W, save_at = 4, 11
    cfg = dict(topk_ratio=0.25, warmup_steps=W, grad_dtype="fp32", param_dtype="fp32")

    def make(g):
        return ZenFlowAdamW(g, betas=(0.9, 0.999), eps=1e-8, socket=daemon.socket, **cfg)

    def recorder(log, saved=None):
        def after_step(step, model, opt, extra):
            log.append([e.last_timings()["interval"] for e in opt._engines])
            if saved is not None and step == save_at:
                saved.update(model={k: v.clone() for k, v in model.state_dict().items()},
                             opt=copy.deepcopy(opt.state_dict()),
                             sched=extra["sched"].state_dict())
        return after_step

    first, saved = [], {}
    eng = models.train(make, STEPS, seed=SEED, after_step=recorder(first, saved))
    model = models.make_model(SEED)
    model.load_state_dict(saved["model"])

    def setup(model, opt, sched):
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])

    second = []
    resumed = models.train(make, STEPS, seed=SEED, model=model, start=save_at + 1, setup=setup,
                           after_step=recorder(second))
    for what, run, log in (("uninterrupted", eng, first),
                           ("resumed", None, first[:save_at] + second)):
        intervals = [list(col) for col in zip(*log)]
        print(f"{what}: round lengths per group {[sorted(set(s)) for s in intervals]}")
        assert all(s[:W] == [1] * W for s in intervals), intervals
        ref = models.train(lambda g: ReferenceZenFlow(
            g, betas=(0.9, 0.999), eps=1e-8, topk_ratio=0.25, warmup_steps=W, predict_cold=True,
            update_interval="auto", resize=_resizes(intervals, W)), STEPS, seed=SEED)
        if run is None:  # the resumed run's steps after the save
            assert resumed.losses == ref.losses[save_at:], what
            for name, p in ref.params.items():
                assert torch.equal(resumed.params[name], p), (what, name)
        else:
            assert_bit_for_bit(run, ref, f"update_interval auto, {what}")
    # The state dict held the round's length: the resumed run's first step runs it.
    assert second[0] == first[save_at], (first, second)


def test_reference_resize_is_not_the_fixed_round():
    """The reference's resize changes the trajectory (so replaying the engine's choices is not
    vacuous): rounds of 1 resized to 2 after step 4 differ from rounds of 1 throughout, and
    resized to 4 equal the fixed S = 4 run with the warm-up ending at step 4."""
    def ref(**kw):
        return models.train(lambda g: ReferenceZenFlow(g, topk_ratio=0.25, warmup_steps=4, **kw),
                            24, seed=SEED)
    ones = ref(update_interval="auto")
    twos = ref(update_interval="auto", resize={0: {4: 2}, 1: {4: 2}})
    fours = ref(update_interval="auto", resize={0: {4: 4}, 1: {4: 4}})
    fixed = ref(update_interval=4)
    assert max(models.max_abs_diff(ones.params, twos.params).values()) > 0
    assert fours.losses == fixed.losses
    assert all(torch.equal(fours.params[n], p) for n, p in fixed.params.items())
