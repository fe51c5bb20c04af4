"""The documented errors and skips of ZenFlowAdamW: non-fp32 and sparse parameters, invalid
hyper-parameters, requires_grad=False, .grad None in a step (against torch.optim.AdamW), and a
step after close()."""
import re

import pytest
import torch

import models
import stallfree
from stallfree.torch import ZenFlowAdamW

FP32 = models.FP32
ZENFLOW_EXACT = dict(mode="zenflow", topk_ratio=0.25, update_interval=1, select_interval=2,
                     await_updates=True, warmup_steps=0, **FP32)
MODES = {"no-offload": dict(mode="no-offload", **FP32), "zenflow": ZENFLOW_EXACT}


def make_opt(params, daemon, **kw):
    socket = None if kw.get("mode") == "no-offload" else daemon.socket
    return ZenFlowAdamW(params, socket=socket, **kw)


def one_step(model, opt, step=1):
    opt.zero_grad(set_to_none=True)
    models.loss_fn(model, models.batch(0, step)).backward()
    opt.step()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_fp16_parameter_is_named(mode, named, daemon):
    """fp32 and bf16 parameters are taken (test_bf16.py); another dtype is refused naming it
    and the parameter."""
    model = models.make_model(0)
    model.up.to(torch.float16)  # up.weight (the 4th parameter) and up.bias
    params = list(model.named_parameters()) if named else list(model.parameters())
    with pytest.raises(stallfree.Error) as err:
        opt = make_opt(params, daemon, **MODES[mode])  # at construction ...
        try:
            one_step(model, opt)  # ... or at the latest at the first step
        finally:
            opt.close()
    msg = str(err.value)
    assert "float16" in msg and "fp32 and bf16" in msg, msg
    if named:
        assert "up.weight" in msg, msg
    else:  # "param_groups[0][3]" or "param_groups[0] #3"
        assert re.search(r"param_groups\[0\](\[3\]| #3)", msg), msg


@pytest.mark.parametrize("mode", list(MODES))
def test_sparse_gradient_is_named_at_step(mode, daemon):
    model = models.make_model(0, sparse_embedding=True)
    opt = make_opt(list(model.named_parameters()), daemon, **MODES[mode])  # accepted here
    try:
        before = models.snapshot(model)
        opt.zero_grad(set_to_none=True)
        models.loss_fn(model, models.batch(0, 1)).backward()
        assert model.emb.weight.grad.is_sparse
        with pytest.raises(stallfree.Error) as err:
            opt.step()
        assert "emb.weight" in str(err.value), str(err.value)
        assert "sparse" in str(err.value), str(err.value)
        # The refused step changed nothing.
        assert not models.changed(model, before)
    finally:
        opt.close()


BAD_HYPER = [
    (dict(lr=-1e-3), "lr"),
    (dict(betas=(1.0, 0.999)), "betas"),
    (dict(betas=(0.9, -0.1)), "betas"),
    (dict(eps=-1e-8), "eps"),
    (dict(eps=float("inf")), "eps"),
    (dict(lr=float("nan")), "lr"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(mode="zero3"), "mode"),
    (dict(grad_dtype="fp16"), "grad_dtype"),
    (dict(param_dtype="fp64"), "param_dtype"),
    (dict(topk_ratio=0.0), "topk_ratio"),
    (dict(topk_ratio=1.5), "topk_ratio"),
    (dict(update_interval=-1), "update_interval"),
    (dict(update_interval="fast"), "update_interval"),
    (dict(select_interval=8), "select_interval"),  # with update_interval "auto"
    (dict(max_update_interval=0), "max_update_interval"),
    (dict(update_interval=2.5), "update_interval"),
    (dict(select_interval=6, update_interval=4), "select_interval"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(transfers="fast"), "transfers"),
]


@pytest.mark.parametrize("kwargs,arg", BAD_HYPER, ids=[f"{a}={list(k.values())[0]}"
                                                       for k, a in BAD_HYPER])
