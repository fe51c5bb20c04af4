"""ZenFlowAdamW under torch 2.x: what torch's own machinery does with an optimizer.

- torch.load(weights_only=True) (torch 2.6's default, Hugging Face's resume) loads its state
  dict, before the first step and mid-round, and the run continues bit for bit;
- torch.distributed.checkpoint.state_dict's get_/set_optimizer_state_dict round trip neither
  steps the optimizer (its _init_optim_state runs a zero-gradient step on an empty
  optimizer.state) nor drops the engine's and the daemon's part;
- optimizer.state holds each parameter's step count, as torch.optim.AdamW's does;
- param_names (torch 2.6) are kept, also by add_param_group, and checked on load;
- add_param_group and step() are all or nothing;
- hyper-parameters are accepted and refused as torch.optim.AdamW does (inf aside), and the
  accepted edge values (eps = 0, lr = 0, betas 0) compute what torch computes;
- the state-dict hooks see the whole state; a Tensor lr works;
- tensor-parallel DTensors and other tensor subclasses are refused naming the parameter;
- on CUDA, a step runs in the order of the stream current at that step.
"""
import inspect
import io
import json

import pytest
import torch

import models
import stallfree
from conftest import run_python
from stallfree.torch import ZenFlowAdamW

FP32 = models.FP32
# Rounds with an asynchronous daemon Update and a reselection (no warm-up: rounds at once).
ZENFLOW = dict(mode="zenflow", update_interval=4, select_interval=8, topk_ratio=0.1,
               warmup_steps=0)
EXACT = dict(mode="zenflow", topk_ratio=0.25, update_interval=1, select_interval=2,
             await_updates=True, warmup_steps=0, **FP32)
STEPS = 14
SAVE_AT = 6  # mid-round: round 1's Update pending, round 2 has pushed 2 of 4 gradients


def factory(daemon, **config):
    socket = None if config.get("mode") == "no-offload" else daemon.socket
    return lambda groups: ZenFlowAdamW(groups, socket=socket, **config)


save_at, resume_from = models.save_at, models.resume_from


def assert_same_run(run, ref, what, start=0):
    """`run` (steps start+1 on) equals `ref` from there bit for bit: losses and parameters."""
    assert run.losses == ref.losses[start:], (what, run.losses, ref.losses[start:])
    for name in ref.params:
        assert torch.equal(run.params[name], ref.params[name]), (what, name)


@pytest.mark.parametrize("mode", ["no-offload", "sync-offload", "zenflow"])
@pytest.mark.parametrize("save_step", [0, SAVE_AT], ids=["before-step-1", "mid-round"])
def test_weights_only_load_continues_exactly(mode, save_step, daemon):
    config = dict(ZENFLOW, mode=mode) if mode == "zenflow" else dict(mode=mode, **FP32)
    ref = models.train(factory(daemon, **config), STEPS, seed=1)
    saved = {}
    if save_step == 0:
        model = models.make_model(1)
        opt = factory(daemon, **config)(models.param_groups(model))
        sched = models.make_scheduler(opt, STEPS)
        save_at(0, saved)(0, model, opt, {"sched": sched})
        opt.close()
    else:
        models.train(factory(daemon, **config), STEPS, seed=1,
                     after_step=save_at(save_step, saved))
    # Only tensors, dicts, lists, strings and numbers: the weights-only unpickler's types.
    sd = torch.load(io.BytesIO(saved["opt_bytes"]), weights_only=True)
    first = sd["state"][0]
    assert first["zenflow_engine"].dtype == torch.uint8
    meta = json.loads(bytes(first["zenflow_meta"].tolist()).decode())
    assert meta["config"]["mode"] == mode and meta["version"] == 2
    if mode != "no-offload" and save_step > 0:
        assert first["zenflow_daemon"].numel() > 0  # the daemon's part travels
    run = models.train(factory(daemon, **config), STEPS, seed=1, start=save_step + 1,
                       setup=resume_from(saved, lambda m, o: o.load_state_dict(sd)))
    assert_same_run(run, ref, "resumed", start=save_step)


