"""torch.distributed.checkpoint (DCP) for ZenFlowAdamW's partitioned state.

DCP writes one copy of a tensor that is not a DTensor, taking it for the same on every rank, so
`dcp.save({"optim": opt.state_dict()})` of an optimizer partitioned over L ranks keeps rank 0's
share alone. These write each rank's share under keys of its own, through DCP's storage layer
(each rank writes its own files), and load them on any number of ranks, each rank reading only
the shares whose rows overlap its own (engine/repartition.h):

    import stallfree.dcp
    stallfree.dcp.save(opt, checkpoint_id="ckpt/optim")   # every rank of process_group
    ...
    stallfree.dcp.load(opt, checkpoint_id="ckpt/optim")   # every rank, any number of them

The model's weights go through DCP as usual (`dcp.save({"model": model.state_dict()}, ...)`),
loaded before the optimizer's state. Keys: "zenflow/rest" (param_groups and the step counts,
torch.save bytes, the same on every rank) and "zenflow/g<group>/r<rank>of<L>/<engine | daemon |
meta>" (that rank's uint8 states of that group's engine and daemon session). Over FSDP2
parameters the owner is "r<rank>of<L>s<shard rank>of<S>" (its place in the replicate group, L = 1
without HSDP, and in the shard group): a 1-D mesh's state loads on any 1-D mesh (each rank
reading the shares fully_shard's chunks of its rows overlap), an HSDP state on its own mesh.
"""
import io
import re

import torch
import torch.distributed.checkpoint as dcp

from . import _state
from . import _stallfree
from ._stallfree import Error

_KEY = re.compile(r"^zenflow/g(\d+)/(r(\d+)of(\d+)(?:s(\d+)of(\d+))?)/(engine|daemon|meta)$")


def _owner(where):
    """The key part of a rank's share: its place in the partition (optimizer.partition)."""
    out = "r%dof%d" % (where["rank"], where["world"])
    if "fsdp2" in where:
        out += "s%dof%d" % (where["fsdp2"]["rank"], where["fsdp2"]["world"])
    return out


def _writers(optimizer, where):
    """The process group every writing rank belongs to: FSDP2's mesh is the default group's
    (each of its ranks holds other rows); else the partition's."""
    if "fsdp2" in where or where["world"] == 1:
        return None
    return optimizer._group


def save(optimizer, checkpoint_id=None, *, storage_writer=None):
    """Writes every rank's share of `optimizer`'s state (a ZenFlowAdamW) with dcp.save: a
    collective of its process_group (every rank calls it)."""
    sd = optimizer._share_state_dict()
    where = optimizer.partition
    flat, keys = {}, {}
    for gi in range(len(sd["param_groups"])):
        key, _, engine, daemon = _state._group_blobs(sd, gi)
        if key is None:
            continue
        keys[gi] = key
        entry = sd["state"][key]
        base = "zenflow/g%d/%s/" % (gi, _owner(where))
        flat[base + "engine"] = _state._uint8(engine)
        flat[base + "daemon"] = _state._uint8(daemon)
        flat[base + "meta"] = _state._uint8(entry[_state._META_KEY])
    state = {k: {n: v for n, v in e.items() if n not in _state._BLOB_KEYS}
             for k, e in sd["state"].items()}
    buf = io.BytesIO()
    torch.save({"param_groups": sd["param_groups"], "state": state, "keys": keys}, buf)
    flat["zenflow/rest"] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    dcp.save(flat, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
             process_group=_writers(optimizer, where))