def test_invalid_hyperparameter_is_value_error_naming_it(kwargs, arg, daemon):
    model = models.make_model(0)
    with pytest.raises(ValueError) as err:
        ZenFlowAdamW(model.parameters(), socket=daemon.socket, **kwargs).close()
    assert re.search(r"\b%s\b" % arg, str(err.value)), str(err.value)
    # The same in a param group (lr, betas, eps, weight_decay are per group).
    if arg in ("lr", "betas", "eps", "weight_decay"):
        groups = models.param_groups(model)
        groups[1].update(kwargs)
        with pytest.raises(ValueError) as err:
            ZenFlowAdamW(groups, socket=daemon.socket).close()
        assert re.search(r"\b%s\b" % arg, str(err.value)), str(err.value)


# The edges of the valid ranges: lr and weight_decay 0, betas 0 (bias corrections 1 - 0^t = 1),
# every column hot (topk_ratio 1), an update every step.
BOUNDARY = dict(betas=(0.0, 0.0), weight_decay=0.0, topk_ratio=1.0, update_interval=1)


@pytest.mark.parametrize("mode", ["default", *MODES])
def test_boundary_hyperparameters_with_zero_lr_change_nothing(mode, daemon):
    """The boundary values are accepted, and with lr = 0 (and weight_decay = 0) three steps leave
    every parameter exactly as it was, as torch.optim.AdamW would; the steps did run (each
    parameter has its optimizer state). "default": ZenFlowAdamW's own defaults otherwise (zenflow
    with its warm-up)."""
    model = models.make_model(0)
    before = models.snapshot(model)
    kw = {**({} if mode == "default" else MODES[mode]), **BOUNDARY, "lr": 0.0}
    with make_opt(model.parameters(), daemon, **kw) as opt:
        for step in range(1, 4):
            one_step(model, opt, step)
        assert len(opt.state_dict()["state"]) == len(before), opt.state_dict()["state"].keys()
    assert not models.changed(model, before)


@pytest.mark.parametrize("mode", list(MODES))
def test_boundary_betas_train_like_torch_adamw(mode, daemon):
    """The same boundary values with a learning rate train like torch.optim.AdamW with
    betas (0, 0): the update is lr * g / (|g| + eps), with no division by a zero bias
    correction."""
    def factory(groups):  # the groups' own lr and weight_decay (models.param_groups) apply
        return make_opt(groups, daemon, **{**MODES[mode], **BOUNDARY})

    def reference(groups):
        return torch.optim.AdamW(groups, betas=(0.0, 0.0), eps=1e-8)

    init = models.snapshot(models.make_model(0))
    run = models.train(factory, 6)
    ref = models.train(reference, 6)
    for step, (a, b) in enumerate(zip(run.losses, ref.losses), 1):
        assert models.rel_diff(a, b) <= models.LOSS_RTOL, (step, a, b)
    for name, d in models.max_abs_diff(run.params, ref.params).items():
        assert d <= models.PARAM_ATOL, (name, d)
        assert not torch.equal(run.params[name], init[name]), name


def exact_factory(daemon, mode):
    return lambda groups: make_opt(groups, daemon, **MODES[mode])


@pytest.mark.parametrize("mode", list(MODES))
def test_requires_grad_false_is_skipped(mode, daemon):
    def frozen_model():
        model = models.make_model(0)
        model.up.weight.requires_grad_(False)  # a 2-D weight (offloaded if it were trained)
        model.norm.bias.requires_grad_(False)  # a 1-D one
        return model

    init = models.snapshot(models.make_model(0))
    run = models.train(exact_factory(daemon, mode), 8, model=frozen_model())
    ref = models.train(models.adamw_factory(), 8, model=frozen_model())
    for name in ("up.weight", "norm.bias"):
        assert torch.equal(run.params[name], init[name]), name
    for name, d in models.max_abs_diff(run.params, ref.params).items():
        assert d <= models.PARAM_ATOL, (name, d)
        if name not in ("up.weight", "norm.bias"):
            assert not torch.equal(run.params[name], init[name]), name  # the rest trains