def test_version_1_state_dict_still_loads(daemon):
    """stallfree 0.1.0 wrote the engines as bytes under a top-level "stallfree" key and nothing
    in "state": such a state dict, made here from a current one, continues exactly."""
    ref = models.train(factory(daemon, **ZENFLOW), STEPS, seed=7)
    saved = {}
    models.train(factory(daemon, **ZENFLOW), STEPS, seed=7, after_step=save_at(SAVE_AT, saved))
    sd = torch.load(io.BytesIO(saved["opt_bytes"]), weights_only=True)
    engines = []
    for group in sd["param_groups"]:
        entry = sd["state"][group["params"][0]]
        meta = json.loads(bytes(entry["zenflow_meta"].tolist()).decode())
        engines.append({"shapes": meta["shapes"], "names": meta["names"],
                        "engine": bytes(entry["zenflow_engine"].tolist()),
                        "daemon": bytes(entry["zenflow_daemon"].tolist())})
    v1 = {"state": {}, "param_groups": sd["param_groups"],
          "stallfree": {"version": 1, "config": meta["config"], "engines": engines}}
    run = models.train(factory(daemon, **ZENFLOW), STEPS, seed=7, start=SAVE_AT + 1,
                       setup=resume_from(saved, lambda m, o: o.load_state_dict(v1)))
    assert_same_run(run, ref, "version 1", start=SAVE_AT)


def test_state_dict_from_before_the_automatic_round(daemon):
    """A state dict written before the automatic round (its configuration has no
    max_update_interval and no predict_cold; the round was then fixed and landed as computed)
    continues exactly in an optimizer built with its round and predict_cold=False; the new
    defaults (update_interval "auto", warmup_steps 100, predict_cold) refuse it, naming each
    option with the saved and the current value."""
    old = dict(ZENFLOW, warmup_steps=20, predict_cold=False)  # update_interval 4: as before
    ref = models.train(factory(daemon, **old), STEPS, seed=7)
    saved = {}
    models.train(factory(daemon, **old), STEPS, seed=7, after_step=save_at(SAVE_AT, saved))
    sd = torch.load(io.BytesIO(saved["opt_bytes"]), weights_only=True)
    for group in sd["param_groups"]:
        entry = sd["state"][group["params"][0]]
        meta = json.loads(bytes(entry["zenflow_meta"].tolist()).decode())
        del meta["config"]["max_update_interval"]
        del meta["config"]["predict_cold"]
        entry["zenflow_meta"] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    run = models.train(factory(daemon, **old), STEPS, seed=7, start=SAVE_AT + 1,
                       setup=resume_from(saved, lambda m, o: o.load_state_dict(sd)))
    assert_same_run(run, ref, "written before max_update_interval", start=SAVE_AT)
    defaults = {k: v for k, v in old.items()
                if k not in ("update_interval", "warmup_steps", "select_interval",
                             "predict_cold")}
    model = models.make_model(7)
    opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket, **defaults)
    try:
        with pytest.raises(stallfree.Error) as err:
            opt.load_state_dict(sd)
        assert "update_interval 4 (now 0)" in str(err.value), str(err.value)
        assert "warmup_steps 20 (now 100)" in str(err.value), str(err.value)
        assert "predict_cold false (now true)" in str(err.value), str(err.value)
    finally:
        opt.close()


def test_distributed_checkpoint_round_trip_neither_steps_nor_drops_the_daemon(daemon):
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    ref = models.train(factory(daemon, **ZENFLOW), STEPS, seed=2)
    saved = {}

    def save_with_dcp(step, model, opt, extra):
        if step == SAVE_AT:
            before = models.snapshot(model)
            steps_before = [e.step_count for e in opt._engines if e is not None]
            osd = get_optimizer_state_dict(model, opt)
            # Nothing stepped: the parameters and the engines' step counts are unchanged, and no
            # zero gradient was left behind.
            assert not models.changed(model, before)
            assert [e.step_count for e in opt._engines if e is not None] == steps_before
            assert all(p.grad is not None for p in model.parameters())
            # Keyed by name, with the engine's and the daemon's part of both groups.
            blobs = [k for k, v in osd["state"].items() if "zenflow_daemon" in v]
            assert blobs == ["emb.weight", "norm.weight"], blobs
            assert osd["state"]["emb.weight"]["zenflow_daemon"].numel() > 0
            saved["osd"] = osd
            saved["model"] = {k: v.clone() for k, v in model.state_dict().items()}
            saved["sched"] = extra["sched"].state_dict()

    models.train(factory(daemon, **ZENFLOW), STEPS, seed=2, after_step=save_with_dcp)

    def load(model, opt):
        set_optimizer_state_dict(model, opt, saved["osd"])
        assert [e.step_count for e in opt._engines] == [SAVE_AT, SAVE_AT]

    run = models.train(factory(daemon, **ZENFLOW), STEPS, seed=2, start=SAVE_AT + 1,
                       setup=resume_from(saved, load))
    assert_same_run(run, ref, "resumed", start=SAVE_AT)


