"""stallfree.torch.ZenFlowAdamW: a drop-in torch.optim optimizer over the ZenFlow engine.

    from stallfree.torch import ZenFlowAdamW
    opt = ZenFlowAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)   # instead of AdamW

Each parameter group is one ZenFlow engine (engine/zenflow.h) with its own session on the
node's stallfreed; the engine does all the work on the tensors' own memory (data_ptr), nothing
of it is re-implemented here. See the README, "Using stallfree from PyTorch". Needs torch 2.1
or newer (torch 2.6's param_names and weights_only loading included).

This module is the optimizer's API and its engines' lifetime; the data-parallel partition and
its collectives are _partition.py, the state-dict format _state.py, the Hugging Face
integration _integrations.py, every use of a private torch API (gated by the tested torch
versions) _torch_private.py, DCP checkpoints dcp.py.
"""

import atexit
import contextlib
import datetime
import functools
import json
import os
import sys
import weakref

import torch
import torch.distributed

from . import _stallfree
from . import _rows
from . import _torch_private
from ._daemon import Daemon, default_socket
from ._integrations import (_called_from, _called_from_torch_state_dict, _calling_trainer,
                            _consolidating_callback)
from ._partition import (_DTYPE_NAMES, _Shards, _all_reduce_scores, _announce,
                         _dtensor_refusal, _fsdp2_groups, _is_dtensor, _local,
                         _check_same_parameters, _data_parallel_group, _on_device, _peers, _rank,
                         _warn_missing)
from ._stallfree import Error
from ._state import (_BLOB_KEYS, _DAEMON_KEY, _ENGINE_KEY, _META_KEY, _param_index,
                     _STATE_VERSION, _bytes_tensor, _group_blobs, _ranks_of_consolidated,
                     _share_of, _shares, _uint8)


def _connect(socket, explicit, rpc_timeout=0.0, reattach=0.0):
    """A client for `socket` whose calls are bounded by rpc_timeout seconds (0: the client's
    default) and whose sessions wait up to `reattach` seconds for a restarted daemon to take them
    back; when it does not answer and it was not given explicitly, a client for a private daemon
    (returned too, to be stopped with the optimizer), which is started again if it exits before
    that, and takes the sessions back as a restarted node daemon would."""
    why = "the socket does not exist"
    if os.path.exists(socket):
        try:
            return _stallfree.Client(socket, 3000, rpc_timeout, reattach), None
        except Error as e:
            why = str(e)
    if explicit:
        raise Error(
            "no stallfreed answers at %s (%s): start one with `stallfreed --socket %s`, or pass "
            "socket=None to use $STALLFREE_SOCKET or the node's default socket, and otherwise a "
            "private daemon" % (socket, why, socket))
    daemon = Daemon(restart_on_exit=True)
    print("stallfree: no stallfreed answers at %s; started a private one (pid %d) on %s; it "
          "stops with this optimizer" % (socket, daemon.pid, daemon.socket), file=sys.stderr)
    return _stallfree.Client(daemon.socket, 3000, rpc_timeout, reattach), daemon


def _unsupported_kind(p):
    """Why ZenFlowAdamW cannot take tensor `p` (None if it can): the engine works on a dense,
    plain tensor's own memory (an FSDP2 DTensor's local rows), so tensor subclasses whose
    data_ptr is not that (tensor-parallel DTensors, lazy modules' uninitialized parameters, ...)
    are named here instead of failing inside data_ptr()."""
    if isinstance(p, torch.nn.parameter.UninitializedParameter):
        return ("an uninitialized parameter of a lazy module: run one forward pass before "
                "building the optimizer")
    if _torch_private.is_fsdp1_parameter(p):
        return ("a parameter of FSDP1 (FullyShardedDataParallel), whose ranks each hold a "
                "different shard of a flat buffer: ZenFlowAdamW partitions its own state over "
                "data-parallel replicas; wrap the model in DistributedDataParallel instead (the "
                "optimizer state is still split over the ranks), or keep FSDP1 with a "
                "torch.optim.AdamW")
    if _is_dtensor(p):
        return _dtensor_refusal(p)
    if type(p) not in (torch.Tensor, torch.nn.Parameter):
        return ("a %s, a tensor subclass: ZenFlowAdamW updates plain torch.Tensor / "
                "nn.Parameter storage and FSDP2's DTensors only" % type(p).__name__)
    if p.is_sparse or p.layout != torch.strided:
        return "not a dense tensor (layout %s)" % p.layout
    return None


def _local_grad(name, p, g):
    """FSDP2 parameter p's gradient as the engine reads it: this rank's rows, which FSDP2's
    reduce-scatter left in g with p's own layout."""
    if not _is_dtensor(g) or tuple(g.placements) != tuple(p.placements) or \
            g.device_mesh != p.device_mesh:
        raise Error("parameter '%s': its gradient is %s, not a DTensor of the parameter's "
                    "layout %s (FSDP2 reduce-scatters gradients into it)" % (
                        name, tuple(g.placements) if _is_dtensor(g) else type(g).__name__,
                        tuple(p.placements)))
    return g.to_local()


def _check_grad(name, p, g):
    """Raises Error unless g is a dense plain tensor of p's dtype, device and shape."""
    if g.is_sparse or g.layout != torch.strided:
        raise Error("parameter '%s' has a sparse gradient: ZenFlowAdamW takes dense gradients "
                    "(nn.Embedding(sparse=False))" % name)
    if type(g) not in (torch.Tensor, torch.nn.Parameter):
        raise Error("parameter '%s': its gradient is a %s, not a plain tensor"
                    % (name, type(g).__name__))
    if g.dtype != p.dtype or g.device != p.device or g.shape != p.shape:
        raise Error("parameter '%s': its gradient is %s %s on %s, not of its parameter's dtype "
                    "(%s), shape and device" % (name, g.dtype, list(g.shape), g.device, p.dtype))


