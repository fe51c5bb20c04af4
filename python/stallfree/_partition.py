"""The data-parallel partition of ZenFlowAdamW's state (ARCHITECTURE.md "Scale-out",
engine/partition.h): which group, each rank's rows, the collectives over them (the scores'
sum, the gradients' average, the updated rows' all-gather, which parameters have gradients, the
replicas' equality), every one bounded, and the peers' host and pid in torch.distributed's store
so that a failed collective names the ranks that are gone."""
import contextlib
import hashlib
import json
import os
import socket as _socket
import warnings

import torch
import torch.distributed

from . import _stallfree
from . import _torch_private
from ._stallfree import Error

# The parameter dtypes the engine takes (EngineParam's), by the name the binding knows them by.
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _rank():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


try:  # (DTensor, Shard, Replicate) of torch.distributed.tensor, or None without it
    from torch.distributed.tensor import DTensor as _DTensor, Replicate as _Replicate, \
        Shard as _Shard
except ImportError:
    _DTensor = None


def _is_dtensor(t):
    return _DTensor is not None and isinstance(t, _DTensor)


def _local(t):
    """The tensor whose memory the engine works on: a DTensor's local shard (FSDP2's
    fully_shard: this rank's rows of the parameter), else t itself."""
    if not _is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


# FSDP2's layouts ZenFlowAdamW takes, and what it says of the others.
_FSDP2_LAYOUTS = ("FSDP2's fully_shard layouts: Shard(0) on a 1-D mesh, or (Replicate(), "
                  "Shard(0)) on a 2-D (HSDP) mesh")


def _dtensor_refusal(p):
    """Why ZenFlowAdamW cannot take DTensor p (None where it is FSDP2's layout)."""
    placements = tuple(p.placements)
    if placements == (_Shard(0),) or placements == (_Replicate(), _Shard(0)):
        return None
    return ("a DTensor with placements %s on a %d-D mesh: ZenFlowAdamW takes %s; tensor "
            "parallelism (Shard(1), Replicate(), FSDP + TP meshes) is not supported: keep such "
            "parameters in a torch.optim.AdamW, or shard them with fully_shard alone"
            % (placements, p.device_mesh.ndim, _FSDP2_LAYOUTS))


def _fsdp2_groups(members, where):
    """For a parameter group of FSDP2 DTensors: (the shard group, whose ranks hold different
    rows of every parameter; the replicate group of an HSDP mesh, whose ranks hold the same
    rows, or None). None for a group of plain tensors; Error for a group that mixes the two, or
    whose DTensors do not share one mesh and layout."""
    kinds = {_is_dtensor(p) for _, p in members}
    if kinds != {True}:
        if True in kinds:
            raise Error("%s mixes FSDP2 DTensors and plain tensors: put them in param groups of "
                        "their own" % where)
        return None
    name0, p0 = members[0]
    for name, p in members:
        if p.device_mesh != p0.device_mesh or tuple(p.placements) != tuple(p0.placements):
            raise Error("%s: parameter '%s' is sharded on another mesh or layout (%s) than '%s' "
                        "(%s): put each mesh's parameters in param groups of their own"
                        % (where, name, tuple(p.placements), name0, tuple(p0.placements)))
    mesh = p0.device_mesh
    # FSDP2 cuts dimension 0 as torch.chunk does, so a parameter with fewer rows there than its
    # chunks need leaves the last ranks an empty local shard: their engines hold it with no rows
    # and take part in its collectives (zero scores) all the same.
    shard = mesh.get_group(mesh.ndim - 1)
    if mesh.ndim == 1:
        return shard, None
    return shard, mesh.get_group(0)


def _all_reduce_scores(shards, name, view):
    """The data-parallel ranks of a partitioned group sum each weight's column scores before
    top-k (each rank's scores are its row block's; their sum is the whole weight's), so that all
    of them select the same hot columns (the ScoreReduce hook of the engine). A replicated
    weight's scores are the same on every rank already. Under FSDP2 the ranks of the shard
    group hold other rows of every weight (an empty shard's scores are zeros): the scores are
    summed over it first. The hook also sums, under the name "", the figures an automatic
    round's length is chosen from, so every rank chooses the same."""
    scores = torch.frombuffer(view, dtype=torch.float32)
    what = ("the column scores of '%s'" % name if name else
            "the automatic round's figures (update_interval auto)")
    on_dev = shards._on_group_device(scores)  # the scores themselves on gloo
    if shards.shard_group is not None:  # FSDP2: each rank of it holds other rows
        shards.collective(what, torch.distributed.all_reduce, on_dev, group=shards.shard_group)
    if shards.world > 1 and name not in shards.replicated:
        shards.collective(what, torch.distributed.all_reduce, on_dev)
    if on_dev is not scores:
        scores.copy_(on_dev.cpu())