def load(optimizer, checkpoint_id=None, *, storage_reader=None):
    """Loads what save() wrote, by any number of ranks (every rank of `optimizer`'s
    process_group calls it), into `optimizer` (its load_state_dict, all or nothing)."""
    reader = storage_reader or dcp.FileSystemReader(checkpoint_id)
    md = reader.read_metadata().state_dict_metadata
    if "zenflow/rest" not in md:
        raise Error("%s: no ZenFlowAdamW state written by stallfree.dcp.save" % (
            checkpoint_id or "the checkpoint"))
    where = optimizer.partition
    template = {"zenflow/rest": torch.empty(md["zenflow/rest"].size, dtype=torch.uint8)}
    owners = {m.group(2) for m in map(_KEY.match, md) if m}
    fsdp2 = "fsdp2" in where or any("s" in o for o in owners)
    if fsdp2 and ("fsdp2" not in where or where["world"] > 1 or
                  any(not o.startswith("r0of1s") for o in owners)):
        return _load_own(optimizer, checkpoint_id, storage_reader, md, owners, where, template)
    # The ranks of the partition: the data-parallel group's, or on a 1-D FSDP2 mesh its shard
    # group's (cut by fully_shard's chunks).
    me, layout = (where["fsdp2"], "fsdp2") if fsdp2 else (where, "even")

    def owner(j, world):
        return ("r0of1s%dof%d" if fsdp2 else "r%dof%d") % (j, world)

    found = {}
    for m in map(_KEY.match, md):
        if m:
            gi = int(m.group(1))
            j, world = (int(m.group(5)), int(m.group(6))) if fsdp2 else \
                (int(m.group(3)), int(m.group(4)))
            found.setdefault(gi, {"world": world, "ranks": set()})["ranks"].add(j)
    for gi, f in found.items():
        world = f["world"]
        if f["ranks"] != set(range(world)):
            raise Error("%s: param group %d's state is there for ranks %s of %d: the "
                        "checkpoint is incomplete" % (checkpoint_id, gi, sorted(f["ranks"]), world))
        members = optimizer._members[gi] if gi < len(optimizer._members) else []
        shapes = [(n, list(p.shape)) for n, p in members]
        sources = set(range(world)) if len(shapes) == 0 else set(
            _stallfree.repartition_sources(shapes, world, me["world"], me["rank"], layout))
        for j in range(world):
            base = "zenflow/g%d/%s/" % (gi, owner(j, world))
            wanted = ("engine", "daemon", "meta") if j in sources else ("meta",)
            for part in wanted:
                template[base + part] = torch.empty(md[base + part].size, dtype=torch.uint8)
    rest = _read(optimizer, checkpoint_id, storage_reader, where, template)
    worlds = {f["world"] for f in found.values()}
    if len(worlds) > 1:
        raise Error("%s: param groups saved by different numbers of ranks %s" % (
            checkpoint_id, sorted(worlds)))
    world = worlds.pop() if worlds else 1
    optimizer.load_state_dict([_share_dict(rest, template, owner(j, world))
                               for j in range(world)])


def _read(optimizer, checkpoint_id, storage_reader, where, template):
    """dcp.load of `template` (the keys this rank reads, sized); the torch-saved rest."""
    dcp.load(template, checkpoint_id=checkpoint_id,
             storage_reader=storage_reader or dcp.FileSystemReader(checkpoint_id),
             process_group=_writers(optimizer, where))
    return torch.load(io.BytesIO(template["zenflow/rest"].numpy().tobytes()), weights_only=True)


def _share_dict(rest, template, owner):
    """The state dict of the share saved under `owner` (its engine and daemon states empty where
    this rank did not read them: it needs only their meta)."""
    empty = torch.empty(0, dtype=torch.uint8)
    state = {k: dict(v) for k, v in rest["state"].items()}
    for gi, key in rest["keys"].items():
        base = "zenflow/g%d/%s/" % (gi, owner)
        state[key].update({_state._ENGINE_KEY: template.get(base + "engine", empty),
                           _state._DAEMON_KEY: template.get(base + "daemon", empty),
                           _state._META_KEY: template[base + "meta"]})
    return {"param_groups": rest["param_groups"], "state": state}


def _load_own(optimizer, checkpoint_id, storage_reader, md, owners, where, template):
    """HSDP: this rank loads the share saved by the rank of its own place in the same mesh."""
    mine = _owner(where)
    if mine not in owners:
        raise Error("%s: saved by the ranks %s; this rank is %s (rank r of L in the replicate "
                    "group, s of S in FSDP2's shard group). A state saved under HSDP, or loaded "
                    "under it, loads on the mesh that saved it (a 1-D FSDP2 mesh's loads on "
                    "another 1-D mesh)" % (checkpoint_id or "the checkpoint", sorted(owners), mine))
    groups = {int(m.group(1)) for m in map(_KEY.match, md) if m}
    for gi in groups:
        for part in ("engine", "daemon", "meta"):
            key = "zenflow/g%d/%s/%s" % (gi, mine, part)
            template[key] = torch.empty(md[key].size, dtype=torch.uint8)
    rest = _read(optimizer, checkpoint_id, storage_reader, where, template)
    optimizer.load_state_dict(_share_dict(rest, template, mine))