# The engine's defaults (engine/zenflow.h, ZenFlowConfig: their one statement), which the
# signature below takes its own from; the transfer dtypes are this front-end's choice (bf16,
# half the host link's traffic), not the engine's.
_ENGINE = _stallfree.default_config()


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with ZenFlow offloading.

    mode: "zenflow" (the top `topk_ratio` input columns of each weight by gradient norm are
    updated on the parameter's device at once; the rest go to stallfreed, which applies their
    mean gradient every `update_interval` steps (a round); a round's update reaches the model
    `land_lag` steps after its last step (1 to the round's length; 0: the round's length, one
    round stale) unless `await_updates`; with `predict_cold` (default) a round of one step lands
    predicted one step ahead, 2 p_R - p_(R-1), so the model's cold columns are where they will
    be when the forward that sees them runs: the optimizer's state is AdamW's either way, and
    the model shows that prediction for its cold columns, after close() too; longer rounds land
    as computed),
    "sync-offload" (every parameter's optimizer state in the daemon, ZeRO-Offload style) or
    "no-offload" (AdamW in place, no daemon). update_interval: "auto" (or 0; the default) for
    the shortest round whose daemon update the step's compute hides: at the warm-up's end and
    at every reselection after it, the engine sets the round's length from the daemon's
    measured time per update U and the caller's compute per step C, ceil(U / 0.8 C), one step
    longer than before where the caller stalled more than 5% of C (and never shorter again), at
    most `max_update_interval` (engine/schedule.h); last_timings["interval"] is the length in
    use. Automatic lengths depend on timing: a run is reproducible bit for bit only from a
    state dict (which holds the length), not from scratch; an int fixes the length. Under
    data parallelism the ranks of process_group sum their figures, so they choose the same
    length; ranks outside it choose on their own, so where ranks of another group (tensor
    parallelism) keep copies of one weight with optimizers of their own, fix update_interval.
    topk_ratio: the hot share of each weight's columns (None: 0.1, DeepSpeed's ZenFlow's too).
    device_budget: instead, the engine's device memory in bytes per parameter (its masters,
    moments, transfer buffers and selection: `device_bytes` less "params"; not the model's own
    values and gradients): the largest hot share, in steps of 0.001, that fits it over every
    trainable parameter given here, whole (engine/zenflow.h, TopkForBudget; the same on every
    data-parallel rank, each of which then holds about 1/L of the rows' share; groups added
    later with add_param_group come on top). For example, bf16 models on CUDA (buffered
    transfers of 4 bytes a cold element, 12 a hot one): 4.8 buys about 0.1, 6 about 0.25;
    direct transfers: 12 a hot element only. Too small a budget raises ValueError naming the
    least it takes. `topk_ratio` (the property) is the share in use.
    grad_dtype / param_dtype: what crosses to and from the daemon ("bf16" or "fp32").
    select_interval: steps between reselections (None: 4 rounds; None with "auto").
    warmup_steps: first steps with rounds of 1 and awaited updates (exact AdamW while the
    moments are young; README "Known behaviour").
    transfers: how the cold columns cross between the parameters' device and the daemon's
    pinned memory: "direct" (the gather and scatter kernels read and write the daemon's memory
    themselves: no transfer buffers on the device, but those moves run inside step() at the
    host link's speed), "buffered" (through device buffers of about (1 - topk_ratio) x 4 bytes
    per parameter with bf16 transfers, their copies overlapped with the next step's compute),
    or "auto" (direct on the CPU, buffered on CUDA); `device_transfers` says which is in use.
    stream_gradients (zenflow, one process, torch >= 2.1): each split weight's gradient goes to
    the engine as the backward produces it (a post-accumulate-grad hook) and is freed there, so
    the model's whole gradient is never resident on the device. It needs one backward per
    step() (no gradient accumulation: a second backward raises) and nothing that reads those
    weights' .grad between backward() and step(): torch.nn.utils.clip_grad_norm_ would not see
    them, so clip with opt.clip_grad_norm_(max_norm), which takes their norms as they leave and
    scales them in the engine (a Hugging Face Trainer's clipping calls it by itself).

    socket: the daemon's socket; None means $STALLFREE_SOCKET, else the node's default socket,
    and if no daemon answers there a private one is started (and stopped with the optimizer).
    session_name: the daemon sessions' name (stallfreectl sessions); default "torch".
    process_group: the data-parallel group over which the optimizer state is partitioned
    (default: torch.distributed's default group when it is initialized; under tensor or
    pipeline parallelism or hybrid sharding, pass the data-parallel subgroup). Rank r of L
    updates rows [R r/L, R (r+1)/L) of every parameter (engine/partition.h), so its daemon
    sessions hold 1/L of the offloaded state; the ranks sum their column scores (the same hot
    columns everywhere) and all-gather the updated rows after every step, so step(), flush()
    and close() are collectives of the group. Its ranks must train the same parameters.
    reduce_gradients: False (default) when the gradients are already averaged over the group
    (DistributedDataParallel); True to have the optimizer average the ranks' local gradients
    itself (a reduce-scatter: each rank receives the mean of its own rows only).
    timeout: seconds any of those collectives may take; past it, or when a peer dies,
    stallfree.Error names the ranks that are gone.
    rpc_timeout: seconds any call to the daemon may take, a wait for its Update included (so
    more than its longest Update); None means $STALLFREE_RPC_TIMEOUT, else 120 (client/client.h,
    "Deadlines": calls that move the session's state get one more second per 64 MiB). A daemon
    that does not answer within it (stopped, hung) makes step() raise stallfree.Error with code
    DEADLINE_EXCEEDED naming the socket, the call and the bound, instead of waiting forever.
    reattach_timeout: when the node's daemon goes away (a crash, `systemctl restart`), how long
    step() waits for it to come back (default 300 s; 0: raise at once). The daemon started again
    takes this optimizer's sessions back from the memory this process holds, and training goes
    on at the step it was, bit for bit: no step is lost and none is computed again, wherever the
    daemon died (between calls, or inside an Update or a push, which the next daemon finishes
    from the session's work journal). When no daemon comes back in time, step() raises
    stallfree.Error (UNAVAILABLE) naming the socket, and the run resumes from its last
    checkpoint. A private daemon (no stallfreed at the socket) that exits is started again by
    this process on its socket, and takes the sessions back the same way; close() never waits.

    lr, betas, eps, weight_decay and amsgrad default to torch.optim.AdamW's defaults (weight_decay
    1e-2), so a script that drops it in without them trains the same AdamW. lr, betas, eps and
    weight_decay are validated as torch.optim.AdamW validates them (the same
    ValueError), and must also be finite (the kernels' arithmetic); lr may be a 1-element
    Tensor. amsgrad, maximize, capturable and differentiable are accepted as False only;
    foreach and fused choose torch's implementation and are ignored.

    Parameters must be dense fp32 or bf16 torch.Tensor / nn.Parameter storage (CPU; CUDA in
    builds with the CUDA backend), each gradient of its parameter's dtype, all of a group on one
    device. A bf16 parameter's fp32 master is the optimizer's (on the device for its hot columns
    and wholly-on-device parameters, in the daemon for its cold columns; in the state dict), and
    its bf16 value is always that master rounded to nearest even. FSDP2's DTensors (fully_shard:
    Shard(0) on a 1-D mesh, or (Replicate(), Shard(0)) under HSDP) are taken: each rank's engine
    works on its local rows with the gradient FSDP2 reduce-scattered, the ranks sum their column
    scores over the shard group, and under HSDP the replicas partition their rows as over
    process_group below (the mesh, not process_group, decides). Other tensor subclasses
    (tensor-parallel DTensors, ...) are refused naming the parameter. requires_grad=False
    parameters are left out. A parameter whose .grad is None in a step is skipped, as
    torch.optim.AdamW skips it: no step, no decay (in zenflow its cold columns' round gradient,
    the sum of the round's gradients over update_interval, gets nothing from that step, and a
    round without any gradient leaves them unchanged). `params` may also be (name, tensor)
    pairs (model.named_parameters()): torch keeps the names as each group's "param_names"; they
    name parameters in messages and are checked by load_state_dict.

    On CUDA each step runs in the order of the stream current at that step (its engine works on
    a stream of its own, which waits for the current stream and is waited for by it).

    optimizer.state holds each trainable parameter's AdamW step count ({"step": tensor}), so
    it is never empty (torch.distributed.checkpoint does not then run a zero-gradient step to
    "initialise" it). state_dict() adds to each group's first parameter's entry the group's
    engine state, its daemon session's checkpoint and a description of both, as uint8 tensors;
    partitioned, those of this rank's rows (load_state_dict takes the list of every rank's state
    dicts to resume with another number of ranks).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, mode="zenflow", topk_ratio=None,
                 device_budget=None,
                 update_interval="auto", max_update_interval=_ENGINE["max_update_interval"],
                 select_interval=None, warmup_steps=_ENGINE["warmup_steps"],
                 await_updates=_ENGINE["await_updates"], land_lag=_ENGINE["land_lag"],
                 predict_cold=_ENGINE["predict_cold"],
                 grad_dtype="bf16", param_dtype="bf16", transfers="auto",
                 stream_gradients=False, socket=None, session_name=None, process_group=None,
                 reduce_gradients=False, timeout=300.0, rpc_timeout=None,
                 reattach_timeout=300.0):
        _check_hyper(lr, betas, eps, weight_decay, "")
        for flag, value in (("amsgrad", amsgrad), ("maximize", maximize),
                            ("capturable", capturable), ("differentiable", differentiable)):
            if value:
                raise ValueError("%s=True is not supported by ZenFlowAdamW (AdamW as "
                                 "torch.optim.AdamW computes it with %s=False)" % (flag, flag))
        if select_interval is not None and not select_interval:
            raise ValueError("select_interval: %r is not >= 1 (None: 4 update intervals)"
                             % (select_interval,))
        if isinstance(update_interval, str):
            if update_interval != "auto":
                raise ValueError("update_interval: %r is not \"auto\" or an int >= 1"
                                 % (update_interval,))
            update_interval = 0  # the engine's auto
        if device_budget is not None and topk_ratio is not None:
            raise ValueError("topk_ratio and device_budget: give one (device_budget sets the "
                             "hot share that fits it)")
        config = dict(mode=mode,
                      topk_ratio=_ENGINE["topk_ratio"] if topk_ratio is None else topk_ratio,
                      update_interval=update_interval,
                      max_update_interval=max_update_interval,
                      select_interval=select_interval or 0, warmup_steps=warmup_steps,
                      await_updates=await_updates, land_lag=land_lag,
                      predict_cold=predict_cold, grad_dtype=grad_dtype,
                      param_dtype=param_dtype, transfers=transfers,
                      stream_gradients=stream_gradients)
        # The engine's checks (engine/zenflow.h: one copy of them), a ValueError naming the field.
        self._config = _stallfree.validate_config(config)
        params = _name_pairs(params)
        if device_budget is not None:
            params = list(params) if not isinstance(params, (torch.Tensor, dict)) else [params]
            self._config["topk_ratio"] = _topk_for_budget(params, self._config, device_budget)
        self._session_name = session_name or "torch"
        self._group = _data_parallel_group(process_group)
        # process_group not given and torch.distributed not (yet) initialized: the partition
        # is resolved again when the optimizer is first used (_resolve_group).
        self._group_pending = process_group is None and self._group is None
        self._version = 0          # bumped by every step() and load_state_dict()
        # (version, state dict of every rank) on the `to` rank of the last consolidation, (version,
        # None) on the others
        self._consolidated = None
        self._trainer_checked = False  # the callers looked at for a Trainer (_follow_trainer)
        if not timeout > 0:
            raise ValueError("timeout: %r is not a positive number of seconds" % (timeout,))
        self._timeout = datetime.timedelta(seconds=float(timeout))
        if (isinstance(reattach_timeout, bool) or
                not isinstance(reattach_timeout, (int, float)) or
                not 0 <= reattach_timeout < float("inf")):
            raise ValueError("reattach_timeout: %r is not a number of seconds >= 0"
                             % (reattach_timeout,))
        if rpc_timeout is not None and (isinstance(rpc_timeout, bool) or
                                        not isinstance(rpc_timeout, (int, float)) or
                                        not rpc_timeout > 0):
            raise ValueError("rpc_timeout: %r is not a positive number of seconds (None: "
                             "$STALLFREE_RPC_TIMEOUT, else 120)" % (rpc_timeout,))
        self._reduce_gradients = bool(reduce_gradients)
        if stream_gradients:
            if mode != "zenflow":
                raise ValueError("stream_gradients: only in mode 'zenflow' (what streams is each "
                                 "weight's split into hot and cold columns), not %r" % (mode,))
            if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
                raise ValueError("stream_gradients needs torch >= 2.1 "
                                 "(Tensor.register_post_accumulate_grad_hook); this is %s"
                                 % torch.__version__)
            if self._group is not None and torch.distributed.get_world_size(self._group) > 1:
                raise ValueError(
                    "stream_gradients: not with data parallelism: a weight's gradient would "
                    "leave before DistributedDataParallel (or reduce_gradients) averages it over "
                    "the ranks; use stream_gradients=False there")
        self._hooks = []     # stream_gradients: the post-accumulate-grad hooks' handles
        self._staged_norms = []  # the streamed gradients' 2-norms this step (clipping)
        self._clipping_checked = False  # a Trainer's clipping looked for (first backward)
        self._split_grad_scale = 1.0  # clip_grad_norm_'s factor on them, for the next step
        if stream_gradients:
            _torch_private.announce_unscaling(self)  # so a GradScaler meets step()'s refusal
        self._staged = []    # per param group: indices whose gradient the engine has for step()
        self._verified = []  # per param group: the ranks' values were found equal (first step)
        self._layouts = []   # per param group: each member's (dtype, device, shape) as built
        self._taken = []     # per param group: its params as the engine was built over them
        if self._group is not None and torch.distributed.get_world_size(self._group) > 1:
            _announce()
        self._shards = []    # per param group: its _Shards (the data-parallel partition)
        self._engines = []   # per param group: _stallfree.Engine or None (no trainable params)
        self._members = []   # per param group: [(name, tensor)] the engine's parameters
        self._hypers = []    # per param group: the (beta1, beta2, eps, weight_decay) its engine has
        self._streams = []   # per param group: the engine's own CUDA stream, or None
        self._last_timings = {}
        self._closed = False
        self.daemon = None
        self._client = None
        self.socket = None
        if mode != "no-offload":
            explicit = socket is not None
            self.socket = socket or os.environ.get("STALLFREE_SOCKET") or default_socket()
            self._client, self.daemon = _connect(self.socket, explicit,
                                                 float(rpc_timeout or 0.0),
                                                 float(reattach_timeout))
            if self.daemon is not None:
                self.socket = self.daemon.socket
        # The bound of every call to the daemon, in seconds (None without one).
        self.rpc_timeout = self._client.rpc_timeout if self._client is not None else None
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        try:
            super().__init__(params, defaults)
        except BaseException:
            self._close(gather=False)
            raise
        _live.add(self)

    # --- construction -----------------------------------------------------------------------

    def add_param_group(self, param_group):
        """torch's add_param_group, all or nothing: a group whose parameters or
        hyper-parameters this optimizer cannot take (or whose engine cannot start) raises and
        leaves the optimizer as it was."""
        if self._closed:
            raise Error("the optimizer is closed")
        if isinstance(param_group, dict):
            param_group = dict(param_group, params=_name_pairs(param_group["params"]))
        before = len(self.param_groups)
        super().add_param_group(param_group)  # torch's checks; appends only if they pass
        try:
            self._take_group(before)
        except BaseException:
            del self.param_groups[before:]
            raise

    def _take_group(self, gi):
        group = self.param_groups[gi]
        _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                     "param_groups[%d]." % gi)
        names = group.get("param_names")
        members = []
        device = None
        for i, p in enumerate(group["params"]):
            name = names[i] if names else "param_groups[%d][%d]" % (gi, i)
            desc = "parameter '%s' (shape %s)" % (name, list(p.shape))
            why = _unsupported_kind(p)
            if why:
                raise Error("%s is %s" % (desc, why))
            if p.numel() == 0:
                raise Error("%s has no elements: leave it out of the optimizer" % desc)
            if p.dtype not in _DTYPE_NAMES:
                raise Error("%s is %s: ZenFlowAdamW updates fp32 and bf16 parameters (a bf16 "
                            "parameter's fp32 master is the optimizer's)" % (desc, p.dtype))
            if not p.requires_grad:
                continue
            if not _local(p).is_contiguous():
                raise Error("%s is not contiguous" % desc)
            if _is_dtensor(p) and self._config["stream_gradients"]:
                raise Error("%s is an FSDP2 DTensor: stream_gradients is not with FSDP2 (its "
                            "gradients are reduce-scattered after the backward); build the "
                            "optimizer with stream_gradients=False" % desc)
            if p.device.type not in ("cpu", "cuda"):
                raise Error("%s is on %s: only cpu and cuda tensors" % (desc, p.device))
            if device is None:
                device = p.device
            elif p.device != device:
                raise Error("%s is on %s but the group's other parameters are on %s: put each "
                            "device's parameters in their own group" % (desc, p.device, device))
            members.append((name, p))
        stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" \
            else None
        shards, engine = self._partition(gi, members, device, stream)
        for lst, value in ((self._shards, shards), (self._members, members),
                           (self._hypers, _hyper_of(group)), (self._streams, stream),
                           (self._engines, engine), (self._staged, set()),
                           (self._verified, False), (self._taken, list(group["params"])),
                           (self._layouts, [(p.dtype, p.device, tuple(p.shape))
                                            for _, p in members])):
            if gi < len(lst):  # taken again (_follow_switched_params)
                lst[gi] = value
            else:
                lst.append(value)
        if self._config["stream_gradients"] and engine is not None:
            for i, (name, p) in enumerate(members):
                if engine.splits(i):
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        functools.partial(self._stage, gi, i, name)))
        for _, p in members:
            self.state[p] = {"step": torch.tensor(0.0)}
        self._mark_blob_entries()

    def _partition(self, gi, members, device, stream):
        """Group gi's data-parallel partition over self._group and its engine (None without
        members)."""
        where = "param_groups[%d]" % gi
        fsdp2 = _fsdp2_groups(members, where) if members else None
        if fsdp2 is None:
            shards = _Shards(self._group, members, self._reduce_gradients, self._timeout)
        else:
            # FSDP2 reduce-scattered the gradients already; under HSDP the ranks of the
            # replicate group hold the same rows, which are partitioned over it as over DDP's
            # replicas (one copy per node).
            if self._reduce_gradients:
                raise Error("%s: reduce_gradients with FSDP2 parameters: FSDP2 averages the "
                            "gradients itself; build the optimizer with reduce_gradients=False"
                            % where)
            shards = _Shards(fsdp2[1], members, False, self._timeout, shard_group=fsdp2[0])
        if shards.world > 1:
            _check_same_parameters(shards.group, members, where)
            shards.peers = _peers(shards.group)  # every rank has announced itself by now
        engine = self._make_engine(gi, shards, device, stream) if members else None
        return shards, engine

    def _resolve_group(self):
        """The partition follows torch.distributed when it was initialized after the optimizer
        was built (a script that builds it before a Hugging Face TrainingArguments, which
        initialises torch.distributed under torchrun): at the first use after that (step,
        state_dict, load_state_dict, flush, consolidate_state_dict) the default group becomes
        process_group and every group's engine is rebuilt over its share, before anything has
        been stepped. A collective of the group, as that first use is."""
        self._follow_switched_params()
        if not self._group_pending:
            return
        group = _data_parallel_group(None)
        if group is None or torch.distributed.get_world_size(group) == 1:
            return
        self._group_pending = False
        if any(e is not None and e.step_count > 0 for e in self._engines):
            raise Error(
                "torch.distributed was initialized after this optimizer had stepped alone: its "
                "state is one process's, not a share of %d ranks'. Build ZenFlowAdamW after "
                "torch.distributed.init_process_group (or Hugging Face TrainingArguments), or "
                "pass process_group" % torch.distributed.get_world_size(group))
        if self._config["stream_gradients"]:
            raise Error("stream_gradients: not with data parallelism (torch.distributed was "
                        "initialized after the optimizer was built with it); build the "
                        "optimizer with stream_gradients=False")
        self._group = group
        _announce()
        for gi, members in enumerate(self._members):
            old = self._engines[gi]
            device = members[0][1].device if members else None
            shards, engine = self._partition(gi, members, device, self._streams[gi])
            self._shards[gi], self._engines[gi] = shards, engine
            self._hypers[gi] = _hyper_of(self.param_groups[gi])
            if old is not None:
                old.close(flush=False)  # nothing stepped: the parameters hold every value

    def _follow_switched_params(self):
        """accelerate's FSDP2 preparation (Accelerator.prepare, and so a Hugging Face Trainer
        with fsdp_config's fsdp_version 2) builds the optimizer over the whole parameters, then
        puts fully_shard's DTensors in their place in param_groups
        (fsdp2_switch_optimizer_parameters). At the first use after that, before anything has
        stepped, every group whose parameters changed is taken again over its new ones, and
        torch's state of the old ones is dropped. A collective where the new ones are
        partitioned, as that first use is."""
        switched = [gi for gi, group in enumerate(self.param_groups)
                    if gi < len(self._taken) and (
                        len(group["params"]) != len(self._taken[gi]) or
                        any(a is not b for a, b in zip(group["params"], self._taken[gi])))]
        if not switched:
            return
        if any(e is not None and e.step_count > 0 for e in self._engines):
            raise Error(
                "param_groups[%d]'s parameters were replaced after the optimizer had stepped "
                "(its state is the old parameters'): build the optimizer over the parameters it "
                "will train, or let accelerate's prepare() replace them before the first step"
                % switched[0])
        for gi in switched:
            old = self._engines[gi]
            self._engines[gi] = None
            if old is not None:
                old.close(flush=False)  # nothing stepped: the old parameters hold every value
            self._take_group(gi)
        current = {id(p) for group in self.param_groups for p in group["params"]}
        for p in [p for p in self.state if id(p) not in current]:
            del self.state[p]

    @property
    def partition(self):
        """{"world": L, "rank": r}: the data-parallel ranks this optimizer's state is split
        over and this rank's place among them ({"world": 1, "rank": 0} in one process)."""
        for shards in self._shards:
            return shards.describe()
        return {"world": 1, "rank": 0}

    def _make_engine(self, gi, shards, device, stream):
        group = self.param_groups[gi]
        config = dict(self._config)
        config.update(zip(_HYPER_FIELDS, _hyper_of(group)))
        specs = shards.specs()
        name = self._session_name if len(self.param_groups) == 1 and gi == 0 else \
            "%s/g%d" % (self._session_name, gi)
        with _on_device(device):
            engine = _stallfree.Engine(self._client, name, _rank(), config, specs, device.type,
                                       stream.cuda_stream if stream is not None else 0)
        if (shards.world > 1 or shards.shard_group is not None) and config["mode"] == "zenflow":
            engine.set_score_reduce(functools.partial(_all_reduce_scores, shards))
        return engine

    @contextlib.contextmanager
    def _ordered(self, gi):
        """Runs engine work of group gi in the order of the current CUDA stream: the engine's
        stream waits for what is queued on the current one (the gradients, a loaded model),
        and the current one for what the engine queued (the updated parameters)."""
        stream = self._streams[gi]
        if stream is None:
            yield
            return
        # The engine enqueues on the parameters' device whatever device the caller has current.
        with torch.cuda.device(stream.device):
            current = torch.cuda.current_stream(stream.device)
            stream.wait_stream(current)
            try:
                yield
            finally:
                current.wait_stream(stream)

    def _moved(self, gi):
        """Why group gi's parameters are no longer where the engine has them (None if they
        are): the engine holds their addresses, dtypes and shapes from when it was built, and
        model.to(), p.data = ... or resize_token_embeddings replace a parameter's storage."""
        for (name, p), (dtype, device, shape) in zip(self._members[gi], self._layouts[gi]):
            if p.dtype != dtype or p.device != device or tuple(p.shape) != shape \
                    or not _local(p).is_contiguous():
                return ("parameter '%s' is now %s %s on %s%s, but the optimizer was built for "
                        "%s %s on %s: its engine works on the parameters' memory as they were. "
                        "Build the optimizer after moving, casting or resizing the model (and "
                        "load a state_dict() saved before into it)" % (
                            name, p.dtype, list(p.shape), p.device,
                            "" if p.is_contiguous() else ", not contiguous", dtype, list(shape),
                            device))
        return None

    def _current(self, gi):
        """Before an engine call that reads or writes the parameters' values: their addresses
        as they are now (p.data may have been replaced by a tensor of the same layout), or
        Error where they moved."""
        why = self._moved(gi)
        if why:
            raise Error(why)
        self._engines[gi].set_values(self._shards[gi].values())

    # --- stepping ---------------------------------------------------------------------------

    @torch.no_grad()
    def _stage(self, gi, i, name, p):
        """stream_gradients: the post-accumulate-grad hook of a split weight. Its gradient goes
        to the engine (the hot columns into the engine's buffer, the cold ones to the daemon's
        pinned memory) and is freed, during the backward."""
        g = p.grad
        if g is None or self._closed:
            return
        _check_grad(name, p, g)
        g = g.contiguous()
        if not self._clipping_checked:
            self._follow_trainer_clipping()  # the optimizer's first streamed gradient
            self._clipping_checked = True
        # Its 2-norm, for clip_grad_norm_ (the gradient leaves now): one read of it.
        norm = torch.linalg.vector_norm(g)
        try:
            with self._ordered(gi):
                self._engine(gi).stage_gradient(i, g.data_ptr())
        except Error as e:
            raise self._explain(e) from e
        self._staged_norms.append(norm)
        self._staged[gi].add(i)
        p.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ over this optimizer's parameters, the gradients that
        stream_gradients handed to the engine during the backward included (torch's function
        does not see them: their .grad is None by then). Returns the total norm (a tensor); the
        gradients in .grad are scaled in place as torch scales them, the streamed ones by the
        engine at the next step(). norm_type 2 with streamed gradients (their 2-norms are taken
        as they leave, one read each); any of torch's otherwise. Under a Hugging Face Trainer
        with stream_gradients this is what the Trainer's clipping calls
        (_follow_trainer_clipping)."""
        max_norm, norm_type = float(max_norm), float(norm_type)
        grads = [p.grad for members in self._members for _, p in members if p.grad is not None]
        if not self._staged_norms:
            return torch.nn.utils.clip_grad_norm_(
                [p for members in self._members for _, p in members], max_norm, norm_type,
                error_if_nonfinite=error_if_nonfinite)
        if norm_type != 2.0:
            raise Error("clip_grad_norm_: norm_type %r with streamed gradients; their norms are "
                        "taken as they leave during the backward, as 2-norms only" % norm_type)
        device = self._staged_norms[0].device
        norms = self._staged_norms + \
            [torch.linalg.vector_norm(g, norm_type).to(device) for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError("The total norm of order %s for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and "
                               "scale the gradients by the non-finite norm anyway, set "
                               "`error_if_nonfinite=False`" % norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            _torch_private.foreach_mul_(grads, [coef.to(g.device) for g in grads])
        self._split_grad_scale *= float(coef)
        return total

    def _follow_trainer_clipping(self):
        """stream_gradients under a Hugging Face Trainer (found among the callers of the
        optimizer's first streamed gradient's hook, once):
        the Trainer clips with accelerate's clip_grad_norm_, which cannot see the streamed
        gradients, so its clipping (the Trainer's private _clip_grad_norm, transformers 4.x and
        5.x) calls clip_grad_norm_ above instead; a Trainer without that method is refused here,
        at the first backward, naming max_grad_norm."""
        trainer = _calling_trainer()
        if trainer is None:
            return
        if not hasattr(trainer, "_clip_grad_norm"):
            raise Error("stream_gradients under this Hugging Face Trainer (transformers %s): it "
                        "clips gradients where the streamed ones are not; set "
                        "TrainingArguments(max_grad_norm=0) or stream_gradients=False" %
                        getattr(sys.modules.get("transformers"), "__version__", "?"))
        opt = weakref.ref(self)
        trainer._clip_grad_norm = lambda model: opt().clip_grad_norm_(trainer.args.max_grad_norm)

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One AdamW step with each group's current lr (and betas, eps, weight_decay). Every
        group's gradients and hyper-parameters are checked before any engine steps, so a
        refused step changes nothing."""
        if self._closed:
            raise Error("the optimizer is closed")
        if grad_scaler is not None or getattr(self, "grad_scale", None) is not None:
            # torch's GradScaler hands itself over (or, in the way it announces, its grad_scale
            # and found_inf as attributes) only to optimizers that say they unscale
            # (_torch_private.announce_unscaling: with stream_gradients, whose gradients it could
            # not reach): refused, before anything changes.
            raise Error("stream_gradients with a GradScaler: the streamed gradients left during "
                        "the backward, so the scaler can neither unscale them nor check them for "
                        "inf; train in bf16 (no scaler needed) or with stream_gradients=False")
        self._resolve_group()
        self._follow_trainer()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for gi, group in enumerate(self.param_groups):
            if self._engines[gi] is None:
                continue
            grads, keep, stepped = [], [], []
            for i, (name, p) in enumerate(self._members[gi]):
                if i in self._staged[gi]:
                    stepped.append(p)  # its gradient is in the engine already (_stage)
                g = p.grad
                if g is not None:
                    if _is_dtensor(p):
                        g = _local_grad(name, p, g)
                    _check_grad(name, _local(p), g)
                    if not g.is_contiguous():
                        g = g.contiguous()
                        keep.append(g)
                    stepped.append(p)
                grads.append(g)
            why = self._moved(gi)
            if why:
                raise Error(why)
            if not stepped and self._shards[gi].world == 1 and \
                    self._shards[gi].shard_group is None:
                continue  # nothing to do, as torch's AdamW (partitioned: the other ranks may have)
            # A scheduler may change any of them between steps (the engine looks again only at
            # what changed since it last took them).
            hyper = _check_hyper(group["lr"], group["betas"], group["eps"],
                                 group["weight_decay"], "param_groups[%d]." % gi,
                                 taken=self._hypers[gi])
            work.append((gi, float(group["lr"]), grads, keep, stepped, hyper))
        timings = []
        for gi, lr, grads, keep, stepped, hyper in work:
            engine = self._engines[gi]
            shards = self._shards[gi]
            sent_before = shards.sent
            if shards.world > 1 and not self._verified[gi]:
                shards.check_same_values("param_groups[%d]" % gi)
                self._verified[gi] = True
            if shards.world > 1 and not shards.reduce_gradients:
                # The gradients are averaged already (DistributedDataParallel), so a rank
                # normally has the same ones as its peers; where it lacks one they have, its
                # rows step with a zero gradient rather than leave the ranks in different
                # collectives.
                present = shards.present(grads)
                if not any(present):
                    continue  # no rank has a gradient in this group: skipped everywhere
                for i, ((name, p), n) in enumerate(zip(self._members[gi], present)):
                    if n and grads[i] is None:
                        _warn_missing(name, n, shards.world)
                        grads[i] = torch.zeros_like(_local(p))
                        keep.append(grads[i])
                stepped = [p for (_, p), n in zip(self._members[gi], present) if n]
            if shards.reduce_gradients:
                grads, held = shards.reduce(grads)
                keep.extend(held)
                stepped = [p for (_, p), g in zip(self._members[gi], grads) if g is not None]
                if not stepped:
                    continue
                addresses = [0 if g is None else g.data_ptr() for g in grads]
            else:
                addresses = [0 if g is None else g.data_ptr() + g.element_size() * off
                             for g, off in zip(grads, shards.offsets)]
            if hyper != self._hypers[gi]:
                engine.set_adamw(*hyper)
                self._hypers[gi] = hyper
            try:
                with self._ordered(gi):
                    engine.step(lr, shards.values(), addresses, self._split_grad_scale)
            except Error as e:
                raise self._explain(e) from e
            timing = engine.last_timings()
            if timing["cold_changed"]:  # else only the hot columns changed (the engine's rule)
                shards.hot_cache = None
                shards.gather()
            else:
                shards.gather(shards.hot_index(engine))
            timing = dict(timing, collective_bytes=shards.sent - sent_before)
            _torch_private.foreach_add_([self.state[p]["step"] for p in stepped], 1)
            self._staged[gi].clear()
            timings.append(timing)
        self._staged_norms = []
        self._split_grad_scale = 1.0
        if timings:
            self._last_timings = _sum_timings(timings)
        self._version += 1
        return loss

    def _explain(self, e):
        """The engine's error, or, when the daemon went away, what was lost and how to go on."""
        # By code (client/client.h: UNAVAILABLE is a daemon that went away, a restarted one that
        # no longer has the session included), not by the message's text.
        if getattr(e, "code", "") == "DEADLINE_EXCEEDED":
            # The call that timed out left the step partway (some columns stepped, some pushes
            # sent): the engine cannot redo it, so this optimizer stops here.
            err = Error(
                "%s. This optimizer cannot go on (its step stopped partway). Once stallfreed at "
                "%s answers again, load the model's and this optimizer's state_dict() saved "
                "before (opt.load_state_dict() gives it fresh daemon sessions) and go on from "
                "there; if the daemon was only slow, pass a larger rpc_timeout (now %g s)"
                % (str(e).rstrip("."), self.socket, self.rpc_timeout or 0))
            err.code = e.code
            return err
        if getattr(e, "code", "") != "UNAVAILABLE":
            return e
        msg = str(e)
        return Error(
            "stallfreed at %s went away (%s): the daemon's part of this optimizer's state (the "
            "cold columns' fp32 values and moments) went with it, so this optimizer cannot go "
            "on. Restart stallfreed, build the model and a new ZenFlowAdamW, and load the model's "
            "and the optimizer's state_dict() saved before (they carry the daemon's part)"
            % (self.socket, msg))

    @property
    def last_timings(self):
        """The last step's split (seconds: optimizer, copies, stall, total) and traffic (bytes
        to host / to device; collective_bytes: what this rank sent in the data-parallel
        collectives of the partition, by the ring algorithms' volume), summed over the param
        groups' engines; interval: the length of the round the step belonged to (1 in the
        warm-up; the longest of the groups')."""
        return dict(self._last_timings)

    @property
    def device_bytes(self):
        """Bytes of the parameters' device (or, on the CPU, host) memory this optimizer's
        engines account for, summed over the param groups: "params" (the parameters' values
        and gradients), "masters", "moments", "transfers", "selection", "engine" (their sum),
        "transient_peak" (the largest transient, the largest of the groups') and "total"
        (engine + params). Partitioned, this rank's rows' engine state."""
        out = {}
        for gi, engine in enumerate(self._engines):
            if engine is None:
                continue
            for key, value in self._engine(gi).device_bytes().items():
                out[key] = max(out.get(key, 0), value) if key == "transient_peak" else \
                    out.get(key, 0) + value
        return out

    @property
    def topk_ratio(self):
        """The hot share of each weight's columns in use (device_budget's choice where given)."""
        return self._config["topk_ratio"]

    @property
    def device_transfers(self):
        """The transfers in use, "direct" or "buffered" ("auto" resolved; None before any
        engine exists)."""
        for gi, engine in enumerate(self._engines):
            if engine is not None:
                return self._engine(gi).transfers()
        return None

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
        self._resolve_group()
        for gi in range(len(self._engines)):
            if self._engines[gi] is not None:
                with self._ordered(gi):
                    self._engine(gi)
                    self._current(gi)
                    self._engines[gi].flush()
                self._shards[gi].gather()

    def _engine(self, gi):
        if self._closed:
            raise Error("the optimizer is closed")
        return self._engines[gi]

    # --- state ------------------------------------------------------------------------------

    def state_dict(self):
        """torch's layout: param_groups with the hyper-parameters (and param_names), and per
        trainable parameter its "step"; each group's first trainable parameter's entry also
        holds the group's engine state, its daemon session's checkpoint and their description
        (uint8 tensors), so that load_state_dict in another process continues exactly. The
        state-dict post-hooks see all of it. Does not change the run: a daemon update still
        running is waited for but its result applied at the usual step.

        Partitioned over data-parallel ranks, this rank's share; after consolidate_state_dict
        (and until the next step() or load_state_dict()), on the rank it gathered to, every
        rank's. Called by accelerate's Accelerator.save_state (which every rank calls), it
        consolidates on rank 0 itself; under a Hugging Face Trainer the optimizer consolidates
        before each checkpoint (_follow_trainer), so the checkpoint the main process writes
        holds every rank's share. Over FSDP2 parameters on a 1-D mesh, asked by torch's
        get_optimizer_state_dict / set_optimizer_state_dict (and so by DCP and accelerate), the
        state in their distributed form (_rows.py): per-row arrays as DTensors cut like the
        parameters, which DCP saves and loads on any number of ranks."""
        if self._closed:
            raise Error("the optimizer is closed")
        self._resolve_group()
        # Consolidated at this step already (every rank that took part knows): the whole state
        # where it was gathered, this rank's share elsewhere; never a second collective, which
        # the ranks would not all enter (a Trainer's callback consolidates before
        # accelerate's save_fsdp_optimizer asks every rank for its state).
        partition = self.partition
        fsdp2_1d = "fsdp2" in partition and partition["world"] == 1
        if self._consolidated is None or self._consolidated[0] != self._version:
            if _shares(partition)["world"] > 1 and not fsdp2_1d and (
                    _called_from("accelerate.checkpointing", "save_accelerator_state") or
                    _called_from("accelerate.utils.fsdp_utils", "save_fsdp_optimizer")):
                self.consolidate_state_dict(to=0)
        if self._consolidated is not None and self._consolidated[0] == self._version:
            if self._consolidated[1] is not None:
                return self._consolidated[1]
            return self._share_state_dict()
        asking = _called_from_torch_state_dict()
        if asking == "set" and "fsdp2" not in partition:
            # set_optimizer_state_dict's template for a full state dict into parameters that are
            # not FSDP2's: the keys of both forms, empty, the saved one's filled in (a full
            # state dict of the distributed form loads here from its whole rows).
            return _rows.template(self._share_state_dict(), self._members, self._shards,
                                  self.param_groups)
        if asking and "fsdp2" in partition:
            # torch's distributed state dict (and DCP and accelerate through it): the rows as
            # DTensors (_rows.py).
            if not fsdp2_1d:
                raise Error("get_optimizer_state_dict / set_optimizer_state_dict under HSDP: "
                            "each rank's state is a part of its replicate group's and of its "
                            "shard group's rows, which torch's state dict cannot describe; save "
                            "and load with stallfree.dcp.save / stallfree.dcp.load")
            # set_optimizer_state_dict's template for a full state dict, which rank 0 may
            # broadcast to the others: the keys of both forms, the saved one's filled in.
            return _rows.to_rows(self._share_state_dict(), self._members, self._shards,
                                 self.param_groups, keep_blob_keys=asking == "set")
        return self._share_state_dict()

    def consolidate_state_dict(self, to=0):
        """Gathers every data-parallel rank's share of the state on rank `to` of process_group
        (every rank when to is None), as torch's ZeroRedundancyOptimizer does: a collective of
        the group. Until the next step() or load_state_dict(), state_dict() there returns the
        whole state (version 3: each group's engine and daemon states of every rank, one after
        the other), which load_state_dict takes on any number of ranks, each taking its rows.
        Costs that rank the host memory of every rank's share. In one process: nothing to do."""
        if self._closed:
            raise Error("the optimizer is closed")
        self._resolve_group()
        self._consolidated = None
        partition = self.partition
        where = _shares(partition)
        if where["world"] == 1:
            return
        if "fsdp2" in partition and partition["world"] > 1:
            raise Error("consolidate_state_dict: not over HSDP (each rank's share is a part of "
                        "its replicate group's and of its shard group's); save with "
                        "stallfree.dcp.save, each rank its own share")
        mine = self._share_state_dict()
        shares = [_group_blobs(mine, gi) for gi in range(len(self.param_groups))]
        group = self._group if "fsdp2" not in partition else self._shards[0].shard_group
        # NCCL moves the pickled objects through the current CUDA device: the parameters'.
        with _on_device(next((p.device for members in self._members for _, p in members),
                             None)):
            if to is None:
                every = [None] * where["world"]
                torch.distributed.all_gather_object(every, shares, group=group)
            else:
                every = [None] * where["world"] if where["rank"] == to else None
                torch.distributed.gather_object(
                    shares, every, dst=torch.distributed.get_global_rank(group, to),
                    group=group)
        if every is None:
            self._consolidated = (self._version, None)  # taken part: not the gathering rank
            return
        whole = dict(mine, state=dict(mine["state"]))
        for gi in range(len(self.param_groups)):
            key, meta = shares[gi][0], shares[gi][1]
            if key is None:
                continue
            meta = dict(meta, version=3, partition=_share_of(partition, 0),
                        consolidated={"engine": [int(e[gi][2].numel()) for e in every],
                                      "daemon": [int(e[gi][3].numel()) for e in every]})
            whole["state"][key] = dict(whole["state"][key], **{
                _ENGINE_KEY: torch.cat([_uint8(e[gi][2]) for e in every]),
                _DAEMON_KEY: torch.cat([_uint8(e[gi][3]) for e in every]),
                _META_KEY: _bytes_tensor(bytearray(json.dumps(meta, sort_keys=True).encode()))})
        self._consolidated = (self._version, whole)

    def _follow_trainer(self):
        """Partitioned under a Hugging Face Trainer (found among the callers of the first
        partitioned step(), once), a callback
        on it that consolidates the state on the saving rank before each checkpoint: the
        Trainer has only its main process call state_dict(), so without it the checkpoint
        would hold rank 0's share alone. Nothing changes in the user's script."""
        partition = self.partition
        if _shares(partition)["world"] == 1 or self._trainer_checked or (
                "fsdp2" in partition and partition["world"] == 1):
            # (on a 1-D FSDP2 mesh the Trainer saves through accelerate's save_fsdp_optimizer,
            # every rank, and torch's state-dict functions: the distributed form, _rows.py)
            return
        self._trainer_checked = True  # once: the Trainer that calls the first partitioned step
        trainer = _calling_trainer()
        if trainer is not None:
            trainer.add_callback(_consolidating_callback(self))

    def _share_state_dict(self):
        """This rank's state dict (state_dict() without consolidation)."""
        with _torch_private.hooks_held(self, "state_dict_pre") as pre_hooks:
            for hook in pre_hooks.values():
                hook(self)
            with _torch_private.hooks_held(self, "state_dict_post") as post_hooks:
                sd = super().state_dict()  # torch's packing, no hook runs in there
        index = _param_index(self.param_groups)
        for gi, engine in enumerate(self._engines):
            if engine is None:
                continue
            with self._ordered(gi):
                self._current(gi)  # fp32 hot columns' masters are the values themselves
                state, daemon = engine.checkpoint()
            members = self._members[gi]
            meta = {"version": _STATE_VERSION, "config": self._config,
                    "names": [n for n, _ in members], "shapes": [list(p.shape) for _, p in members]}
            if self._shards[gi].world > 1 or self._shards[gi].shard_group is not None:
                meta["partition"] = self._shards[gi].describe()
            self._shards[gi].saved_step = engine.step_count
            key = index[id(members[0][1])]
            meta = bytearray(json.dumps(meta, sort_keys=True).encode())
            sd["state"][key] = dict(sd["state"].get(key, {}), **{
                _ENGINE_KEY: _bytes_tensor(state), _DAEMON_KEY: _bytes_tensor(daemon),
                _META_KEY: _bytes_tensor(meta)})
        for hook in post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict):
        """Loads a state_dict() of a ZenFlowAdamW over the same parameters (shapes, groups, names
        and configuration); load the model's weights first. The optimizer then continues exactly
        as the one that saved it. All or nothing as far as the state dict goes: it is checked
        whole (configuration, shapes, names, the engine states, the daemon states and their
        checksums) before the optimizer changes, and a bad one leaves it as it was (its engines,
        groups and state; the model's values are not written). Then each group's engine and
        daemon session are closed before the new one is made and restored, so that the daemon
        never pins two copies of the state; should the daemon fail after that (gone, or its
        pinned budget taken meanwhile), the previous state is gone: the optimizer closes and the
        Error says so. The load pre-hooks see the state dict as given, the post-hooks the
        optimizer restored.

        Partitioned over data-parallel ranks, each rank loads the state dict its own rank saved.
        With another number of ranks than the run that saved it, pass the list of the state
        dicts of all its L ranks, in rank order (a single one when it was saved by one process):
        this rank takes its rows from the ranks whose rows overlap them (engine/repartition.h),
        and reads nothing of the others, so loading them with torch.load(..., mmap=True) keeps
        each rank's memory to its own share."""
        if self._closed:
            raise Error("the optimizer is closed")
        self._resolve_group()
        dicts = list(state_dict) if isinstance(state_dict, (list, tuple)) else [state_dict]
        if not dicts:
            raise Error("load_state_dict: an empty list of state dicts")
        dicts = _ranks_of_consolidated([d.copy() for d in dicts])
        with _torch_private.hooks_held(self, "load_state_dict_pre") as pre_hooks:
            for hook in pre_hooks.values():
                for i, d in enumerate(dicts):
                    result = hook(self, d)
                    if result is not None:
                        dicts[i] = result
            saved, rest = self._saved_engines(dicts)
            engines, hypers = self._restored_engines(saved)
            with _torch_private.hooks_held(self, "load_state_dict_post") as post_hooks:
                try:
                    super().load_state_dict(rest)
                except BaseException as e:
                    if all(new is old for old, new in zip(self._engines, engines)):
                        raise
                    raise self._abandon(engines, "torch's part of the state dict: %s" % (e,),
                                        e) from e
        self._engines, self._hypers = engines, hypers
        self._version += 1
        for shards in self._shards:
            shards.hot_cache = None
        for gi, members in enumerate(self._members):  # a legacy state dict has no entries
            for _, p in members:
                if "step" not in self.state[p]:
                    self.state[p]["step"] = torch.tensor(float(engines[gi].step_count))
        self._mark_blob_entries()
        for hook in post_hooks.values():
            hook(self)

    def _restored_engines(self, saved):
        """Per group: a new engine restored from saved[gi], or the group's own engine where
        saved[gi] is None, and the AdamW constants each was made with.

        Everything the state can be wrong about (the engine state, the daemon's whole: its
        checksum and parameters) is checked against the groups' engines first, so a bad state
        dict changes nothing. Then each group's engine is closed before its new one is made:
        the daemon frees the old session's pinned memory before it takes the new one's, so a
        load never pins two copies of the state. A failure after that (a daemon that went away,
        a pinned budget taken meanwhile) cannot give the freed state back: the optimizer closes
        (_abandon) and the Error says so."""
        todo = [(gi, entry) for gi, entry in enumerate(saved) if entry is not None]
        for gi, (state, daemon) in todo:
            why = self._moved(gi)
            if why:
                raise Error(why)
            self._engines[gi].check_state(state.data_ptr(), state.numel(), daemon.data_ptr(),
                                          daemon.numel())
        engines, hypers = list(self._engines), list(self._hypers)
        for gi, (state, daemon) in todo:
            try:
                engines[gi] = None
                self._engines[gi].close(flush=False)  # the model holds the values to load
                members = self._members[gi]
                engines[gi] = self._make_engine(gi, self._shards[gi], members[0][1].device,
                                                self._streams[gi])
                with self._ordered(gi):
                    engines[gi].set_values(self._shards[gi].values())
                    engines[gi].restore(state.data_ptr(), state.numel(), daemon.data_ptr(),
                                        daemon.numel())
                hypers[gi] = _hyper_of(self.param_groups[gi])
            except BaseException as e:
                raise self._abandon(engines, "param_groups[%d]: %s" % (gi, e), e) from e
        return engines, hypers

    def _abandon(self, engines, what, cause):
        """After a load failed once it had closed an engine: closes every engine (without
        writing the values: the model holds what was being loaded) and the optimizer; the Error
        to raise, saying what happened and what to do."""
        for engine in list(engines) + list(self._engines):
            if engine is not None:
                try:
                    engine.close(flush=False)
                except Exception:
                    pass
        self._engines = [None] * len(self._engines)
        self._close(gather=False)
        err = Error(
            "load_state_dict: %s. The optimizer's previous state was freed before (a load closes "
            "a group's engine and daemon session before it makes the new one, so that the daemon "
            "never pins two copies), so this optimizer is closed now. Build a new ZenFlowAdamW "
            "and load the state dict into it" % (what.rstrip("."),))
        err.code = getattr(cause, "code", "UNKNOWN")
        return err

    def _mark_blob_entries(self):
        """Empty placeholders of the engine entries in the live state of each group's first
        parameter, so that code that rebuilds a state dict from optimizer.state's keys
        (torch.distributed.checkpoint with flatten_optimizer_state_dict) asks for them;
        state_dict() fills them."""
        for members, engine in zip(self._members, self._engines):
            if engine is not None:
                entry = self.state[members[0][1]]
                for key in _BLOB_KEYS:
                    entry.setdefault(key, torch.empty(0, dtype=torch.uint8))

    def _saved_engines(self, dicts):
        """Checks the state dicts (one, or every rank's of a partitioned run) against this
        optimizer; returns per group (engine state, daemon state) as uint8 tensors for this
        rank's partition, or None, and the first state dict without them (for torch's
        load_state_dict: param_groups and the step counts are the same on every rank)."""
        for d in dicts:
            if not isinstance(d, dict) or not isinstance(d.get("param_groups"), list) or \
                    not isinstance(d.get("state"), dict):
                raise Error("this is not an optimizer state dict (no 'state' and 'param_groups')")
        state_dict = dicts[0]
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise Error("the state dict has %d parameter groups, this optimizer %d"
                        % (len(groups), len(self.param_groups)))
        legacy = state_dict.get("stallfree")
        if legacy is not None and len(dicts) > 1:
            raise Error("state dicts of stallfree 0.1.0 hold no partition: load one")
        states = [dict(d["state"]) for d in dicts]
        saved = []
        for gi, (mine, theirs) in enumerate(zip(self.param_groups, groups)):
            where = "param_groups[%d]" % gi
            if len(theirs["params"]) != len(mine["params"]):
                raise Error("%s: the state dict's group has %d parameters, this optimizer's %d"
                            % (where, len(theirs["params"]), len(mine["params"])))
            if "param_names" in theirs and "param_names" in mine and \
                    list(theirs["param_names"]) != list(mine["param_names"]):
                diff = next((i, a, b) for i, (a, b) in enumerate(
                    zip(theirs["param_names"], mine["param_names"])) if a != b)
                raise Error("%s: parameter %d is '%s' in the state dict but '%s' here: the "
                            "state dict was saved for other parameters (or in another order)"
                            % ((where,) + diff))
            if legacy is not None:
                entry = legacy["engines"][gi] if gi < len(legacy["engines"]) else None
                metas = [None if entry is None else {
                    "version": legacy.get("version"), "config": legacy.get("config"),
                    "shapes": entry["shapes"]}]
                blobs = [None if entry is None else (entry["engine"], entry["daemon"])]
            else:
                metas, blobs = [], []
                for d, state in zip(dicts, states):
                    theirs_gi = d["param_groups"][gi]
                    blob_form = any(_META_KEY in state.get(k, {}) and _uint8(
                        state[k][_META_KEY]).numel() > 0 for k in theirs_gi["params"])
                    if blob_form:
                        # (torch's set_optimizer_state_dict adds the distributed form's keys
                        # of its template, this optimizer's own state, to a full state dict
                        # of the other form: the saved state is the blob)
                        _rows.drop_rows(state, theirs_gi["params"])
                        meta, blob = self._group_entry(theirs_gi, state, where)
                    elif any(_rows.is_rows(state.get(k, {})) for k in theirs_gi["params"]):
                        _rows.drop_blob_placeholders(state, theirs_gi["params"])
                        # torch's distributed form (_rows.py): this rank's rows, joined
                        if len(dicts) > 1:
                            raise Error("%s: a state dict of torch's distributed form "
                                        "(get_optimizer_state_dict) loads alone, not in a list"
                                        % where)
                        pos = {id(p): j for j, p in enumerate(self.param_groups[gi]["params"])}
                        members = [(n, p, theirs_gi["params"][pos[id(p)]])
                                   for n, p in self._members[gi]]
                        meta, blob = _rows.from_rows(theirs_gi, state, members,
                                                     self._shards[gi].describe(), where)
                    else:
                        meta, blob = self._group_entry(theirs_gi, state, where)
                    metas.append(meta)
                    blobs.append(blob)
            if any((m is None) != (metas[0] is None) for m in metas):
                raise Error("%s: some of the state dicts hold engine state, others not" % where)
            meta = metas[0]
            if (meta is None) != (self._engines[gi] is None):
                raise Error("%s: the state dict %s, this optimizer's group %s" % (
                    where, "holds no ZenFlowAdamW engine state (was it written by "
                    "ZenFlowAdamW.state_dict()?)" if meta is None else "holds an engine's state",
                    "trains parameters" if meta is None else "has no trainable parameters"))
            if meta is None:
                saved.append(None)
                continue
            for m in metas:
                self._check_meta(gi, m, where)
            saved.append(self._partition_of(gi, metas, blobs, where))
        rest = {k: v for k, v in state_dict.items() if k != "stallfree"}
        rest["state"] = states[0]
        return saved, rest

    @staticmethod
    def _group_entry(theirs, state, where):
        """A group's (meta, (engine, daemon)) from a state dict (None, None without one); takes
        the engine entries out of `state`."""
        for key in theirs["params"]:
            if _META_KEY in state.get(key, {}):
                entry = state[key]
                raw = bytes(_uint8(entry[_META_KEY]).tolist())  # a few hundred bytes
                if not raw:
                    raise Error("%s: the state dict's engine entries are empty placeholders: it "
                                "was built from optimizer.state, not by state_dict()" % where)
                state[key] = {k: v for k, v in entry.items() if k not in _BLOB_KEYS}
                return json.loads(raw.decode()), (entry[_ENGINE_KEY], entry[_DAEMON_KEY])
        return None, None

    def _check_meta(self, gi, meta, where):
        if meta.get("version") not in (1, _STATE_VERSION):  # 3 is expanded on load
            raise Error("%s: state dict version %r, this stallfree reads 1 and %d"
                        % (where, meta.get("version"), _STATE_VERSION))
        # Which saved configurations may resume is the engine's rule (engine/zenflow.h).
        try:
            diff = _stallfree.resume_conflicts(meta["config"], self._config)
        except (ValueError, TypeError) as e:
            raise Error("%s: the state dict's configuration is not one this stallfree reads: %s"
                        % (where, e)) from e
        if diff:
            raise Error("%s: the state dict was written with another configuration: %s; build "
                        "the optimizer with the saved values to resume it" % (where, ", ".join(
                            "%s %s (now %s)" % (k, saved, now)
                            for k, (saved, now) in sorted(diff.items()))))
        shapes = [list(p.shape) for _, p in self._members[gi]]
        if meta["shapes"] != shapes:
            raise Error("%s: the state dict's parameters %s differ from this optimizer's %s"
                        % (where, meta["shapes"], shapes))

    def _partition_of(self, gi, metas, blobs, where):
        """This rank's (engine state, daemon state) of group gi from the saved ranks'."""
        mine = self._shards[gi].describe()
        parts = [m.get("partition", {"world": 1, "rank": 0}) for m in metas]
        if len(metas) == 1 and parts[0] == mine:
            return _uint8(blobs[0][0]), _uint8(blobs[0][1])
        layout = "even"
        if "fsdp2" in mine or any("fsdp2" in p for p in parts):
            # FSDP2 on a 1-D mesh: its shard group's ranks are the partition, cut by
            # fully_shard's chunks; under HSDP the state loads on the mesh that saved it.
            if mine["world"] > 1 or "fsdp2" not in mine or \
                    any(p.get("world", 1) > 1 or "fsdp2" not in p for p in parts):
                raise Error(
                    "%s: this optimizer's FSDP2 parameters are this rank's rows %s; the state "
                    "dict%s given hold%s %s. Under HSDP an FSDP2 state loads on the mesh that "
                    "saved it, each rank its own state dict; on a 1-D mesh, give every rank the "
                    "list of all the saving ranks' state dicts" % (
                        where, mine, "s" if len(parts) > 1 else "",
                        "" if len(parts) > 1 else "s", parts))
            layout = "fsdp2"
            mine, parts = mine["fsdp2"], [p["fsdp2"] for p in parts]
        world = parts[0]["world"]
        if parts != [{"world": world, "rank": j} for j in range(world)]:
            saved = ", ".join("%d of %d" % (p["rank"], p["world"]) for p in parts)
            raise Error(
                "%s: this optimizer is data-parallel rank %d of %d; the state dict%s given hold%s "
                "the state of rank%s %s: load the state dict this rank saved, or, to resume with "
                "another number of ranks, the list of all the saving run's state dicts in rank "
                "order" % (where, mine["rank"], mine["world"], "s" if len(parts) > 1 else "",
                           "" if len(parts) > 1 else "s", "s" if len(parts) > 1 else "", saved))
        members = self._members[gi]
        shapes = [(name, list(p.shape)) for name, p in members]
        sources = set(_stallfree.repartition_sources(shapes, world, mine["world"], mine["rank"],
                                                     layout))
        old, held = [], []  # held: the tensors behind old's addresses, alive until repartition
        for j, blob in enumerate(blobs):
            if j in sources:
                engine, daemon = _uint8(blob[0]), _uint8(blob[1])
                held += [engine, daemon]
                old.append((engine.data_ptr(), engine.numel(), daemon.data_ptr(), daemon.numel()))
            else:
                old.append(None)
        try:
            state, daemon = _stallfree.repartition(shapes, old, mine["world"], mine["rank"],
                                                   layout)
        except Error as e:
            raise Error("%s: re-partitioning the state of %d ranks for rank %d of %d: %s" % (
                where, world, mine["rank"], mine["world"], e)) from e
        return _bytes_tensor(state), _bytes_tensor(daemon)

    # --- lifetime ---------------------------------------------------------------------------

    def close(self):
        """Finishes outstanding offload work (the cold columns brought to the newest update;
        partitioned over data-parallel ranks, a collective: every rank closes, and the ranks'
        blocks are all-gathered), closes the daemon sessions and stops a private daemon.
        Further steps raise stallfree.Error. Closed implicitly (garbage collection, exit, a
        failed construction), a partitioned optimizer closes this rank alone: no collective,
        whose order could differ between the ranks. A failed final flush raises its
        stallfree.Error (the parameters may lack the newest cold columns) once everything is
        closed."""
        self._close(gather=True)

    def _close(self, gather):
        if getattr(self, "_closed", True):
            return
        flushed = False
        if gather and any(sh.partitioned for sh in getattr(self, "_shards", [])):
            try:
                self.flush()
                flushed = True
            except Exception as e:
                print("stallfree: ZenFlowAdamW.close: the ranks' final rows were not gathered "
                      "(%s); this rank's parameters hold the newest values of its own rows only"
                      % (str(e).splitlines()[0][:300],), file=sys.stderr)
        self._closed = True
        for hook in getattr(self, "_hooks", []):
            hook.remove()
        failed = None  # the first engine whose final flush failed: raised once all are closed
        for gi, engine in enumerate(self._engines):
            if engine is not None:
                try:
                    with self._ordered(gi):
                        # The final flush writes the cold columns into the parameters: only
                        # where they still are (else the engine closes without writing).
                        moved = None if flushed else self._moved(gi)
                        if not flushed and not moved:
                            engine.set_values(self._shards[gi].values())
                        engine.close(flush=not flushed and not moved)
                        if moved:
                            raise Error("close(): the cold columns' newest values were not "
                                        "written back: " + moved)
                except Exception as e:
                    failed = failed or e
        self._client = None
        if self.daemon is not None:
            self.daemon.close()
        _live.discard(self)
        if failed is not None:
            explained = self._explain(failed)
            if explained is failed:
                raise failed
            raise explained from failed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._close(gather=False)
        except Exception:
            pass

    def __repr__(self):
        return "ZenFlowAdamW(mode=%s, groups=%d, socket=%s)" % (
            self._config["mode"], len(self.param_groups), self.socket)