@pytest.mark.parametrize("mode", ["no-offload", "zenflow"])
def test_state_holds_each_parameters_step_like_adamw(mode, daemon):
    """optimizer.state is never empty and counts each parameter's steps as torch's AdamW does
    (a step where its .grad is None does not count)."""
    config = EXACT if mode == "zenflow" else dict(mode=mode, **FP32)

    def drop(step, model, opt):
        if step in (2, 5):
            model.up.weight.grad = None

    counts = {}

    def record(step, model, opt, extra):
        counts.setdefault(type(opt).__name__, {})[step] = {
            n: float(opt.state[p]["step"]) for n, p in model.named_parameters()}

    model = models.make_model(0)
    opt = factory(daemon, **config)(models.param_groups(model))
    assert set(opt.state) == set(model.parameters())  # before any step
    assert all(float(s["step"]) == 0 for s in opt.state.values())
    opt.close()
    models.train(factory(daemon, **config), 6, before_step=drop, after_step=record)
    models.train(models.adamw_factory(), 6, before_step=drop, after_step=record)
    assert counts["ZenFlowAdamW"] == counts["AdamW"]
    assert counts["AdamW"][6]["up.weight"] == 4.0


def test_param_names_kept_and_checked_on_load(daemon):
    model = models.make_model(0)
    groups = models.param_groups(model, named=True)
    opt = ZenFlowAdamW(groups[:1], socket=daemon.socket, **EXACT)
    try:
        opt.add_param_group(groups[1])  # named, through add_param_group
        assert opt.param_groups[0]["param_names"] == ["emb.weight", "up.weight", "down.weight"]
        assert opt.param_groups[1]["param_names"] == ["norm.weight", "norm.bias", "up.bias"]
        models.plain_steps(model, opt, 2)
        sd = opt.state_dict()
        assert sd["param_groups"][1]["param_names"] == opt.param_groups[1]["param_names"]
    finally:
        opt.close()
    # Another model whose second group lists the same shapes under other names.
    other = models.make_model(0)
    g = models.param_groups(other, named=True)
    g[1]["params"] = [g[1]["params"][1], g[1]["params"][0], g[1]["params"][2]]
    with ZenFlowAdamW(g, socket=daemon.socket, **EXACT) as opt2:
        before = [e.step_count for e in opt2._engines]
        with pytest.raises(stallfree.Error) as err:
            opt2.load_state_dict(sd)
        msg = str(err.value)
        assert "param_groups[1]" in msg and "'norm.weight'" in msg and "'norm.bias'" in msg, msg
        assert opt2.param_groups[1]["param_names"] == ["norm.bias", "norm.weight", "up.bias"]
        assert [e.step_count for e in opt2._engines] == before


def assert_trains_as_adamw(opt, model, ref, ref_model, steps=3):
    """opt on model and torch's AdamW ref on ref_model (the same values), stepped side by side:
    the parameters end within models.PARAM_ATOL."""
    for step in range(1, steps + 1):
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad(set_to_none=True)
            models.loss_fn(m, models.batch(0, step)).backward()
            o.step()
    for (n, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert (a - b).abs().max().item() <= models.PARAM_ATOL, n


def test_add_param_group_is_all_or_nothing(daemon):
    model = models.make_model(0)
    groups = models.param_groups(model)
    ref_model = models.make_model(0)
    ref = torch.optim.AdamW(models.param_groups(ref_model)[:1], betas=(0.9, 0.999), eps=1e-8)
    opt = ZenFlowAdamW(groups[:1], socket=daemon.socket, **EXACT)
    try:
        bad_fp16 = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float16))
        for bad, error in [
                (dict(groups[1], params=groups[1]["params"] + [bad_fp16]), stallfree.Error),
                (dict(groups[1], lr=-1.0), ValueError),
                (dict(groups[1], params=[model.emb.weight]), ValueError)]:  # already in group 0
            with pytest.raises(error):
                opt.add_param_group(bad)
            assert len(opt.param_groups) == 1 and len(opt._engines) == 1
            assert set(opt.state) == set(groups[0]["params"])
        # Still whole: it trains group 0 as AdamW does.
        assert_trains_as_adamw(opt, model, ref, ref_model)
    finally:
        opt.close()


def test_parameters_switched_before_the_first_step_are_followed(daemon):
    """accelerate's FSDP2 prepare() puts new parameters in the optimizer's param groups after
    the optimizer was built (fsdp2_switch_optimizer_parameters): before the first step the
    optimizer takes them, trains them as AdamW trains the same values, and keeps no state of
    the old ones; after a step it refuses, naming the group, since its state is the old
    parameters'."""
    old_model, model, ref_model = models.make_model(0), models.make_model(0), models.make_model(0)
    ref = torch.optim.AdamW(models.param_groups(ref_model), betas=(0.9, 0.999), eps=1e-8)
    opt = ZenFlowAdamW(models.param_groups(old_model), socket=daemon.socket, **EXACT)
    try:
        for group, new in zip(opt.param_groups, models.param_groups(model)):
            group["params"] = new["params"]  # as accelerate does, in place
        before = models.snapshot(old_model)
        assert_trains_as_adamw(opt, model, ref, ref_model)
        assert models.changed(old_model, before) == []
        assert set(map(id, opt.state)) == {id(p) for p in model.parameters()}
        opt.state_dict()  # torch's packing finds every state key among the groups' params
        opt.param_groups[1]["params"] = list(models.param_groups(old_model)[1]["params"])
        with pytest.raises(stallfree.Error, match=r"param_groups\[1\]'s parameters were "
                                                   r"replaced after the optimizer had stepped"):
            opt.step()
    finally:
        opt.param_groups[1]["params"] = models.param_groups(model)[1]["params"]
        opt.close()


