"""Every use of a private torch API in stallfree, in one place, each gated by the torch versions
it was checked against: TESTED, from the oldest torch `make test-torch-min` runs
(python/requirements-min.txt) to the pinned one (python/requirements.txt). Outside that range
each use takes its public fallback, or does without and says what is lost, once (a warning):
nothing here can fail because a newer torch renamed its internals.

tests/python/test_torch2.py checks that no other module of the package names a private torch
API, and that the fallbacks do what the private paths do.
"""
import collections
import contextlib
import warnings

import torch
import torch.distributed


def _minor(version):
    """(major, minor) of a torch version string ("2.15.0+cu130" -> (2, 15))."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


TESTED = ((2, 9), (2, 15))  # the oldest and the newest torch the test suite ran
TORCH = _minor(torch.__version__)
_warned = set()


def checked():
    """Whether this torch is one the private uses below were checked against."""
    return TESTED[0] <= TORCH <= TESTED[1]


def _without(what, lost):
    if what not in _warned:
        _warned.add(what)
        warnings.warn("stallfree: torch %s is outside the versions it was tested with "
                      "(%d.%d to %d.%d): %s is not used; %s"
                      % (torch.__version__, TESTED[0][0], TESTED[0][1], TESTED[1][0],
                         TESTED[1][1], what, lost), RuntimeWarning, stacklevel=3)


def _foreach(name, tensors, other, one):
    """torch._foreach_<name>(tensors, other) when checked (one kernel launch for the list), else
    one(tensors[i], other[i]) for each i (other: a list, or one value for all)."""
    fn = getattr(torch, "_foreach_" + name, None) if checked() else None
    if fn is not None:
        return fn(tensors, other)
    others = other if isinstance(other, (list, tuple)) else [other] * len(tensors)
    for t, o in zip(tensors, others):
        one(t, o)


def foreach_copy_(dst, src):
    """dst[i].copy_(src[i]) for every i (a dtype widened or narrowed on the way)."""
    _foreach("copy_", dst, src, torch.Tensor.copy_)


def foreach_mul_(tensors, factors):
    """tensors[i].mul_(factors[i]) for every i (factors: 0-D tensors)."""
    _foreach("mul_", tensors, factors, torch.Tensor.mul_)


def foreach_add_(tensors, value):
    """tensors[i].add_(value) for every i."""
    _foreach("add_", tensors, value, torch.Tensor.add_)


def default_store():
    """torch.distributed's default store (where ranks leave their host and pid, so that a
    failed collective can name the dead ranks), or None."""
    if not checked():
        _without("torch.distributed's default store",
                 "a failed collective cannot name the ranks that died")
        return None
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:
        return None


def is_fsdp1_parameter(p):
    """Whether p is a flat parameter of FSDP1 (FullyShardedDataParallel), or, with
    use_orig_params=True, a view of one that FSDP1 hands out: it marks both with an attribute."""
    if type(p).__name__ == "FlatParameter":
        return True
    return bool(getattr(p, "_fsdp_flattened", False))  # harmless to read in any version


def announce_unscaling(opt):
    """Has torch's GradScaler hand itself to opt.step() (grad_scaler=, or grad_scale and
    found_inf as attributes) instead of unscaling the gradients itself: opt.step() can then
    refuse a scaler it cannot serve, before anything changes. Outside the checked versions the
    scaler may unscale on its own: the streamed gradients would then go unscaled."""
    if not checked():
        _without("GradScaler's hand-over to the optimizer (_step_supports_amp_scaling)",
                 "a GradScaler with stream_gradients is not refused: do not combine them")
        return
    opt._step_supports_amp_scaling = True


_OPTIMIZER_HOOKS = ("state_dict_pre", "state_dict_post", "load_state_dict_pre",
                    "load_state_dict_post")


@contextlib.contextmanager
def hooks_held(opt, kind):
    """Takes torch's optimizer hooks of `kind` (one of _OPTIMIZER_HOOKS) off opt for the
    duration, yielding them, so that the caller runs them itself where the state they see is
    whole (torch's own state_dict() runs none then). Outside the checked versions, or where
    torch has no such dictionary, it yields none and torch runs its hooks where it does: they
    see this rank's state before the engines' entries are added."""
    assert kind in _OPTIMIZER_HOOKS, kind
    attr = "_optimizer_%s_hooks" % kind  # the Optimizer's dictionaries of them (torch >= 2.1)
    if not checked():
        _without("holding the optimizer's state-dict hooks",
                 "torch runs them inside its state_dict(), before the engines' state is added")
    hooks = getattr(opt, attr, None) if checked() else None
    if not isinstance(hooks, dict):
        yield collections.OrderedDict()
        return
    setattr(opt, attr, collections.OrderedDict())
    try:
        yield hooks
    finally:
        hooks.update(getattr(opt, attr))  # registered meanwhile (by a hook): kept, and run
        setattr(opt, attr, hooks)