def _topk_for_budget(params, config, bytes_per_param):
    """The topk_ratio that device_budget buys (engine/zenflow.h, TopkForBudget) over every
    trainable fp32 / bf16 tensor of `params` (the constructor's groups together, whole: the
    same on every data-parallel rank), on the first one's device."""
    tensors = []
    for item in params:
        group = item["params"] if isinstance(item, dict) else [item]
        if isinstance(group, torch.Tensor):
            group = [group]
        for t in group:
            t = t[1] if isinstance(t, tuple) else t
            if isinstance(t, torch.Tensor) and t.requires_grad and t.dtype in _DTYPE_NAMES \
                    and t.numel() > 0:
                tensors.append(t)
    if not tensors:
        raise ValueError("device_budget: no trainable fp32 or bf16 parameter to size it for")
    device = tensors[0].device.type
    return _stallfree.topk_for_budget(
        config, [(list(t.shape), _DTYPE_NAMES[t.dtype]) for t in tensors],
        device if device in ("cpu", "cuda") else "cpu", float(bytes_per_param))


def _name_pairs(params):
    """torch takes (name, tensor) tuples as named parameters; [name, tensor] lists too here."""
    if isinstance(params, torch.Tensor) or isinstance(params, (set, dict)):
        return params  # torch's own error or a single group dict
    out = []
    for item in params:
        if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str):
            item = tuple(item)
        elif isinstance(item, dict) and not isinstance(item.get("params"), torch.Tensor):
            item = dict(item, params=_name_pairs(item["params"]))
        out.append(item)
    return out