@pytest.mark.parametrize("mode", ["no-offload", "zenflow"])
def test_step_is_all_or_nothing(mode, daemon):
    """Group 1 has a bad gradient: the step is refused before group 0's engine steps."""
    config = EXACT if mode == "zenflow" else dict(mode=mode, **FP32)
    model = models.make_model(0)
    opt = factory(daemon, **config)(models.param_groups(model))
    try:
        models.plain_steps(model, opt, 1)
        before = models.snapshot(model)
        opt.zero_grad(set_to_none=True)
        models.loss_fn(model, models.batch(0, 2)).backward()
        model.norm.bias.grad = model.norm.bias.grad.to_sparse()
        with pytest.raises(stallfree.Error) as err:
            opt.step()
        assert "norm.bias" in str(err.value) or "param_groups[1]" in str(err.value)
        assert not models.changed(model, before)
        assert [e.step_count for e in opt._engines] == [1, 1]
        assert all(float(s["step"]) == 1 for s in opt.state.values())
    finally:
        opt.close()


HYPER_CASES = [
    dict(lr=-1e-3), dict(lr=float("nan")), dict(eps=-1e-8), dict(eps=float("nan")),
    dict(betas=(1.0, 0.999)), dict(betas=(0.9, 1.0)), dict(betas=(-0.1, 0.999)),
    dict(weight_decay=-0.1), dict(lr=torch.tensor([1e-3, 1e-3])),
    dict(lr=0.0), dict(eps=0.0), dict(betas=(0.0, 0.0)), dict(weight_decay=0.0),
    dict(lr=torch.tensor(1e-3)), dict(betas=(0.0, 0.999)),
]


@pytest.mark.parametrize("kwargs", HYPER_CASES, ids=[str(k) for k in HYPER_CASES])
def test_hyperparameters_accepted_and_refused_as_torch_adamw(kwargs, daemon):
    model = models.make_model(0)

    def outcome(make):
        try:
            opt = make()
        except ValueError as e:
            return e
        if hasattr(opt, "close"):
            opt.close()
        return None

    torch_error = outcome(lambda: torch.optim.AdamW(model.parameters(), foreach=False, **kwargs))
    ours = outcome(lambda: ZenFlowAdamW(model.parameters(), socket=daemon.socket, **kwargs))
    assert (torch_error is None) == (ours is None), (kwargs, torch_error, ours)
    if ours is not None:  # the same words as torch's, plus the argument's name
        assert str(torch_error).split(":")[0] in str(ours), (str(torch_error), str(ours))


def three_steps(make):
    """TinyLM(0)'s parameters after three plain steps of make(its parameters)."""
    model = models.make_model(0)
    opt = make(model.parameters())
    models.plain_steps(model, opt, 3)
    if hasattr(opt, "close"):
        opt.close()
    return models.snapshot(model)


def test_defaults_are_torch_adamws(daemon):
    """A drop-in keeps torch.optim.AdamW's defaults: every argument the two signatures share has
    the same default (weight_decay was 0.0 here against torch's 1e-2, found on the first GPU run
    of test_step_follows_the_current_cuda_stream), and ZenFlowAdamW(params, lr) with nothing
    else set takes torch.optim.AdamW(params, lr)'s exact step (sync-offload: fp32 transfers)."""
    ours = inspect.signature(ZenFlowAdamW.__init__).parameters
    theirs = inspect.signature(torch.optim.AdamW.__init__).parameters
    shared = [n for n in theirs if n not in ("self", "params") and n in ours]
    assert "weight_decay" in shared and "betas" in shared, shared
    for name in shared:
        assert ours[name].default == theirs[name].default, (name, ours[name].default,
                                                            theirs[name].default)

    ref = three_steps(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))
    got = three_steps(lambda ps: ZenFlowAdamW(ps, lr=1e-2, socket=daemon.socket,
                                              mode="sync-offload", **FP32))
    worst = max((got[n] - ref[n]).abs().max().item() for n in ref)
    assert worst <= models.PARAM_ATOL, worst