SKIP_STEPS = (3, 4, 7)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("skipped", ["up.weight", "norm.weight"])
def test_grad_none_is_skipped_like_torch_adamw(mode, skipped, daemon):
    """At steps 3, 4 and 7 the parameter's .grad is None: it must not change in those steps
    (no update, no weight decay), and since torch's AdamW also does not count them in the
    parameter's step (bias correction), the whole run must match torch's AdamW run with the
    same skips. up.weight: a 2-D weight (hot columns on the device, the rest in the daemon in
    zenflow); norm.weight: a 1-D parameter."""

    def drop(step, model, opt):
        if step in SKIP_STEPS:
            dict(model.named_parameters())[skipped].grad = None

    def watch(step, model, opt, extra):
        extra.setdefault("values", {})[step] = dict(model.named_parameters())[skipped].clone()

    run = models.train(exact_factory(daemon, mode), 8, before_step=drop, after_step=watch)
    ref = models.train(models.adamw_factory(), 8, before_step=drop, after_step=watch)
    values = run.extra["values"]
    for step in SKIP_STEPS:
        assert torch.equal(values[step], values[step - 1]), f"{skipped} changed at step {step}"
    assert not torch.equal(values[5], values[4])  # and it trains in the other steps
    for step, (a, b) in enumerate(zip(run.losses, ref.losses), 1):
        assert models.rel_diff(a, b) <= models.LOSS_RTOL, (step, a, b)
    for name, d in models.max_abs_diff(run.params, ref.params).items():
        assert d <= models.PARAM_ATOL, (name, d)


@pytest.mark.parametrize("mode", list(MODES))
def test_step_after_close_is_an_error(mode, daemon):
    model = models.make_model(0)
    opt = make_opt(model.parameters(), daemon, **MODES[mode])
    one_step(model, opt)
    opt.close()
    before = models.snapshot(model)
    opt.zero_grad(set_to_none=True)
    models.loss_fn(model, models.batch(0, 2)).backward()
    with pytest.raises(stallfree.Error):
        opt.step()
    assert not models.changed(model, before)


def test_daemon_gone_names_the_socket_and_how_to_resume():
    """A daemon killed mid-training: the next step raises stallfree.Error naming the socket, what
    was lost and the state_dict way back, not the bare 'UNAVAILABLE: Socket closed'."""
    import os
    import signal
    with stallfree.Daemon(threads=1) as d:
        model = models.make_model(0)
        opt = ZenFlowAdamW(model.parameters(), socket=d.socket, reattach_timeout=0,
                           **ZENFLOW_EXACT)
        one_step(model, opt, 1)
        os.kill(d.pid, signal.SIGKILL)
        with pytest.raises(stallfree.Error) as err:
            for step in range(2, 5):
                one_step(model, opt, step)
        msg = str(err.value)
        assert msg.startswith("stallfreed at %s went away (" % d.socket), msg
        assert err.value.__cause__.code == "UNAVAILABLE"  # decided by the code, not the text
        assert "state_dict()" in msg and "Restart stallfreed" in msg, msg


def test_close_raises_when_the_final_flush_fails():
    """close() with an Update still pending when the daemon went away: the final flush cannot
    bring the cold columns back, and close() says so (stallfree.Error naming the socket) once
    the engines and sessions are closed; a second close() has nothing left to do."""
    import os
    import signal
    with stallfree.Daemon(threads=1) as d:
        model = models.make_model(0)
        opt = ZenFlowAdamW(model.parameters(), socket=d.socket, mode="zenflow", topk_ratio=0.25,
                           update_interval=2, warmup_steps=0, await_updates=False,
                           reattach_timeout=0, **FP32)
        for step in (1, 2):  # step 2 is a boundary: its round's Update is pending
            one_step(model, opt, step)
        os.kill(d.pid, signal.SIGKILL)
        with pytest.raises(stallfree.Error) as err:
            opt.close()
        assert str(err.value).startswith("stallfreed at %s went away (" % d.socket), err.value
        assert err.value.__cause__.code == "UNAVAILABLE"
        opt.close()
        with pytest.raises(stallfree.Error):
            one_step(model, opt, 3)


def test_hyperparameter_changed_between_steps_is_checked_before_any_group_steps(daemon):
    """A scheduler that sets eps = inf in the second group between steps: the next step raises
    ValueError naming eps before any group's parameters change (the engine checks what changed,
    not what it already took)."""
    model = models.make_model(0)
    groups = models.param_groups(model)
    opt = ZenFlowAdamW(groups, socket=daemon.socket, **ZENFLOW_EXACT)
    one_step(model, opt, 1)
    opt.param_groups[1]["eps"] = float("inf")
    before = models.snapshot(model)
    with pytest.raises(ValueError) as err:
        one_step(model, opt, 2)
    assert re.search(r"param_groups\[1\]\.eps\b", str(err.value)), str(err.value)
    assert not models.changed(model, before)
    opt.close()


