"""ZenFlowAdamW's state in torch's distributed state-dict form, for FSDP2 on a 1-D mesh: what
torch.distributed.checkpoint.state_dict's get_optimizer_state_dict / set_optimizer_state_dict
(and accelerate's FSDP2 checkpoints, and dcp.save / dcp.load of them) see.

Each rank's engine and daemon state is its own rows of every parameter. Saved as opaque bytes,
DCP would take them for replicated and keep one rank's. Here each group's state is cut
(engine/repartition.h, SplitRows) into
  - per parameter and per-row array (its moments, masters, accumulator, ...), a DTensor of the
    whole parameter's rows cut as fully_shard cuts the parameter ("zenflow_rows.<name>" in the
    parameter's entry): DCP writes each rank's rows and loads any rank's rows from any number of
    saving ranks; a full state dict all-gathers them like torch.optim.AdamW's exp_avg;
  - the rest (step counts, column sets, the daemon's header, the description), the same on every
    rank, as bytes in the group's first parameter's entry ("zenflow_rest"), which DCP writes once
    and loads whole, whatever its size.
Loading joins this rank's rows and the rest back into its state (JoinRows). The arrays a state
has, and their widths, follow from the configuration and shapes alone, so a fresh optimizer's
state dict is the template DCP loads any saved one into.
"""
import json
import struct

import torch

from . import _stallfree
from ._stallfree import Error
from ._state import _BLOB_KEYS, _group_blobs, _param_index, _uint8

REST_KEY = "zenflow_rest"
ROWS_PREFIX = "zenflow_rows."
_MAGIC = b"SFROWS1\0"
ROWS_VERSION = 4  # the description's version in the rest


def _frame(engine, daemon, meta):
    return b"".join([_MAGIC, struct.pack("<qqq", len(engine), len(daemon), len(meta)),
                     bytes(engine), bytes(daemon), meta])


def _unframe(rest, where):
    if not isinstance(rest, (bytes, bytearray)) or len(rest) < 32 or rest[:8] != _MAGIC:
        raise Error("%s: the state dict's %s is not ZenFlowAdamW's (%s)" % (
            where, REST_KEY, type(rest).__name__))
    ne, nd, nm = struct.unpack("<qqq", rest[8:32])
    if min(ne, nd, nm) < 0 or 32 + ne + nd + nm != len(rest):
        raise Error("%s: the state dict's %s is damaged (%d bytes, its sizes say %d)" % (
            where, REST_KEY, len(rest), 32 + ne + nd + nm))
    at = 32
    engine, daemon = bytes(rest[at:at + ne]), bytes(rest[at + ne:at + ne + nd])
    meta = json.loads(bytes(rest[at + ne + nd:]).decode())
    return engine, daemon, meta


def _per(shape):
    """A parameter's rows per index of its dimension 0 (its rows as engine/partition.h counts
    them, over its dimension 0; 0 for a parameter of no rows)."""
    if not shape or not shape[0]:
        return 0
    return _stallfree.partition_share(shape, 1, 0)["rows"] // shape[0]


def to_rows(sd, members_of, shards_of, param_groups, keep_blob_keys=False):
    """The state dict `sd` (this rank's share, the engine entries as bytes) in the form above.
    members_of[gi]: the group's (name, DTensor parameter); shards_of[gi]: its _Shards. With
    keep_blob_keys, the engine entries stay as empty placeholders (a template that either form
    fills in)."""
    from torch.distributed.tensor import DTensor

    index = _param_index(param_groups)
    state = dict(sd["state"])
    for gi in range(len(sd["param_groups"])):
        key, meta, engine, daemon = _group_blobs(sd, gi)
        if key is None:
            continue
        members = members_of[gi]
        where = shards_of[gi].describe()["fsdp2"]
        shapes = [(n, list(p.shape)) for n, p in members]
        engine, daemon = _uint8(engine), _uint8(daemon)
        rest_e, rest_d, arrays = _stallfree.split_rows(
            shapes, engine.data_ptr(), engine.numel(), daemon.data_ptr(), daemon.numel(),
            where["world"], where["rank"], "fsdp2")
        meta = {k: v for k, v in meta.items() if k != "partition"}
        meta.update(version=ROWS_VERSION, rows="fsdp2")
        state[key] = {k: v for k, v in state[key].items() if k not in _BLOB_KEYS}
        if keep_blob_keys:
            state[key].update({k: torch.empty(0, dtype=torch.uint8) for k in _BLOB_KEYS})
        state[key][REST_KEY] = _frame(rest_e, rest_d, json.dumps(meta, sort_keys=True).encode())
        for i, name, width, is_int, buf in arrays:
            _, p = members[i]
            d0, per = p.shape[0], _per(list(p.shape))
            local_d0 = p.to_local().shape[0]
            dtype = torch.int64 if is_int else torch.float32
            t = (torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype))
            t = t.view(local_d0, per * width)
            k = index[id(p)]
            state[k] = dict(state.get(k, {}))
            state[k][ROWS_PREFIX + name] = DTensor.from_local(
                t, p.device_mesh, p.placements, run_check=False,
                shape=torch.Size([d0, per * width]), stride=(per * width, 1))
    return dict(sd, state=state)