def _check_hyper(lr, betas, eps, weight_decay, where, taken=None):
    """torch.optim.AdamW's checks (its messages, prefixed by `where`: drop-in behaviour), then
    the engine's own checks of what it is configured with (finiteness, which the kernels need
    and torch does not check: torch accepts eps = inf), and lr's finiteness (lr comes with each
    step, not with the engine's configuration). Returns (beta1, beta2, eps, weight_decay) as the
    engine takes them; the engine does not look again at `taken`, what it already took."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("%sTensor lr must be 1-element" % where)
    if not 0.0 <= lr:
        raise ValueError("%sInvalid learning rate: %s (lr must be >= 0)" % (where, lr))
    if not 0.0 <= eps:
        raise ValueError("%sInvalid epsilon value: %s (eps must be >= 0)" % (where, eps))
    if len(betas) != 2:
        raise ValueError("%sbetas: %r are not two values" % (where, tuple(betas)))
    for i, b in enumerate(betas):
        if isinstance(b, torch.Tensor) and b.numel() != 1:
            raise ValueError("%sTensor betas[%d] must be 1-element" % (where, i))
        if not 0.0 <= b < 1.0:
            raise ValueError("%sInvalid beta parameter at index %d: %s (betas must be in [0, 1))"
                             % (where, i, b))
    if not 0.0 <= weight_decay:
        raise ValueError("%sInvalid weight_decay value: %s (weight_decay must be >= 0)"
                         % (where, weight_decay))
    if float(lr) == float("inf"):
        raise ValueError("%slr: inf is not finite: stallfree's AdamW kernels take finite values "
                         "only" % where)
    hyper = _hyper(betas, eps, weight_decay)
    if hyper != taken:
        try:
            _stallfree.validate_config(dict(zip(_HYPER_FIELDS, hyper)))
        except ValueError as e:
            raise ValueError("%s%s" % (where, e)) from None
    return hyper


_HYPER_FIELDS = ("beta1", "beta2", "eps", "weight_decay")  # the engine config's names for _hyper


def _hyper(betas, eps, weight_decay):
    """What an engine is configured with besides lr: (beta1, beta2, eps, weight_decay)."""
    return float(betas[0]), float(betas[1]), float(eps), float(weight_decay)


def _hyper_of(group):
    """_hyper of a param group."""
    return _hyper(group["betas"], group["eps"], group["weight_decay"])


def _sum_timings(ts):
    out = {"step": max(t["step"] for t in ts)}
    for key in ("optimizer", "copies", "stall", "total", "bytes_to_host", "bytes_to_device",
                "migrated_columns", "collective_bytes"):
        out[key] = sum(t[key] for t in ts)
    for key in ("boundary", "cold_changed", "reselected"):
        out[key] = any(t[key] for t in ts)
    out["interval"] = max(t["interval"] for t in ts)
    return out


_live = weakref.WeakSet()


@atexit.register
def _close_all():
    """At exit, every open optimizer finishes its offload work and closes its sessions before
    the private daemons stop (atexit runs this before _daemon's handler, registered earlier)."""
    for opt in list(_live):
        try:
            opt._close(gather=False)
        except Exception:
            pass