def test_engine_defaults_come_from_the_engine():
    """The engine options' defaults are stated once, in C++ (ZenFlowConfig), and exported
    (default_config): the signature shows the engine's values, which are the README's (a top-k
    of 0.1, rounds of at most 4, a 100-step warm-up, landing at the round's length, predicted
    cold columns, automatic transfers); the transfer dtypes are the front-end's own, bf16."""
    engine = stallfree._stallfree.default_config()
    ours = inspect.signature(ZenFlowAdamW.__init__).parameters
    for name in ("max_update_interval", "warmup_steps", "await_updates", "land_lag",
                 "predict_cold"):
        assert ours[name].default == engine[name], (name, ours[name].default, engine[name])
    assert (engine["topk_ratio"], engine["max_update_interval"], engine["warmup_steps"],
            engine["land_lag"], engine["predict_cold"], engine["update_interval"],
            engine["transfers"]) == (0.1, 4, 100, 0, True, 0, "auto")
    assert ours["update_interval"].default == "auto" and ours["topk_ratio"].default is None
    assert (ours["grad_dtype"].default, ours["param_dtype"].default) == ("bf16", "bf16")


@pytest.mark.parametrize("edge", [dict(eps=0.0), dict(lr=0.0), dict(betas=(0.0, 0.0))],
                         ids=["eps=0", "lr=0", "betas=0"])
def test_accepted_edge_values_compute_what_torch_computes(edge, daemon):
    """The edge values torch.optim.AdamW accepts give its result (eps = 0: a parameter with a
    zero moment becomes 0/0 = NaN in both; compared with NaN equal to NaN)."""
    kw = dict(dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1), **edge)
    ref = three_steps(lambda ps: torch.optim.AdamW(ps, foreach=False, **kw))
    for mode in ("no-offload", "sync-offload"):
        got = three_steps(lambda ps: ZenFlowAdamW(ps, socket=daemon.socket, mode=mode, **FP32,
                                                  **kw))
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=0, atol=models.PARAM_ATOL,
                                       equal_nan=True, msg=lambda m: f"{mode} {name}: {m}")
    if "eps" in edge:  # the embedding rows no token hit have m = v = 0
        assert torch.isnan(ref["emb.weight"]).any()


def test_tensor_lr_equals_float_lr(daemon):
    def groups_with(lr_type):
        def make(groups):
            for g in groups:
                g["lr"] = lr_type(g["lr"])
            return ZenFlowAdamW(groups, socket=daemon.socket, **EXACT)
        return make

    # float64, so that the scheduler's lr (written into the tensor by fill_) is the float's.
    as_float = models.train(groups_with(float), 6)
    as_tensor = models.train(groups_with(lambda lr: torch.tensor(lr, dtype=torch.float64)), 6)
    assert_same_run(as_tensor, as_float, "Tensor lr")


def test_state_dict_hooks_see_the_whole_state(daemon):
    model = models.make_model(0)
    opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket, **ZENFLOW)
    seen = {}
    try:
        models.plain_steps(model, opt, SAVE_AT)
        def post(o, sd):
            seen["post"] = sorted(sd["state"][0])

        opt.register_state_dict_post_hook(post)
        sd = opt.state_dict()
        assert seen["post"] == ["step", "zenflow_daemon", "zenflow_engine", "zenflow_meta"]

        def pre(o, sd):
            seen["pre"] = sorted(sd["state"][0])
            sd = dict(sd, param_groups=[dict(g, lr=g["lr"] * 2) for g in sd["param_groups"]])
            return sd  # a pre-hook may hand on a changed state dict

        model2 = models.make_model(0)
        model2.load_state_dict(model.state_dict())
        opt2 = ZenFlowAdamW(models.param_groups(model2), socket=daemon.socket, **ZENFLOW)
        opt2.register_load_state_dict_pre_hook(pre)
        def loaded(o):
            seen["loaded"] = [e.step_count for e in o._engines]

        opt2.register_load_state_dict_post_hook(loaded)
        opt2.load_state_dict(sd)
        assert seen["pre"] == ["step", "zenflow_daemon", "zenflow_engine", "zenflow_meta"]
        assert seen["loaded"] == [SAVE_AT, SAVE_AT]  # the post-hook sees the restored engines
        assert opt2.param_groups[0]["lr"] == 2 * sd["param_groups"][0]["lr"]
        # The live state holds empty placeholders of the engine entries only.
        assert {k: v.numel() for k, v in opt2.state[model2.emb.weight].items()} == {
            "step": 1, "zenflow_daemon": 0, "zenflow_engine": 0, "zenflow_meta": 0}
        opt2.close()
    finally:
        opt.close()


