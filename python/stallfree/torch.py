"""stallfree.torch.ZenFlowAdamW: a drop-in torch.optim optimizer over the ZenFlow engine.

    from stallfree.torch import ZenFlowAdamW
    opt = ZenFlowAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)   # instead of AdamW

Each parameter group is one ZenFlow engine (client/zenflow.h) with its own session on the
node's stallfreed; the engine does all the work on the tensors' own memory (data_ptr), nothing
of it is re-implemented here. See the README, "Using stallfree from PyTorch".
"""

import atexit
import os
import sys
import weakref

import torch
import torch.distributed

from . import _stallfree
from ._daemon import Daemon, default_socket
from ._stallfree import Error

_MODES = ("zenflow", "sync-offload", "no-offload")
_DTYPES = ("bf16", "fp32")
_STATE_VERSION = 1


def _connect(socket, explicit):
    """A client for `socket`; when it does not answer and it was not given explicitly, a client
    for a private daemon (returned too, to be stopped with the optimizer)."""
    why = "the socket does not exist"
    if os.path.exists(socket):
        try:
            return _stallfree.Client(socket, 3000), None
        except Error as e:
            why = str(e)
    if explicit:
        raise Error(
            "no stallfreed answers at %s (%s): start one with `stallfreed --socket %s`, or pass "
            "socket=None to use $STALLFREE_SOCKET or the node's default socket, and otherwise a "
            "private daemon" % (socket, why, socket))
    daemon = Daemon()
    print("stallfree: no stallfreed answers at %s; started a private one (pid %d) on %s; it "
          "stops with this optimizer" % (socket, daemon.pid, daemon.socket), file=sys.stderr)
    return _stallfree.Client(daemon.socket, 3000), daemon


