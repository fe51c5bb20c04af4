"""ZenFlowAdamW's state-dict format: the keys and versions of the engine entries, a group's
entry read out of a state dict, and a consolidated state dict (every rank's shares, version 3)
taken apart into the ranks' state dicts."""
import json

import torch

from ._stallfree import Error

# 2: the engine and daemon state as uint8 tensors in the first parameter's entry of each group's
# "state" (torch's own layout, which torch.load(weights_only=True) and
# torch.distributed.checkpoint keep; partitioned over ranks, each rank's entries differ, which
# torch.distributed.checkpoint, taking them for replicated, would not keep: stallfree.dcp
# writes each rank's under keys of its own); 1: bytes under a top-level "stallfree" key (still
# read); 3, in a consolidated state dict only (ZenFlowAdamW.consolidate_state_dict): every
# rank's, one after the other, taken apart again on load (_ranks_of_consolidated).
_STATE_VERSION = 2


# The keys of a group's first parameter's state entry that carry the group's engine.
_ENGINE_KEY, _DAEMON_KEY, _META_KEY = "zenflow_engine", "zenflow_daemon", "zenflow_meta"
_BLOB_KEYS = (_ENGINE_KEY, _DAEMON_KEY, _META_KEY)


def _param_index(param_groups):
    """{id(parameter): its position in a state dict's "state"} (torch numbers the parameters of
    every group in order)."""
    index, start = {}, 0
    for group in param_groups:
        for i, p in enumerate(group["params"]):
            index[id(p)] = start + i
        start += len(group["params"])
    return index


def _group_blobs(sd, gi):
    """(state key, meta dict, engine tensor, daemon tensor) of group gi's engine entry in a
    state dict of this stallfree, or (None,) * 4 for a group without one."""
    for key in sd["param_groups"][gi]["params"]:
        entry = sd["state"].get(key, {})
        if _META_KEY in entry:
            raw = bytes(_uint8(entry[_META_KEY]).tolist())
            try:
                meta = json.loads(raw.decode()) if raw else {}  # {}: a placeholder
            except ValueError:
                meta = {}  # not ours to judge here: load_state_dict's checks name it
            return key, meta, entry[_ENGINE_KEY], entry[_DAEMON_KEY]
    return None, None, None, None


def _shares(partition):
    """{"world", "rank"} of the ranks whose shares of the state differ (a partition as
    _Shards.describe() gives it): the data-parallel group's, or on a 1-D FSDP2 mesh its shard
    group's."""
    return partition["fsdp2"] if "fsdp2" in partition else partition


def _share_of(partition, j):
    """The partition of share j of the ranks _shares(partition) counts."""
    if "fsdp2" in partition:
        return dict(partition, fsdp2={"world": partition["fsdp2"]["world"], "rank": j})
    return {"world": partition["world"], "rank": j}


def _ranks_of_consolidated(dicts):
    """A consolidated state dict (consolidate_state_dict: version 3) as the list of the state
    dicts of its L ranks, each group's engine and daemon states views into the consolidated
    ones; anything else as it is."""
    if len(dicts) != 1 or not isinstance(dicts[0], dict) or \
            not isinstance(dicts[0].get("param_groups"), list) or \
            not isinstance(dicts[0].get("state"), dict):
        return dicts
    whole = dicts[0]
    found = [_group_blobs(whole, gi) for gi in range(len(whole["param_groups"]))]
    metas = [f[1] for f in found if f[1] is not None]
    if not any("consolidated" in m for m in metas):
        return dicts
    try:
        partition = next(m for m in metas if "consolidated" in m)["partition"]
        world = int(_shares(partition)["world"])
    except (KeyError, TypeError, ValueError):
        raise Error("a consolidated state dict without its number of ranks: it is damaged")
    if not 1 <= world <= 1 << 16:
        raise Error("a consolidated state dict of %d ranks: it is damaged" % world)
    ranks = [dict(whole, state=dict(whole["state"])) for _ in range(world)]
    for key, meta, engine, daemon in found:
        if key is None:
            continue
        sizes = meta.get("consolidated", {})
        lens_e, lens_d = sizes.get("engine", []), sizes.get("daemon", [])
        engine, daemon = _uint8(engine), _uint8(daemon)
        if not isinstance(lens_e, list) or not isinstance(lens_d, list) or \
                not all(isinstance(x, int) and x >= 0 for x in lens_e + lens_d) or \
                len(lens_e) != world or len(lens_d) != world or \
                sum(lens_e) != engine.numel() or sum(lens_d) != daemon.numel():
            raise Error("a consolidated state dict whose sizes %s do not match its %d and %d "
                        "bytes of engine and daemon state: it is damaged" % (
                            sizes, engine.numel(), daemon.numel()))
        at_e = at_d = 0
        for j in range(world):
            own = {k: v for k, v in meta.items() if k != "consolidated"}
            own.update(version=_STATE_VERSION, partition=_share_of(partition, j))
            ranks[j]["state"][key] = dict(whole["state"][key], **{
                _ENGINE_KEY: engine[at_e:at_e + lens_e[j]],
                _DAEMON_KEY: daemon[at_d:at_d + lens_d[j]],
                _META_KEY: _bytes_tensor(bytearray(json.dumps(own, sort_keys=True).encode()))})
            at_e += lens_e[j]
            at_d += lens_d[j]
    return ranks


def _bytes_tensor(data):
    """Opaque bytes (a bytearray of the binding: shared, not copied) as a uint8 tensor, what
    torch.load(weights_only=True) accepts (the default since torch 2.6, and how Hugging Face's
    Trainer loads an optimizer at resume)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)


def _uint8(t):
    """A state dict's engine entry as a contiguous CPU uint8 tensor (bytes, as stallfree 0.1.0's
    state dicts hold them, become one)."""
    if isinstance(t, (bytes, bytearray)):
        return _bytes_tensor(bytearray(t))
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise Error("the state dict's engine state is %r, not a 1-D uint8 tensor written by "
                    "ZenFlowAdamW.state_dict()" % (type(t).__name__,))
    return t.detach().cpu().contiguous()