def test_hook_registered_by_a_hook_runs_as_in_torch(daemon):
    for make in (lambda ps: torch.optim.AdamW(ps),
                 lambda ps: ZenFlowAdamW(ps, socket=daemon.socket, **EXACT)):
        calls = []
        model = models.make_model(0)
        opt = make(model.parameters())

        def post(o, sd):
            calls.append("post")

        def pre(o):
            calls.append("pre")
            if "post" not in calls:
                o.register_state_dict_post_hook(post)

        opt.register_state_dict_pre_hook(pre)
        opt.state_dict()
        opt.state_dict()
        assert calls == ["pre", "post", "pre", "post"], (type(opt).__name__, calls)
        if hasattr(opt, "close"):
            opt.close()


def test_private_torch_apis_are_used_in_one_module():
    """Every private torch API the package uses is in stallfree/_torch_private.py, gated by the
    tested versions: no other module names one (torch._x, torch.a._b, or the private attributes
    it reads or sets on torch's objects)."""
    import pathlib
    import re
    private = re.compile(r"torch\.(?:[A-Za-z]\w*\.)*_[A-Za-z]\w*|\b_fsdp_flattened\b|"
                         r"\b_step_supports_amp_scaling\b|\b_optimizer_\w+_hooks\b|"
                         r"\b_get_default_store\b|\b_foreach_\w+")
    package = pathlib.Path(stallfree.__file__).parent
    found = {path.name: private.findall(path.read_text())
             for path in package.glob("*.py") if path.name != "_torch_private.py"}
    assert {k: v for k, v in found.items() if v} == {}
    assert private.findall((package / "_torch_private.py").read_text())  # the pattern matches


def test_outside_the_tested_torch_versions_the_fallbacks_serve(daemon, monkeypatch):
    """A torch newer than the tested range: every private use takes its public fallback and
    says so once (a RuntimeWarning naming the version); training is bit for bit the run on the
    private paths, and state_dict() still runs the hooks (torch runs them itself, on the state
    before the engines' entries are added)."""
    from stallfree import _torch_private as tp
    ref = models.train(factory(daemon, **EXACT), 6, seed=3)
    a = [torch.arange(4.0), torch.ones(3, dtype=torch.bfloat16)]
    b = [torch.full((4,), 2.0), torch.full((3,), 0.5)]
    on_private = [t.clone() for t in a]
    tp.foreach_copy_(on_private, b)
    tp.foreach_mul_(on_private, [torch.tensor(3.0), torch.tensor(0.25)])
    tp.foreach_add_(on_private, 1.5)
    monkeypatch.setattr(tp, "TORCH", (tp.TESTED[1][0], tp.TESTED[1][1] + 1))
    monkeypatch.setattr(tp, "_warned", set())
    assert not tp.checked()
    fallback = [t.clone() for t in a]
    tp.foreach_copy_(fallback, b)
    tp.foreach_mul_(fallback, [torch.tensor(3.0), torch.tensor(0.25)])
    tp.foreach_add_(fallback, 1.5)
    for x, y in zip(fallback, on_private):
        assert torch.equal(x, y) and x.dtype == y.dtype
    with pytest.warns(RuntimeWarning, match="outside the versions it was tested with"):
        assert tp.default_store() is None
    run = models.train(factory(daemon, **EXACT), 6, seed=3)
    assert_same_run(run, ref, "outside the tested torch versions")
    model = models.make_model(0)
    opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket, **EXACT)
    try:
        models.plain_steps(model, opt, 2)
        calls = []
        opt.register_state_dict_post_hook(
            lambda o, sd: calls.append(sd["state"][0]["zenflow_engine"].numel()))
        with pytest.warns(RuntimeWarning, match="state-dict hooks"):
            sd = opt.state_dict()
        # torch ran it once, before the engines' entries replaced their empty placeholders
        assert calls == [0]
        assert sd["state"][0]["zenflow_engine"].numel() > 0
        monkeypatch.setattr(tp, "TORCH", tp.TESTED[1])
        opt.state_dict()
        assert calls[1] == sd["state"][0]["zenflow_engine"].numel()  # in range: the whole
    finally:
        opt.close()


def test_load_into_a_stepped_optimizer_keeps_the_loaded_model(daemon):
    """Loading into an optimizer that has already stepped (accelerate's wrap, a user who
    reloads) replaces its engines without writing their cold columns over the model just
    loaded: the run continues exactly as one resumed into a fresh optimizer."""
    ref = models.train(factory(daemon, **ZENFLOW), STEPS, seed=4)
    saved = {}
    models.train(factory(daemon, **ZENFLOW), STEPS, seed=4, after_step=save_at(SAVE_AT, saved))
    sd = torch.load(io.BytesIO(saved["opt_bytes"]), weights_only=True)

    def load_after_two_steps(model, opt):
        models.plain_steps(model, opt, 2, seed=9)  # another run's steps, then the real state
        model.load_state_dict(saved["model"])
        opt.load_state_dict(sd)
        for name, p in model.named_parameters():
            assert torch.equal(p, saved["model"][name]), name

    run = models.train(factory(daemon, **ZENFLOW), STEPS, seed=4, start=SAVE_AT + 1,
                       setup=resume_from(saved, load_after_two_steps))
    assert_same_run(run, ref, "resumed", start=SAVE_AT)