# Rounds of 4, not awaited: after 6 steps round 1's update is pending and the close() flushes it
# into the cold columns: what goes wrong when the engine writes through stale addresses.
ZENFLOW_STALE = dict(mode="zenflow", topk_ratio=0.25, update_interval=4, warmup_steps=0, **FP32)


def _trained(daemon, steps=6, before_close=None):
    model = models.make_model(0)
    opt = make_opt(models.param_groups(model), daemon, **ZENFLOW_STALE)
    for step in range(1, steps + 1):
        one_step(model, opt, step)
    old = [p.data for p in model.parameters()]  # kept alive: stale writes land here
    if before_close is not None:
        before_close(model)
    opt.close()
    return model, old


def test_replaced_storage_gets_the_final_flush(daemon):
    """p.data replaced by a copy of the same layout between the last step and close() (what
    model.to() or a checkpoint loader may do): the final flush writes the cold columns into the
    parameters as they are now, so the model equals the run without the replacement bit for
    bit, and the old storage is left as it was (before, the engine wrote through the addresses
    of the last step(): the replaced storage got the update, the model missed it)."""
    want, _ = _trained(daemon)
    snapshots = {}

    def replace(model):
        for name, p in model.named_parameters():
            snapshots[name] = p.data.clone()
            p.data = p.data.clone()

    got, old = _trained(daemon, before_close=replace)
    for (name, p), q in zip(want.named_parameters(), got.parameters()):
        assert torch.equal(p, q), name
    for (name, _), o in zip(got.named_parameters(), old):
        assert torch.equal(o, snapshots[name]), name


def test_a_moved_model_is_refused_not_written(daemon):
    """model.to(torch.bfloat16) after the optimizer was built (the fp32 storage freed): step(),
    flush() and state_dict() raise stallfree.Error naming the parameter and what to do; close()
    closes without writing into the old memory and says the newest cold values were not written
    back."""
    model = models.make_model(0)
    opt = make_opt(models.param_groups(model, named=True), daemon, **ZENFLOW_STALE)
    for step in range(1, 4):
        one_step(model, opt, step)
    model.to(torch.bfloat16)
    for call in (lambda: one_step(model, opt, 4), opt.flush, opt.state_dict):
        with pytest.raises(stallfree.Error, match=r"parameter 'emb.weight' is now "
                                                  r"torch.bfloat16 .* built for torch.float32"):
            call()
    with pytest.raises(stallfree.Error, match="not written back: parameter 'emb.weight'"):
        opt.close()
    with pytest.raises(stallfree.Error, match="closed"):
        opt.step()


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_parameters_are_refused(daemon, use_orig_params):
    """FSDP1 (FullyShardedDataParallel) hands out flat parameters, or with use_orig_params views
    of them, each rank a different shard: ZenFlowAdamW refuses them at construction naming FSDP1
    and what to use, instead of partitioning over the ranks as over replicas (here one gloo rank
    on the CPU, which FSDP1 runs as NO_SHARD: the same parameters it shards over more)."""
    import os
    import warnings
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from conftest import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FSDP1's NO_SHARD notice at world size 1
            model = FSDP(models.make_model(0), use_orig_params=use_orig_params,
                         device_id=torch.device("cpu"))
        with pytest.raises(stallfree.Error, match=r"FSDP1 \(FullyShardedDataParallel\).*"
                                                  r"DistributedDataParallel"):
            ZenFlowAdamW(model.parameters(), socket=daemon.socket)
    finally:
        dist.destroy_process_group()


def test_the_sanitizer_report_check_finds_each_form():
    """conftest's check of a daemon's log under the sanitizers (make test's ASan run of the
    survival tests): each sanitizer's report is found from its line on; a log without one
    passes."""
    from conftest import sanitizer_report
    for report in ("==42==ERROR: AddressSanitizer: heap-buffer-overflow on address 0x60200",
                   "==42==ERROR: LeakSanitizer: detected memory leaks",
                   "WARNING: ThreadSanitizer: data race (pid=42)",
                   "server/requests.cc:36:10: runtime error: signed integer overflow"):
        found = sanitizer_report("a line of the log\n" + report + "\n    #0 0x1 in Frame\n")
        assert found.startswith(report + "\n    #0 0x1 in Frame"), found
    assert sanitizer_report("I1205 session 3: an update ran out of time\n") == ""