def _rank():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _all_reduce_scores(name, view):
    """Data-parallel replicas sum each weight's column scores before top-k, so that all of them
    select the same hot columns (the ScoreReduce hook of the engine)."""
    scores = torch.frombuffer(view, dtype=torch.float32)
    if torch.distributed.get_backend() == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
        on_dev = scores.to(dev)
        torch.distributed.all_reduce(on_dev)
        scores.copy_(on_dev.cpu())
    else:
        torch.distributed.all_reduce(scores)


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with ZenFlow offloading.

    mode: "zenflow" (the top `topk_ratio` input columns of each weight by gradient norm are
    updated on the parameter's device at once; the rest go to stallfreed, which applies their
    mean gradient every `update_interval` steps, one round stale unless `await_updates`),
    "sync-offload" (every parameter's optimizer state in the daemon, ZeRO-Offload style) or
    "no-offload" (AdamW in place, no daemon). grad_dtype / param_dtype: what crosses to and
    from the daemon ("bf16" or "fp32"). select_interval: steps between reselections (None:
    4 * update_interval). warmup_steps: first steps with update_interval 1 and awaited updates
    (exact AdamW while the moments are young; 20 by measurement, README "Known behaviour").

    socket: the daemon's socket; None means $STALLFREE_SOCKET, else the node's default socket,
    and if no daemon answers there a private one is started (and stopped with the optimizer).
    session_name: the daemon sessions' name (stallfreectl sessions); default "torch".

    Parameters must be dense fp32 tensors (CPU; CUDA in builds with the CUDA backend), all of a
    group on one device. requires_grad=False parameters are left out. A parameter whose .grad
    is None in a step is skipped, as torch.optim.AdamW skips it: no step, no decay (in zenflow
    its cold columns' round gradient, the sum of the round's gradients over update_interval,
    gets nothing from that step, and a round without any gradient leaves them unchanged).
    `params` may also be (name, tensor) pairs (model.named_parameters()), for messages.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 mode="zenflow", topk_ratio=0.1, update_interval=4, select_interval=None,
                 warmup_steps=20, await_updates=False, grad_dtype="bf16", param_dtype="bf16",
                 socket=None, session_name=None):
        _check_hyper(lr, betas, eps, weight_decay, "")
        if mode not in _MODES:
            raise ValueError("mode: %r is not one of %s" % (mode, ", ".join(_MODES)))
        if not 0.0 < topk_ratio <= 1.0:
            raise ValueError("topk_ratio: %r is not in (0, 1]" % (topk_ratio,))
        if int(update_interval) != update_interval or update_interval < 1:
            raise ValueError("update_interval: %r is not an integer >= 1" % (update_interval,))
        if select_interval is not None and (
                int(select_interval) != select_interval or select_interval < 1 or
                select_interval % update_interval != 0):
            raise ValueError("select_interval: %r is not a positive multiple of update_interval "
                             "(%d)" % (select_interval, update_interval))
        if int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError("warmup_steps: %r is not an integer >= 0" % (warmup_steps,))
        for field, value in (("grad_dtype", grad_dtype), ("param_dtype", param_dtype)):
            if value not in _DTYPES:
                raise ValueError("%s: %r is not 'bf16' or 'fp32'" % (field, value))
        self._config = dict(mode=mode, topk_ratio=float(topk_ratio),
                            update_interval=int(update_interval),
                            select_interval=int(select_interval or 0),
                            warmup_steps=int(warmup_steps), await_updates=bool(await_updates),
                            grad_dtype=grad_dtype, param_dtype=param_dtype)
        self._session_name = session_name or "torch"
        self._engines = []   # per param group: _stallfree.Engine or None (no trainable params)
        self._members = []   # per param group: [(name, tensor)] the engine's parameters
        self._hypers = []    # per param group: the (beta1, beta2, eps, weight_decay) its engine has
        self._names = {}     # id(tensor) -> name
        self._last_timings = {}
        self._closed = False
        self.daemon = None
        self._client = None
        self.socket = None
        if mode != "no-offload":
            explicit = socket is not None
            self.socket = socket or os.environ.get("STALLFREE_SOCKET") or default_socket()
            self._client, self.daemon = _connect(self.socket, explicit)
            if self.daemon is not None:
                self.socket = self.daemon.socket
        params = self._take_names(params)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        try:
            super().__init__(params, defaults)
        except BaseException:
            self.close()
            raise
        _live.add(self)

    # --- construction -----------------------------------------------------------------------

    def _take_names(self, params):
        """Accepts tensors, (name, tensor) pairs, or group dicts of either; records the names."""
        def strip(seq):
            out = []
            for item in seq:
                if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
                    self._names[id(item[1])] = item[0]
                    out.append(item[1])
                else:
                    out.append(item)
            return out
        if isinstance(params, torch.Tensor):
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            "Tensors or dicts, but got " + torch.typename(params))
        params = list(params)
        if params and isinstance(params[0], dict):
            return [dict(g, params=strip(g["params"] if not isinstance(g["params"], torch.Tensor)
                                         else [g["params"]])) for g in params]
        return strip(params)

    def add_param_group(self, param_group):
        if self._closed:
            raise Error("the optimizer is closed")
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                     "param_groups[%d]." % gi)
        members = []
        device = None
        for i, p in enumerate(group["params"]):
            name = self._names.get(id(p), "param_groups[%d][%d]" % (gi, i))
            self._names[id(p)] = name
            desc = "parameter '%s' (shape %s)" % (name, list(p.shape))
            if p.dtype != torch.float32:
                raise Error("%s is %s: ZenFlowAdamW updates fp32 parameters (keep fp32 master "
                            "weights and use autocast for lower-precision compute)"
                            % (desc, p.dtype))
            if p.is_sparse or p.layout != torch.strided:
                raise Error("%s is not a dense tensor" % desc)
            if not p.requires_grad:
                continue
            if not p.is_contiguous():
                raise Error("%s is not contiguous" % desc)
            if p.device.type not in ("cpu", "cuda"):
                raise Error("%s is on %s: only cpu and cuda tensors" % (desc, p.device))
            if device is None:
                device = p.device
            elif p.device != device:
                raise Error("%s is on %s but the group's other parameters are on %s: put each "
                            "device's parameters in their own group" % (desc, p.device, device))
            members.append((name, p))
        self._members.append(members)
        self._hypers.append(_hyper_of(group))
        self._engines.append(self._make_engine(gi, members, device) if members else None)

    def _make_engine(self, gi, members, device):
        group = self.param_groups[gi]
        config = dict(self._config)
        config.update(zip(("beta1", "beta2", "eps", "weight_decay"), _hyper_of(group)))
        stream = 0
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device).cuda_stream
        specs = [(name, list(p.shape) or [1], p.data_ptr()) for name, p in members]
        name = self._session_name if len(self.param_groups) == 1 and gi == 0 else \
            "%s/g%d" % (self._session_name, gi)
        engine = _stallfree.Engine(self._client, name, _rank(), config, specs, device.type,
                                   stream)
        if (torch.distributed.is_available() and torch.distributed.is_initialized() and
                torch.distributed.get_world_size() > 1 and config["mode"] == "zenflow"):
            engine.set_score_reduce(_all_reduce_scores)
        return engine

    # --- stepping ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step with each group's current lr (and betas, eps, weight_decay)."""
        if self._closed:
            raise Error("the optimizer is closed")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        timings = []
        for gi, group in enumerate(self.param_groups):
            engine = self._engines[gi]
            if engine is None:
                continue
            values, grads, keep = [], [], []
            for name, p in self._members[gi]:
                g = p.grad
                if g is not None:
                    if g.is_sparse or g.layout != torch.strided:
                        raise Error("parameter '%s' has a sparse gradient: ZenFlowAdamW takes "
                                    "dense gradients (nn.Embedding(sparse=False))" % name)
                    if g.dtype != torch.float32 or g.device != p.device or g.shape != p.shape:
                        raise Error("parameter '%s': its gradient is %s %s on %s, not fp32 of "
                                    "its own shape and device" % (name, g.dtype, list(g.shape),
                                                                  g.device))
                    if not g.is_contiguous():
                        g = g.contiguous()
                        keep.append(g)
                if not p.is_contiguous():
                    raise Error("parameter '%s' is no longer contiguous" % name)
                values.append(p.data_ptr())
                grads.append(g.data_ptr() if g is not None else 0)
            if not any(grads):
                continue  # nothing to do, as torch's AdamW
            # A scheduler may change any of them between steps.
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                         "param_groups[%d]." % gi)
            hyper = _hyper_of(group)
            if hyper != self._hypers[gi]:
                engine.set_adamw(*hyper)
                self._hypers[gi] = hyper
            try:
                engine.step(float(group["lr"]), values, grads)
            except Error as e:
                raise self._explain(e) from e
            timings.append(engine.last_timings())
        if timings:
            self._last_timings = _sum_timings(timings)
        return loss

    def _explain(self, e):
        """The engine's error, or, when the daemon went away, what was lost and how to go on."""
        msg = str(e)
        if not (msg.startswith("UNAVAILABLE") or "no session" in msg):
            return e
        return Error(
            "stallfreed at %s went away (%s): the daemon's part of this optimizer's state (the "
            "cold columns' fp32 values and moments) went with it, so this optimizer cannot go "
            "on. Restart stallfreed, build the model and a new ZenFlowAdamW, and load the model's "
            "and the optimizer's state_dict() saved before (they carry the daemon's part)"
            % (self.socket, msg))

    @property
    def last_timings(self):
        """The last step's split (seconds: optimizer, copies, stall, total) and traffic (bytes
        to host / to device), summed over the param groups' engines."""
        return dict(self._last_timings)

    def hot_columns(self, param):
        """The sorted hot input columns of `param` (a tensor of this optimizer, or its name)."""
        for gi, members in enumerate(self._members):
            for name, p in members:
                if p is param or name == param:
                    return list(self._engine(gi).hot_columns(name))
        raise Error("%r is not a trainable parameter of this optimizer" % (
            param if isinstance(param, str) else "tensor of shape %s" % list(param.shape)))

    def flush(self):
        """Waits for all offload work and brings every cold column to the newest update."""
        for gi in range(len(self._engines)):
            if self._engines[gi] is not None:
                self._engine(gi).flush()

    def _engine(self, gi):
        if self._closed:
            raise Error("the optimizer is closed")
        return self._engines[gi]

    # --- state ------------------------------------------------------------------------------

    def state_dict(self):
        """torch's layout (param_groups with the hyper-parameters) plus "stallfree": every
        engine's state and its daemon session's checkpoint bytes, so that load_state_dict in
        another process continues exactly. Does not change the run: a daemon update still
        running is waited for but its result applied at the usual step."""
        if self._closed:
            raise Error("the optimizer is closed")
        sd = super().state_dict()
        engines = []
        for gi, engine in enumerate(self._engines):
            if engine is None:
                engines.append(None)
                continue
            state, daemon = engine.checkpoint()
            engines.append({"shapes": [list(p.shape) for _, p in self._members[gi]],
                            "names": [n for n, _ in self._members[gi]],
                            "engine": _bytes_tensor(state), "daemon": _bytes_tensor(daemon)})
        sd["stallfree"] = {"version": _STATE_VERSION, "config": dict(self._config),
                           "engines": engines}
        return sd

    def load_state_dict(self, state_dict):
        """Loads a state_dict() of a ZenFlowAdamW over the same parameters (shapes, groups and
        configuration); load the model's weights first. The optimizer then continues exactly as
        the one that saved it."""
        if self._closed:
            raise Error("the optimizer is closed")
        extra = state_dict.get("stallfree")
        if extra is None:
            raise Error("this state dict has no 'stallfree' entry: it was not written by "
                        "ZenFlowAdamW.state_dict()")
        if extra.get("version") != _STATE_VERSION:
            raise Error("state dict version %r, this stallfree reads %d"
                        % (extra.get("version"), _STATE_VERSION))
        if extra["config"] != self._config:
            diff = {k: (extra["config"].get(k), v) for k, v in self._config.items()
                    if extra["config"].get(k) != v}
            raise Error("the state dict was written with another configuration (saved, now): %s"
                        % diff)
        saved = extra["engines"]
        if len(saved) != len(self._engines):
            raise Error("the state dict has %d parameter groups, this optimizer %d"
                        % (len(saved), len(self._engines)))
        for gi, entry in enumerate(saved):
            shapes = [list(p.shape) for _, p in self._members[gi]]
            if (entry is None) != (self._engines[gi] is None) or (
                    entry is not None and entry["shapes"] != shapes):
                raise Error("param_groups[%d]: the state dict's parameters %s differ from this "
                            "optimizer's %s" % (gi, entry and entry["shapes"], shapes))
        rest = {k: v for k, v in state_dict.items() if k != "stallfree"}
        super().load_state_dict(rest)
        for gi, entry in enumerate(saved):
            if entry is None:
                continue
            engine = self._engines[gi]
            if engine.step_count != 0:  # restoring needs a fresh engine and session
                engine.close()
                members = self._members[gi]
                engine = self._make_engine(gi, members, members[0][1].device)
                self._engines[gi] = engine
                self._hypers[gi] = _hyper_of(self.param_groups[gi])
            engine.set_values([p.data_ptr() for _, p in self._members[gi]])
            engine.restore(_tensor_bytes(entry["engine"]), _tensor_bytes(entry["daemon"]))

    # --- lifetime ---------------------------------------------------------------------------

    def close(self):
        """Finishes outstanding offload work, closes the daemon sessions and stops a private
        daemon. Further steps raise stallfree.Error."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for engine in self._engines:
            if engine is not None:
                engine.close()
        self._client = None
        if self.daemon is not None:
            self.daemon.close()
        _live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        return "ZenFlowAdamW(mode=%s, groups=%d, socket=%s)" % (
            self._config["mode"], len(self.param_groups), self.socket)


def _check_hyper(lr, betas, eps, weight_decay, where):
    if not lr >= 0.0:
        raise ValueError("%slr: %r is not >= 0" % (where, lr))
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError("%sbetas: %r are not two values in [0, 1)" % (where, tuple(betas)))
    if not eps > 0.0:
        raise ValueError("%seps: %r is not > 0" % (where, eps))
    if not weight_decay >= 0.0:
        raise ValueError("%sweight_decay: %r is not >= 0" % (where, weight_decay))


def _bytes_tensor(data):
    """Opaque bytes as a uint8 tensor: what torch.load(weights_only=True) accepts (the default
    since torch 2.6, and how Hugging Face's Trainer loads an optimizer at resume)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _tensor_bytes(t):
    """The inverse of _bytes_tensor (bytes, as older state dicts hold, pass through)."""
    if isinstance(t, (bytes, bytearray)):
        return bytes(t)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise Error("the state dict's engine state is %r, not a 1-D uint8 tensor written by "
                    "ZenFlowAdamW.state_dict()" % (type(t).__name__,))
    return t.detach().cpu().contiguous().numpy().tobytes()


def _hyper_of(group):
    """What a group's engine is configured with besides lr: (beta1, beta2, eps, weight_decay)."""
    return (float(group["betas"][0]), float(group["betas"][1]), float(group["eps"]),
            float(group["weight_decay"]))


def _sum_timings(ts):
    out = {"step": max(t["step"] for t in ts)}
    for key in ("optimizer", "copies", "stall", "total", "bytes_to_host", "bytes_to_device",
                "migrated_columns"):
        out[key] = sum(t[key] for t in ts)
    for key in ("boundary", "reselected"):
        out[key] = any(t[key] for t in ts)
    return out


_live = weakref.WeakSet()


@atexit.register
def _close_all():
    """At exit, every open optimizer finishes its offload work and closes its sessions before
    the private daemons stop (atexit runs this before _daemon's handler, registered earlier)."""
    for opt in list(_live):
        try:
            opt.close()
        except Exception:
            pass