@pytest.mark.parametrize("mode", ["no-offload", "zenflow"])
def test_a_failed_load_leaves_the_optimizer_as_it_was(mode, daemon):
    config = dict(ZENFLOW, mode=mode) if mode == "zenflow" else dict(mode=mode, **FP32)
    twins = []
    for _ in range(2):
        model = models.make_model(0)
        opt = factory(daemon, **config)(models.param_groups(model))
        models.plain_steps(model, opt, 3)
        twins.append((model, opt))
    (model, opt), (twin_model, twin) = twins
    try:
        sd = opt.state_dict()
        sd["param_groups"][0]["lr"] = 0.5
        sd["state"][0]["zenflow_engine"] = sd["state"][0]["zenflow_engine"][:-8]  # cut short
        before = models.snapshot(model)
        with pytest.raises(stallfree.Error, match="truncated"):
            opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == models.DECAY_LR
        assert [e.step_count for e in opt._engines] == [3, 3]
        assert all(float(s["step"]) == 3 for s in opt.state.values())
        assert not models.changed(model, before)
        # And it goes on exactly as its twin, which never saw the bad state dict.
        for m, o in twins:
            models.plain_steps(m, o, 5, seed=5)
        for (name, a), b in zip(model.named_parameters(), twin_model.parameters()):
            assert torch.equal(a, b), name
    finally:
        opt.close()
        twin.close()


def test_flattened_distributed_checkpoint_round_trip(daemon):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    ref = models.train(factory(daemon, **ZENFLOW), STEPS, seed=6)
    saved = {}

    def save(step, model, opt, extra):
        if step == SAVE_AT:
            saved["osd"] = get_optimizer_state_dict(model, opt, options=flat)
            assert saved["osd"]["state.emb.weight.zenflow_daemon"].numel() > 0
            saved["model"] = {k: v.clone() for k, v in model.state_dict().items()}
            saved["sched"] = extra["sched"].state_dict()

    models.train(factory(daemon, **ZENFLOW), STEPS, seed=6, after_step=save)
    run = models.train(factory(daemon, **ZENFLOW), STEPS, seed=6, start=SAVE_AT + 1,
                       setup=resume_from(saved, lambda m, o: set_optimizer_state_dict(
                           m, o, saved["osd"], options=flat)))
    assert_same_run(run, ref, "resumed", start=SAVE_AT)


SUBCLASS_CHILD = r"""
import os, sys, tempfile
import torch, torch.distributed as dist
import stallfree
from stallfree.torch import ZenFlowAdamW
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

class Traced(torch.Tensor):
    pass

init = "file://" + os.path.join(tempfile.mkdtemp(), "pg")
dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
mesh = DeviceMesh("cpu", [0])
def dt(placement):
    return torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [placement]))
for name, p in [
        ("colwise.weight", dt(Shard(1))), ("replicated.weight", dt(Replicate())),
        ("sharded.weight", dt(Shard(0))),
        ("traced.weight", torch.Tensor._make_subclass(Traced, torch.randn(8, 4), True))]:
    plain = torch.nn.Parameter(torch.randn(4))
    try:
        ZenFlowAdamW([("plain.bias", plain), (name, p)], mode="no-offload")
        print("ACCEPTED", name)
    except stallfree.Error as e:
        print("ERROR", type(p).__name__, str(e))
ZenFlowAdamW([("sharded.weight", dt(Shard(0)))], mode="no-offload").close()
print("ACCEPTED alone")
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # past torch's gloo teardown, which aborts now and then (tests/python/rank_exit.py)
"""


def test_tensor_parallel_dtensors_and_subclasses_are_refused_naming_the_parameter():
    """Tensor-parallel DTensors (Shard(1), Replicate()) are refused naming the layout and what
    works; FSDP2's Shard(0) is taken, but not in one param group with plain tensors; another
    tensor subclass is refused naming it."""
    out = [line for line in run_python(SUBCLASS_CHILD).stdout.splitlines()
           if line.startswith(("ERROR", "ACCEPTED"))]
    assert len(out) == 5, out
    for line, placement in zip(out[:2], ("Shard(dim=1)", "Replicate()")):
        assert line.startswith("ERROR DTensor parameter '"), line
        assert "placements (%s,) on a 1-D mesh" % placement in line, line
        assert "tensor parallelism" in line and "Shard(0) on a 1-D mesh" in line, line
    assert out[2].startswith("ERROR DTensor param_groups[0] mixes FSDP2 DTensors and plain "
                             "tensors"), out[2]
    assert out[3].startswith("ERROR Traced parameter 'traced.weight'"), out[3]
    assert "tensor subclass" in out[3], out[3]
    assert out[4] == "ACCEPTED alone", out[4]


