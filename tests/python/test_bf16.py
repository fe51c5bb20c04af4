"""ZenFlowAdamW on a bf16 model (issue 22): the fp32 masters are the optimizer's (the engine's
on the device, the daemon's for the cold columns), the bf16 values are always their rounding.

TinyLM in torch.bfloat16 (values and gradients), two param groups, a cosine schedule.

Tolerance. No-offload against torch.optim.AdamW stepping fp32 master copies (the usual mixed-
precision recipe: the model's bf16 gradients widened, the masters rounded into the model after
each step). Both sides round the same fp32 masters to bf16, but their fp32 AdamW arithmetic
differs in order (SIMD kernels against torch's ops), and a master that lands on the other side
of a bf16 rounding boundary changes the next forward pass, which compounds. Calibrated here, in
the test: the recipe against itself with its lr perturbed by 1e-6 relative (8 fp32 ulps, a
systematic perturbation of the size of those roundings) moves the losses by `calib`; the bound
is 5 x calib, and the drifting recipe (AdamW on the bf16 values themselves, no masters) must
miss it.
"""
import pytest
import torch

import models
import stallfree
from stallfree.torch import ZenFlowAdamW
from zenflow_reference import ReferenceZenFlow

STEPS = 24
SEED = 13
BF16 = torch.bfloat16


def bf16_model():
    return models.make_model(SEED).to(BF16)


class MasterAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over fp32 master copies of a bf16 model's parameters: the model's bf16
    gradients widened into the masters, the masters rounded into the model after each step."""

    def __init__(self, groups, lr_scale=1.0):
        self.model_params = [p for g in groups for p in g["params"]]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.model_params]
        of = dict(zip(map(id, self.model_params), self.masters))
        super().__init__([dict(g, params=[of[id(p)] for p in g["params"]],
                               lr=g["lr"] * lr_scale) for g in groups],
                         betas=(0.9, 0.999), eps=1e-8)

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        for p in self.model_params:
            p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in zip(self.model_params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        super().step()
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)  # round to nearest even


def masters_recipe(lr_scale=1.0):
    return lambda groups: MasterAdamW(groups, lr_scale)


def drifting(groups):
    """AdamW on the bf16 values themselves: the master rebuilt from the bf16 value each step."""
    return torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-8)


def loss_gap(a, b):
    return max(models.rel_diff(x, y) for x, y in zip(a.losses, b.losses))


@pytest.fixture(scope="module")
def recipe_runs():
    ref = models.train(masters_recipe(), STEPS, seed=SEED, model=bf16_model())
    calib = loss_gap(models.train(masters_recipe(1 + 1e-6), STEPS, seed=SEED,
                                  model=bf16_model()), ref)
    drift = loss_gap(models.train(drifting, STEPS, seed=SEED, model=bf16_model()), ref)
    return ref, calib, drift


def test_no_offload_bf16_equals_adamw_on_fp32_masters(daemon, recipe_runs):
    ref, calib, drift = recipe_runs
    got = models.train(lambda g: ZenFlowAdamW(g, mode="no-offload"), STEPS, seed=SEED,
                       model=bf16_model())
    gap = loss_gap(got, ref)
    print(f"bf16 no-offload vs AdamW on fp32 masters: {gap:.3g} (bound {5 * calib:.3g}; "
          f"drifting recipe {drift:.3g})")
    assert calib > 0
    assert gap <= 5 * calib
    assert drift > 5 * calib
    assert all(p.dtype == BF16 for p in got.params.values())
    assert got.losses[-1] < got.losses[0] - 0.3


# Every mode on the bf16 model against the plain-PyTorch reference with fp32 masters
# (zenflow_reference.py; in sync-offload and no-offload every parameter is dense there: AdamW on
# the masters): (engine mode, engine options, the reference's kind).
EXACT_CASES = {
    "zenflow S=1 awaited fp32 transfers": (
        "zenflow", dict(models.FP32, topk_ratio=0.25, update_interval=1, select_interval=2,
                        await_updates=True, warmup_steps=0), None),
    "zenflow S=4 asynchronous bf16 transfers": (
        "zenflow", dict(topk_ratio=0.25, update_interval=4, select_interval=8, warmup_steps=2,
                        predict_cold=True), None),
    "zenflow S=4 asynchronous, gradients streamed": (
        "zenflow", dict(topk_ratio=0.25, update_interval=4, select_interval=8, warmup_steps=2,
                        stream_gradients=True, predict_cold=True), None),
    "sync-offload": ("sync-offload", dict(warmup_steps=0), "dense"),
    "no-offload": ("no-offload", dict(warmup_steps=0), "dense"),
}


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_bf16_engine_equals_the_reference_bit_for_bit(daemon, tmp_path, case):
    """The engine on a bf16 model equals the reference bit for bit at every step, losses and
    final bf16 values, with reselections; and a run saved after step 9 (mid-round in zenflow
    S = 4: its rounds end at steps 6, 10, ...; buffered transfers) and resumed from the state
    dict in a fresh model and optimizer (direct transfers) equals the reference's uninterrupted
    run from step 10 on."""
    mode, opts, ref_kind = EXACT_CASES[case]
    ref_opts = dict(topk_ratio=1.0, update_interval=1, await_updates=True, warmup_steps=0) \
        if ref_kind == "dense" else {k: v for k, v in opts.items()
                                     if k not in models.FP32 and k != "stream_gradients"}
    ref = models.train(lambda g: ReferenceZenFlow(g, betas=(0.9, 0.999), eps=1e-8, **ref_opts),
                       STEPS, seed=SEED, model=bf16_model())

    def save(step, model, opt, extra):
        if step == 9:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": extra["sched"].state_dict()}, tmp_path / "ck.pt")

    def engine(transfers):
        return lambda g: ZenFlowAdamW(g, betas=(0.9, 0.999), eps=1e-8, mode=mode,
                                      socket=daemon.socket, transfers=transfers, **opts)

    whole = models.train(engine("buffered"), STEPS, seed=SEED, model=bf16_model(),
                         after_step=save)
    assert whole.losses == ref.losses
    for name, p in ref.params.items():
        assert p.dtype == BF16 and torch.equal(whole.params[name], p), name
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    model = bf16_model()
    model.load_state_dict(ck["model"])

    def setup(model_, opt, sched):
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])

    rest = models.train(engine("direct"), STEPS, seed=SEED, model=model, start=10, setup=setup)
    assert rest.losses == ref.losses[9:]
    for name, p in ref.params.items():
        assert torch.equal(rest.params[name], p), name
    assert whole.losses[-1] < whole.losses[0] - 0.3  # it trains


def test_device_bytes_of_a_bf16_model(daemon):
    """The engine's accounting: a bf16 parameter's value and gradient are 4 bytes an element,
    and in zenflow the engine's own device bytes stay a small share of an fp32 model's 16."""
    model = bf16_model()
    opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket)
    try:
        loss = models.loss_fn(model, models.batch(SEED, 1))
        loss.backward()
        opt.step()
        db = opt.device_bytes
    finally:
        opt.close()
    n = sum(p.numel() for p in model.parameters())
    assert db["params"] == 4 * n, db
    assert db["total"] == db["params"] + db["engine"], db
    print("bf16 TinyLM zenflow: %.2f device bytes per parameter (%s)" % (db["total"] / n, db))


@pytest.mark.parametrize("transfers,want", [("direct", 5.275), ("buffered", 8.877)])
def test_device_bytes_per_parameter_of_square_bf16_weights(daemon, transfers, want):
    """Three bf16 1024 x 1024 weights, top-k 0.1: the device bytes per parameter the engine
    counts (tests/engine/zenflow_bf16_test.cc counts them by hand: 5.275 direct, within the
    5.3 of issue 22; 8.877 buffered), through the binding, after a step."""
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False)
                                  for _ in range(3)]).to(BF16)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, transfers=transfers, warmup_steps=0,
                       socket=daemon.socket)
    try:
        model(torch.randn(4, 1024, dtype=BF16)).float().square().mean().backward()
        opt.step()
        db, used = opt.device_bytes, opt.device_transfers
    finally:
        opt.close()
    n = 3 * 1024 * 1024
    assert used == transfers
    assert db["params"] == 4 * n, db
    assert round(db["total"] / n, 3) == want, db
    print("%s: %.3f device bytes per parameter %s" % (transfers, db["total"] / n, db))


def test_device_budget_buys_the_hot_share_that_fits(daemon):
    """device_budget on the three bf16 1024 x 1024 weights above, direct transfers: the engine
    takes 12 bytes a hot element (master, m, v), 16 k + 12288 a weight of selection and 2048 k
    of the hot gradient's scratch, 38960 k + 36864 bytes for k hot columns (k = 102: 4010784,
    the hand count of tests/engine). 2.5 bytes a parameter (7864320) fits k = 200 (200.9), the
    largest share in steps of 0.001 that rounds to 200 columns is 0.195 (0.196 rounds to 201);
    the engine's device bytes then stay within the budget. Refused: with topk_ratio too, below
    the least, in sync-offload."""
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False)
                                  for _ in range(3)]).to(BF16)
    n = 3 * 1024 * 1024
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, transfers="direct", warmup_steps=0,
                       device_budget=2.5, socket=daemon.socket)
    try:
        model(torch.randn(4, 1024, dtype=BF16)).float().square().mean().backward()
        opt.step()
        assert opt.topk_ratio == 0.195
        assert [len(opt.hot_columns(p)) for p in model.parameters()] == [200] * 3
        db = opt.device_bytes
        assert db["engine"] == 38960 * 200 + 36864 <= 2.5 * n, db
    finally:
        opt.close()
    with pytest.raises(ValueError, match="give one"):
        ZenFlowAdamW(model.parameters(), topk_ratio=0.2, device_budget=2.5, socket=daemon.socket)
    with pytest.raises(ValueError, match="device_budget.*least"):
        ZenFlowAdamW(model.parameters(), device_budget=0.01, transfers="direct",
                     socket=daemon.socket)
    with pytest.raises(ValueError, match="device_budget.*sync-offload"):
        ZenFlowAdamW(model.parameters(), device_budget=4, mode="sync-offload",
                     socket=daemon.socket)


def test_streamed_gradients_leave_during_the_backward(daemon):
    """stream_gradients: after backward() the split weights hold no gradient (the engine has
    it), the 1-D ones keep theirs; the device bytes count the split weights' values only; a
    second backward before step() (gradient accumulation) raises naming the weight; other modes
    and data parallelism are refused at construction."""
    model = bf16_model()
    opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket, warmup_steps=0,
                       stream_gradients=True)
    try:
        models.loss_fn(model, models.batch(SEED, 1)).backward()
        named = dict(model.named_parameters())
        # The split weights (fewer hot columns than columns) lost their gradient, all others
        # kept theirs.
        want = {n for n, p in named.items() if len(opt.hot_columns(p)) < p.shape[-1]}
        split = {n for n, p in named.items() if p.grad is None}
        kept = {n for n, p in named.items() if p.grad is not None}
        assert want and split == want and kept == set(named) - want, (want, split, kept)
        n_split = sum(model.get_parameter(n).numel() for n in split)
        n_all = sum(p.numel() for p in model.parameters())
        db = opt.device_bytes
        assert db["params"] == 2 * n_all + 2 * (n_all - n_split), db
        assert db["transient_peak"] >= 2 * max(model.get_parameter(n).numel() for n in split)
        opt.step()
        opt.zero_grad()
        loss = models.loss_fn(model, models.batch(SEED, 2))
        loss.backward(retain_graph=True)
        with pytest.raises(stallfree.Error, match="already has a gradient"):
            loss.backward()
    finally:
        opt.close()
    with pytest.raises(ValueError, match="stream_gradients: only in mode 'zenflow'"):
        ZenFlowAdamW(bf16_model().parameters(), mode="sync-offload", stream_gradients=True,
                     socket=daemon.socket)


def test_clip_grad_norm_includes_streamed_gradients(daemon):
    """stream_gradients with opt.clip_grad_norm_(0.1) every step (TinyLM fp32, zenflow S = 1
    awaited, fp32 transfers: exact AdamW) equals the same optimizer without streaming clipped by
    torch.nn.utils.clip_grad_norm_ within models' tolerances (the total norm's summation order
    differs, so the clip factor by an ulp or so: measured below); torch's function on the
    streaming run, which cannot see the streamed gradients, misses by far more (the control)."""
    config = dict(mode="zenflow", update_interval=1, await_updates=True, warmup_steps=0,
                  topk_ratio=0.25, **models.FP32)

    def run(stream, ours):
        model = models.make_model(SEED)
        opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket,
                           stream_gradients=stream, **config)
        norms = []
        try:
            for step in range(1, 7):
                opt.zero_grad(set_to_none=True)
                models.loss_fn(model, models.batch(SEED, step)).backward()
                if ours:
                    norms.append(float(opt.clip_grad_norm_(0.1)))
                else:
                    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
                opt.step()
        finally:
            opt.close()
        return models.snapshot(model), norms

    want, want_norms = run(stream=False, ours=False)
    got, got_norms = run(stream=True, ours=True)
    blind, _ = run(stream=True, ours=False)
    assert min(want_norms) > 0.1  # every step clipped
    assert got_norms == pytest.approx(want_norms, rel=1e-6)
    worst = max(models.max_abs_diff(got, want).values())
    missed = max(models.max_abs_diff(blind, want).values())
    print("clip with streamed gradients: %.3g (torch's clip on them: %.3g)" % (worst, missed))
    assert worst <= models.PARAM_ATOL
    assert missed > 100 * models.PARAM_ATOL
    # The streamed gradients' norms are taken as 2-norms when they leave: another norm_type is
    # refused, naming it, rather than computed from the wrong norms.
    model = models.make_model(SEED)
    opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket, stream_gradients=True,
                       **config)
    try:
        models.loss_fn(model, models.batch(SEED, 1)).backward()
        with pytest.raises(stallfree.Error, match="as 2-norms only"):
            opt.clip_grad_norm_(0.1, norm_type=float("inf"))
    finally:
        opt.close()


def test_a_grad_scaler_is_refused_with_streamed_gradients(daemon):
    """torch's GradScaler cannot unscale (or check for inf) gradients that left during the
    backward: with stream_gradients its step() is refused naming both, before anything changes
    (the optimizer's step count stays 0); without streaming it works as with any optimizer."""
    for stream in (True, False):
        model = models.make_model(SEED)
        opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket,
                           stream_gradients=stream, warmup_steps=0, **models.FP32)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        try:
            scaler.scale(models.loss_fn(model, models.batch(SEED, 1))).backward()
            if stream:
                with pytest.raises(stallfree.Error, match="stream_gradients with a GradScaler"):
                    scaler.step(opt)
                assert all(float(st["step"]) == 0 for st in opt.state.values())
            else:
                scaler.step(opt)
                assert all(float(st["step"]) == 1 for st in opt.state.values())
        finally:
            opt.close()