def _on_device(device):
    """A context with `device` current where it is a CUDA device (nothing otherwise): engine
    calls, engine creation and NCCL's object collectives run on the parameters' device,
    whatever device the caller has current."""
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _data_parallel_group(process_group):
    """The group whose replicas select the same hot columns: `process_group`, else the default
    group when torch.distributed is initialized, else None (one process)."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    if process_group is None:
        return torch.distributed.group.WORLD if initialized else None
    if not initialized:
        raise ValueError("process_group: given, but torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    if torch.distributed.get_rank(process_group) < 0:
        raise ValueError("process_group: this rank (%d) is not a member of it"
                         % torch.distributed.get_rank())
    return process_group


class _Shards:
    """One parameter group's data-parallel partition of the offloaded state (engine/partition.h,
    ARCHITECTURE.md "Scale-out"): over the L ranks of the group, this rank's engine works on
    rows [R r/L, R (r+1)/L) of each parameter (a contiguous view of its memory), so its daemon
    session holds, receives and updates 1/L of the group's offloaded state; a parameter with
    fewer rows than ranks is held whole by every rank (replicated). After each step the ranks
    all-gather their updated blocks, so every rank holds the whole parameters again. With
    reduce_gradients the ranks' local gradients are averaged here first: a reduce-scatter hands
    each rank the mean of its own rows only (ZeRO-2); replicated parameters' gradients are
    all-reduced. Every collective is bounded by `timeout`; a peer that is gone is named."""

    def __init__(self, group, members, reduce_gradients, timeout, shard_group=None):
        self.group = group
        # FSDP2: the ranks holding the other rows of every parameter (fully_shard's shard
        # group; None otherwise). The engine works on this rank's local rows; `group` is then
        # an HSDP mesh's replicate group, over which those rows are partitioned as above.
        self.shard_group = shard_group
        self.world = 1 if group is None else torch.distributed.get_world_size(group)
        self.rank = 0 if group is None else torch.distributed.get_rank(group)
        self.reduce_gradients = reduce_gradients and self.world > 1
        self.timeout = timeout
        self.saved_step = None  # the step of the optimizer's last state_dict(), for messages
        self.hot_cache = None   # hot_index()'s, until the next round boundary
        self.sent = 0           # bytes this rank sent in the collectives (ring volume)
        self.peers = {}         # {global rank: (host, pid)} of the group, for _PeerFailure
        self.params = members    # (name, parameter): plain tensors or FSDP2 DTensors
        self.offsets = []        # per member: this rank's first element
        self.shapes = []         # per member: the shape the engine sees
        self.rows_cols = []      # per member: (rows, cols), the parameter as rows of columns
        self.replicated = set()  # names of the members every rank holds whole
        self.parts = []          # indices of the partitioned members
        self.ranges = [[] for _ in range(self.world)]  # per rank: (first, end) element per part
        for i, (name, p) in enumerate(self.members):
            # The rule is the engine's (engine/partition.h), the trainer's as well.
            shares = [_stallfree.partition_share(list(p.shape), self.world, s)
                      for s in range(self.world)]
            mine = shares[self.rank]
            self.rows_cols.append((mine["rows"], mine["cols"]))
            self.shapes.append(mine["shape"])
            self.offsets.append(mine["first"])
            if self.world == 1:
                continue
            if mine["replicated"]:
                self.replicated.add(name)
                continue
            self.parts.append(i)
            for s, share in enumerate(shares):
                self.ranges[s].append((share["first"], share["end"]))
        self.sizes = [[e - b for b, e in r] for r in self.ranges]
        self.section = max((sum(z) for z in self.sizes), default=0)

    @property
    def partitioned(self):
        return bool(self.parts)

    @property
    def members(self):
        """(name, the tensor the engine works on) of each member: a DTensor's local rows, else
        the parameter itself, as they are now (p.data may have been replaced)."""
        if self.shard_group is None:  # plain tensors (a group of DTensors has a shard group)
            return self.params
        return [(name, _local(p)) for name, p in self.params]

    def specs(self):
        """The engine's parameters: (name, shape, address) of this rank's block of each."""
        return [(name, shape, p.data_ptr() + p.element_size() * off, _DTYPE_NAMES[p.dtype])
                for (name, p), shape, off in
                zip(self.members, self.shapes, self.offsets)]

    def values(self):
        return [p.data_ptr() + p.element_size() * off
                for (_, p), off in zip(self.members, self.offsets)]

    def describe(self):
        out = {"world": self.world, "rank": self.rank}
        if self.shard_group is not None:  # FSDP2: which rows of the parameters are this rank's
            out["fsdp2"] = {"world": torch.distributed.get_world_size(self.shard_group),
                            "rank": torch.distributed.get_rank(self.shard_group)}
        return out

    def _on_group_device(self, t):
        """t where the group's collectives take it (NCCL: the members' device; gloo: the CPU)."""
        group = self.group if self.group is not None else self.shard_group
        if torch.distributed.get_backend(group) == "nccl":
            return t.to(self.members[0][1].device)
        return t.cpu()

    def present(self, grads):
        """Per member, how many ranks of the group have a gradient for it this step (one
        all-reduce of a flag each), so that every rank steps the same members and takes part in
        the same collectives whatever its own gradients are (an unused branch, an idle expert)."""
        flags = self._on_group_device(torch.tensor([0.0 if g is None else 1.0 for g in grads]))
        self.collective("which parameters have gradients", torch.distributed.all_reduce, flags)
        return [int(c) for c in flags.cpu().tolist()]

    def check_same_values(self, where):
        """The ranks of the group must hold the same values of every member (data-parallel
        replicas): a digest of each member's bits (their sum and sum of squares as int64,
        exact in any order), all-gathered once; Error naming the first member that differs."""
        digests = []
        for _, p in self.members:
            bits = p.detach().reshape(-1).view(torch.int16 if p.element_size() == 2
                                               else torch.int32)
            total = torch.zeros(2, dtype=torch.int64, device=p.device)
            for at in range(0, bits.numel(), 1 << 22):  # bounded transients
                x = bits[at:at + (1 << 22)].to(torch.int64)
                total[0] += x.sum()
                total[1] += (x * x).sum()
            digests.append(total)
        mine = self._on_group_device(torch.cat(digests))
        every = torch.empty(self.world * mine.numel(), dtype=mine.dtype, device=mine.device)
        self.collective("the parameters' digests", torch.distributed.all_gather_into_tensor,
                        every, mine)
        every = every.cpu().view(self.world, -1, 2)
        for i, (name, _) in enumerate(self.members):
            differ = [torch.distributed.get_global_rank(self.group, r)
                      for r in range(self.world) if not torch.equal(every[r, i], every[0, i])]
            if differ:
                raise Error(
                    "%s: parameter '%s' holds other values on ranks %s than on rank %d of "
                    "process_group: ZenFlowAdamW partitions its state over process_group as over "
                    "data-parallel replicas, whose parameters are equal. Wrap the model in "
                    "DistributedDataParallel (it broadcasts rank 0's values) or broadcast them "
                    "before the first step; where the ranks hold different shards or slices "
                    "(FSDP, tensor or pipeline parallelism) pass process_group= the group of "
                    "ranks that hold the same values" % (
                        where, name, differ, torch.distributed.get_global_rank(self.group, 0)))

    def collective(self, what, fn, *args, group=None):
        """fn(*args, group=, async_op=True) over the partition's group (or `group`), waited for
        at most `timeout`; a failure (a peer gone, the wait timed out) becomes stallfree.Error
        naming the ranks that are gone."""
        group = self.group if group is None else group
        try:
            work = fn(*args, group=group, async_op=True)
            work.wait(timeout=self.timeout)
        except RuntimeError as e:
            raise _PeerFailure(self, what, e) from e
        # The bytes this rank sends by the ring algorithms (gloo's and NCCL's): all-gather and
        # reduce-scatter (L-1)/L of the whole buffer, all-reduce twice that.
        whole = max(a.numel() * a.element_size() for a in args)
        world = torch.distributed.get_world_size(group)
        share = whole * (world - 1) // world
        self.sent += 2 * share if fn is torch.distributed.all_reduce else share

    def reduce(self, grads):
        """With reduce_gradients: the ranks' gradients (None: no gradient on this rank) averaged
        over the group. Returns per member the gradient the engine reads (this rank's rows of
        the mean; None where no rank had a gradient) and the buffers that back them. Each
        gradient is copied once, into the fp32 buffer of its collective (a None one is zeros
        there); a bf16 member's mean is rounded into a bf16 buffer the engine reads."""
        dev = self.members[0][1].device
        reps = [i for i, (name, _) in enumerate(self.members) if name in self.replicated]
        nflags = len(self.members)
        small = torch.zeros(nflags + sum(self.members[i][1].numel() for i in reps),
                            dtype=torch.float32, device=dev)
        small[:nflags] = torch.tensor([0.0 if g is None else 1.0 for g in grads])
        out = [None] * nflags
        dst, src = [], []
        at = nflags
        for i in reps:
            n = self.members[i][1].numel()
            out[i] = small[at:at + n]
            if grads[i] is not None:
                dst.append(out[i])
                src.append(grads[i].reshape(-1))
            at += n
        mine = None
        if self.parts:
            full = torch.zeros(self.world * self.section, dtype=torch.float32, device=dev)
            for s in range(self.world):
                at = s * self.section
                for i, (b, e) in zip(self.parts, self.ranges[s]):
                    if grads[i] is not None:
                        dst.append(full[at:at + e - b])
                        src.append(grads[i].reshape(-1)[b:e])
                    at += e - b
        if dst:
            _torch_private.foreach_copy_(dst, src)  # widening bf16 on the way
        self.collective("the replicated parameters' gradients", torch.distributed.all_reduce,
                        small)
        small.div_(self.world)
        keep = [small]
        if self.parts:
            mine = torch.empty(self.section, dtype=torch.float32, device=dev)
            self.collective("the gradients (reduce-scatter)",
                            torch.distributed.reduce_scatter_tensor, mine, full)
            mine.div_(self.world)
            keep.append(mine)
            at = 0
            for i, n in zip(self.parts, self.sizes[self.rank]):
                out[i] = mine[at:at + n]
                at += n
        any_grad = small[:nflags].cpu().tolist()  # summed over the ranks
        for i, (_, p) in enumerate(self.members):
            if out[i] is not None and p.dtype != torch.float32:
                out[i] = out[i].to(p.dtype)  # the engine reads its parameter's dtype
                keep.append(out[i])
        return [o if any_grad[i] > 0 else None for i, o in enumerate(out)], keep

    def gather(self, hot=None):
        """Every rank's updated blocks to every rank: one all-gather of the padded blocks. hot:
        {member index: its hot columns (a LongTensor)} for a step in which only those columns
        of the split weights changed (a zenflow step between round boundaries: the cold columns
        change only when an update lands): their blocks send those columns only. The buffer is
        in the members' dtype when they share one (bf16 moves as bf16), else fp32 (a bf16
        value round-trips exactly); each value is copied once into it and once out of it."""
        if not self.parts:
            return
        dev = self.members[0][1].device
        hot = hot or {}
        dtypes = {self.members[i][1].dtype for i in self.parts}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        views, widths = [], []
        for i in self.parts:
            rows, cols = self.rows_cols[i]
            views.append(self.members[i][1].detach().view(rows, cols))
            widths.append(hot[i].numel() if i in hot else cols)
        sizes = [[(e - b) // v.shape[1] * w for v, w, (b, e) in zip(views, widths, r)]
                 for r in self.ranges]
        section = max(sum(z) for z in sizes)
        send = torch.empty(section, dtype=dtype, device=dev)
        dst, src = [], []
        at = 0
        for i, v, w, (b, e), n in zip(self.parts, views, widths, self.ranges[self.rank],
                                      sizes[self.rank]):
            block = v[b // v.shape[1]:e // v.shape[1]]
            if i in hot and dtype == v.dtype:
                torch.index_select(block, 1, hot[i], out=send[at:at + n].view(-1, w))
            else:
                dst.append(send[at:at + n])
                src.append((block.index_select(1, hot[i]) if i in hot else block).reshape(-1))
            at += n
        if dst:
            _torch_private.foreach_copy_(dst, src)
        recv = torch.empty(self.world * section, dtype=dtype, device=dev)
        self.collective("the updated parameters (all-gather)",
                        torch.distributed.all_gather_into_tensor, recv, send)
        dst, src = [], []
        for s in range(self.world):
            if s == self.rank:
                continue
            at = s * section
            for i, v, (b, e), n in zip(self.parts, views, self.ranges[s], sizes[s]):
                rows = slice(b // v.shape[1], e // v.shape[1])
                if i in hot:
                    v[rows].index_copy_(1, hot[i], recv[at:at + n].view(-1, hot[i].numel())
                                        .to(v.dtype))
                else:
                    dst.append(v[rows].reshape(-1))
                    src.append(recv[at:at + n])
                at += n
        if dst:
            _torch_private.foreach_copy_(dst, src)

    def hot_index(self, engine):
        """{member index: hot columns} of the partitioned weights the engine splits, kept
        until the next round boundary (reselections happen only there)."""
        if self.hot_cache is None:
            dev = self.members[0][1].device
            self.hot_cache = {
                i: torch.tensor(engine.hot_columns(self.members[i][0]), dtype=torch.long,
                                device=dev)
                for i in self.parts if not engine.on_device(i)}
        return self.hot_cache


class _PeerFailure(Error):
    """A collective of a partitioned ZenFlowAdamW failed: which ranks are gone (checked through
    torch.distributed's store, where each rank left its host and pid), in which collective."""

    def __init__(self, shards, what, cause):
        gone = _gone_ranks(shards.peers)
        _announce(failed=True)  # so that its peers do not take this rank for the dead one
        who = ("global rank(s) %s of the process group (no longer running)"
               % ", ".join(map(str, gone))
               if gone else "a peer rank (not found dead on this host: it may be on another "
               "host, or stuck)")
        super().__init__(
            "ZenFlowAdamW: %s failed on global rank %d: %s stopped answering (%s). This rank's "
            "parameters and optimizer state are no longer consistent with the others'; restart "
            "every rank from the last checkpoint (the model's and the optimizer's state_dict()%s)"
            % (what, torch.distributed.get_rank(), who, str(cause).strip().splitlines()[0][:300],
               "" if shards.saved_step is None else
               "; this optimizer's last state_dict() was taken after step %d" % shards.saved_step))


def _announce(failed=False):
    """Leaves this rank's host and pid in torch.distributed's store, so that a peer whose
    collective fails can tell which ranks are gone; `failed`: this rank saw a peer fail (and
    may exit: it is not the cause)."""
    store = _torch_private.default_store()
    if store is None:
        return
    try:
        store.set("stallfree/rank%d" % torch.distributed.get_rank(), "%s %d%s" % (
            _socket.gethostname(), os.getpid(), " failed" if failed else ""))
    except Exception:
        if not failed:
            raise


def _peers(group):
    """{global rank: (host, pid)} of the ranks of `group`, as they left them in the store (read
    once every rank has announced itself, so that a failure later does not need the store)."""
    store = _torch_private.default_store()
    peers = {}
    if store is None:
        return peers
    for r in torch.distributed.get_process_group_ranks(group):
        key = "stallfree/rank%d" % r
        if store.check([key]):
            host, pid = store.get(key).decode().split()[:2]
            peers[r] = (host, int(pid))
    return peers


def _gone_ranks(peers):
    """The global ranks among `peers` on this host whose process is gone, less those that said
    in the store that they saw a peer fail (when the store still answers: rank 0 or torchrun's
    agent serves it)."""
    host = _socket.gethostname()
    gone = [r for r, (h, pid) in sorted(peers.items()) if h == host and not _running(pid)]
    store = _torch_private.default_store()
    if not gone or store is None:
        return gone
    try:
        return [r for r in gone if not store.get("stallfree/rank%d" % r).decode().endswith(
            " failed")]
    except Exception:  # the store is gone with its host
        return gone


def _running(pid):
    """Whether process `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


def _check_same_parameters(group, members, where):
    """The ranks of `group` must partition the same parameters: a cheap digest of the names and
    shapes, all-gathered once per group."""
    digest = hashlib.sha1(json.dumps([(n, list(p.shape)) for n, p in members]).encode())
    mine = digest.hexdigest()
    theirs = [None] * torch.distributed.get_world_size(group)
    # NCCL moves the pickled objects through the current CUDA device: the parameters'.
    with _on_device(members[0][1].device if members else None):
        torch.distributed.all_gather_object(theirs, mine, group=group)
    differ = [torch.distributed.get_global_rank(group, r) for r, d in enumerate(theirs)
              if d != mine]
    if differ:
        raise Error(
            "%s: ranks %s of process_group train other parameters (names or shapes) than rank %d: "
            "ZenFlowAdamW partitions its state over process_group, whose ranks must be "
            "data-parallel replicas; under pipeline or tensor parallelism pass process_group= "
            "the data-parallel group" % (where, differ, torch.distributed.get_rank()))


_warned_missing = set()


def _warn_missing(name, present, world):
    if name not in _warned_missing:
        _warned_missing.add(name)
        warnings.warn(
            "ZenFlowAdamW: parameter '%s' has a gradient on %d of the %d ranks of "
            "process_group but not on this one: its rows here step with a zero gradient. "
            "Gradients averaged over the ranks (DistributedDataParallel) are the same on every "
            "rank; reduce_gradients=True averages them in the optimizer, counting a missing "
            "one as zero" % (name, present, world), stacklevel=3)