@pytest.mark.skipif(not (torch.cuda.is_available() and stallfree.cuda_enabled),
                    reason="needs a CUDA device and the package built with --config=cuda")
@pytest.mark.parametrize("mode", ["no-offload", "zenflow"])
def test_step_follows_the_current_cuda_stream(mode, daemon):
    """The forward, backward and step on a side stream (torch.cuda.stream), the optimizer
    built on the default one: the result equals torch's AdamW on the same stream."""
    config = EXACT if mode == "zenflow" else dict(mode=mode, **FP32)

    def run(make):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64).cuda()
        opt = make(model.parameters())
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            for step in range(4):
                x = torch.randn(256, 64, device="cuda")
                opt.zero_grad(set_to_none=True)
                (model(x) ** 2).mean().backward()
                opt.step()
                with torch.no_grad():
                    model.weight.mul_(1.0)  # queued on the side stream right after the step
        torch.cuda.synchronize()
        if hasattr(opt, "close"):
            opt.close()
        return model.weight.detach().cpu()

    ref = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False))
    got = run(lambda ps: ZenFlowAdamW(ps, lr=1e-2, socket=daemon.socket, **config))
    assert (got - ref).abs().max().item() <= models.PARAM_ATOL


def test_process_group_without_torch_distributed_is_a_value_error():
    assert not torch.distributed.is_initialized()
    model = models.make_model(0)
    with pytest.raises(ValueError, match="process_group: given, but torch.distributed is not "
                                         "initialized"):
        ZenFlowAdamW(model.parameters(), mode="no-offload", process_group=object())


def test_placeholders_alone_are_refused(daemon):
    model = models.make_model(0)
    with ZenFlowAdamW(model.parameters(), socket=daemon.socket, **EXACT) as opt:
        sd = opt.state_dict()
        sd["state"] = {0: dict(opt.state[model.emb.weight])}  # the live state's placeholders
        with pytest.raises(stallfree.Error, match="empty placeholders"):
            opt.load_state_dict(sd)


def test_a_compiled_model_trains_as_the_eager_one(daemon):
    """torch.compile(model) (inductor, CPU) with ZenFlowAdamW (rounds of 2 with an
    asynchronous Update and reselections; and stream_gradients, whose post-accumulate-grad hooks
    run under the compiled backward) against the same optimizer on the eager model, 6 steps.
    Inductor fuses and reorders the forward's and backward's arithmetic, so they differ at the
    level of kernel rounding, which models.LOSS_RTOL / PARAM_ATOL bound (5x the effect of an
    ulp-level perturbation, derived in models.py); measured below. The control: the eager run
    with lr 0.1% off misses them. step() itself runs eagerly (it calls the engine; a compiled
    training step would break its graph there): its cost is the eager step's."""
    config = dict(mode="zenflow", topk_ratio=0.25, update_interval=2, select_interval=2,
                  warmup_steps=0, **FP32)

    def run(compiled, lr_scale=1.0, **extra):
        torch._dynamo.reset()
        model = models.make_model(0)
        net = torch.compile(model) if compiled else model
        opt = ZenFlowAdamW(models.param_groups(model, decay_lr=models.DECAY_LR * lr_scale),
                           socket=daemon.socket, **config, **extra)
        losses = []
        try:
            for step in range(1, 7):
                opt.zero_grad(set_to_none=True)
                loss = models.loss_fn(net, models.batch(0, step))
                loss.backward()
                opt.step()
                losses.append(loss.item())
        finally:
            opt.close()
        return losses, models.snapshot(model)

    eager = run(False)
    for extra in ({}, {"stream_gradients": True}):
        compiled = run(True, **extra)
        loss = max(models.rel_diff(a, b) for a, b in zip(compiled[0], eager[0]))
        param = max(models.max_abs_diff(compiled[1], eager[1]).values())
        print("compiled vs eager %s: losses %.3g relative, parameters %.3g" % (extra, loss,
                                                                              param))
        assert loss <= models.LOSS_RTOL and param <= models.PARAM_ATOL, extra
    off = run(False, lr_scale=1.001)
    assert max(models.max_abs_diff(off[1], eager[1]).values()) > models.PARAM_ATOL