def template(sd, members_of, shards_of, param_groups):
    """A template of both forms for set_optimizer_state_dict (full state dicts) over parameters
    that are not FSDP2's: every engine entry and every key of the distributed form (the arrays
    this optimizer's state has, SplitRows' names) present and empty. torch fills in the saved
    dict's values, whichever form it is; load_state_dict takes the form that is filled."""
    index = _param_index(param_groups)
    state = dict(sd["state"])
    for gi in range(len(sd["param_groups"])):
        key, _, engine, daemon = _group_blobs(sd, gi)
        if key is None:
            continue
        where = shards_of[gi].describe()
        shapes = [(n, list(p.shape)) for n, p in members_of[gi]]
        engine, daemon = _uint8(engine), _uint8(daemon)
        _, _, arrays = _stallfree.split_rows(
            shapes, engine.data_ptr(), engine.numel(), daemon.data_ptr(), daemon.numel(),
            where["world"], where["rank"], "even")
        state[key] = dict(state[key], **{k: torch.empty(0, dtype=torch.uint8)
                                         for k in _BLOB_KEYS})
        state[key][REST_KEY] = b""
        for i, name, _, is_int, _ in arrays:
            k = index[id(members_of[gi][i][1])]
            state[k] = dict(state.get(k, {}))
            state[k][ROWS_PREFIX + name] = torch.empty(
                0, dtype=torch.int64 if is_int else torch.float32)
    return dict(sd, state=state)


def is_rows(entry):
    return REST_KEY in entry


def drop_blob_placeholders(state, keys):
    """Takes empty engine entries (to_rows' keep_blob_keys) out of state[k] for each of `keys`."""
    for k in keys:
        entry = state.get(k)
        if entry and any(n in _BLOB_KEYS for n in entry):
            state[k] = {n: v for n, v in entry.items() if n not in _BLOB_KEYS}


def drop_rows(state, keys):
    """Takes the entries of the distributed form out of state[k] for each of `keys`."""
    for k in keys:
        entry = state.get(k)
        if entry and any(n == REST_KEY or n.startswith(ROWS_PREFIX) for n in entry):
            state[k] = {n: v for n, v in entry.items()
                        if n != REST_KEY and not n.startswith(ROWS_PREFIX)}


def from_rows(theirs, state, members, partition, where):
    """A group's (meta, (engine, daemon)) for this rank from a state dict in the form above:
    `state` (a copy of the state dict's "state", whose entries this replaces by ones without the
    engine's), `theirs` its param group, `members` this optimizer's (name, parameter, state key),
    `partition` this rank's (_Shards.describe())."""
    from torch.distributed.tensor import DTensor

    first = next(k for k in theirs["params"] if REST_KEY in state.get(k, {}))
    entry = dict(state[first])
    engine, daemon, meta = _unframe(entry.pop(REST_KEY), where)
    state[first] = entry
    if meta.get("version") != ROWS_VERSION or meta.get("rows") != "fsdp2":
        raise Error("%s: the state dict's rows are version %r of layout %r, this stallfree "
                    "reads %d of 'fsdp2'" % (where, meta.get("version"), meta.get("rows"),
                                              ROWS_VERSION))
    if "fsdp2" in partition and partition["world"] > 1:
        raise Error("%s: a state dict of torch's distributed form (get_optimizer_state_dict, "
                    "DCP) loads on a 1-D FSDP2 mesh or in one process, not under HSDP: "
                    "use stallfree.dcp" % where)
    if "fsdp2" in partition:
        world, rank, layout = partition["fsdp2"]["world"], partition["fsdp2"]["rank"], "fsdp2"
    else:
        world, rank, layout = partition["world"], partition["rank"], "even"
    shapes = [(n, list(p.shape)) for n, p, _ in members]
    if meta.get("shapes") is not None and meta["shapes"] != [s for _, s in shapes]:
        raise Error("%s: the state dict's parameters %s differ from this optimizer's %s" % (
            where, meta["shapes"], [s for _, s in shapes]))
    arrays, held = [], []
    for i, (name, p, key) in enumerate(members):
        entry = dict(state.get(key, {}))
        shape = list(p.shape)
        per = max(_per(shape), 1)
        for k in [k for k in entry if k.startswith(ROWS_PREFIX)]:
            t = entry.pop(k)
            field = k[len(ROWS_PREFIX):]
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] % per or \
                    (shape and t.shape[0] != shape[0]):
                raise Error("%s: '%s' %s is %s, not a tensor [%d, n * %d] of the parameter's "
                            "rows" % (where, name, k, list(t.shape) if isinstance(
                                t, torch.Tensor) else type(t).__name__,
                                      shape[0] if shape else 1, per))
            width = t.shape[1] // per
            if isinstance(t, DTensor):
                local = t.to_local()
            else:  # whole (a full state dict): this rank's rows, by the partition's own rule
                share = _stallfree.partition_share(shape, world, rank, layout)
                cols = share["cols"]
                local = t.reshape(-1, width)[share["first"] // cols:share["end"] // cols]
            is_int = not t.is_floating_point()  # the int64 arrays (step counts, flags)
            local = local.detach().to("cpu", torch.int64 if is_int else torch.float32)
            local = local.contiguous()
            held.append(local)
            arrays.append((i, field, width, is_int, local.data_ptr(),
                           local.numel() * local.element_size()))
        state[key] = entry
    try:
        e, d = _stallfree.join_rows(shapes, engine, daemon, arrays, world, rank, layout)
    except Error as err:
        raise Error("%s: joining this rank's rows of the state dict: %s" % (where, err)) from err
    meta = {k: v for k, v in meta.items() if k != "rows"}
    meta.update(version=2, partition=partition)
    return meta, (torch.frombuffer(e, dtype=torch.uint8) if e else torch.empty(0, dtype=torch.uint8),
                  torch.frombuffer(d, dtype=torch.uint8) if d else torch.empty(0, dtype=torch.uint8))

