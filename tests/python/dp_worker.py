"""One rank of test_partition.py: ZenFlowAdamW partitioned over the data-parallel ranks.

L = WORLD_SIZE gloo ranks; rank r talks to the daemon SOCKETS[r * len(SOCKETS) // L] (one
socket: every rank on one daemon, a node; two: ranks 0..L/2-1 on the first, the rest on the
second, two "nodes"). Rank r trains TinyLM on rows [r B/L, (r+1) B/L) of the B-row global batch,
once per configuration of RUNS (a JSON {name: ZenFlowAdamW keyword arguments}), each with a fresh
model and optimizer; a configuration's "_width": W trains TinyLM(vocab=W, d=W, hidden=W) instead
(three W x W weights; "_llama": true trains models.LlamaLM (a tiny LlamaForCausalLM) instead;
"_steps": N stops that run after N steps; "_odd": true trains
TinyLM(odd=True), with a 3-D weight, a weight of fewer rows than ranks and a scalar; "_bf16":
true casts the model to torch.bfloat16;
"_drop": [parameter, rank, step, "none" | "zero"]: that rank's gradient of that parameter in
that step is taken away (None) or zeroed before opt.step(); parameter may be a list of names,
or "1-D": every 1-D parameter, a whole param group; "_perturb": [parameter, rank]: that rank
adds 1e-3 to that parameter before the optimizer is built; "_dcp": true saves and resumes the
optimizer through stallfree.dcp (OUT/<run>-dcp) instead of torch.save per rank; "_dsd": true
through torch's get_optimizer_state_dict(full_state_dict=True) after consolidate_state_dict(to=0),
rank 0 writing OUT/<run>-dsd.pt, and set_optimizer_state_dict on every rank, as accelerate's FSDP2
checkpoints do); "_dsd": "accelerate": through accelerate's own save_fsdp_optimizer and
load_fsdp_optimizer with its FSDP2 plugin (OUT/<run>-acc); "trainer": the same after
consolidate_state_dict(to=0), as a Hugging Face Trainer's callback does before it saves;
"accelerate-sharded": the plugin's SHARDED_STATE_DICT (DCP); "full": as true without
consolidating (torch all-gathers the rows of the distributed form); "sharded": torch's
get_optimizer_state_dict through dcp.save to OUT/<run>-sdcp, and dcp.load into
get_optimizer_state_dict's template, then set_optimizer_state_dict; "refused": records the
stallfree.Error that get_optimizer_state_dict raises, as "refused"). "_save_at": K saves, after
step K, every rank's optimizer state_dict() (OUT/<run>-opt-rank<r>.pt) and rank 0 the model's and
the scheduler's (OUT/<run>-model.pt); "_resume": {"dir", "run", "world", "step"} starts instead
from such a save of a run with `world` ranks: the model's weights, the optimizer from the list of
all its ranks' state dicts (torch.load with mmap=True, weights_only=True), the scheduler, and
trains steps step+1..STEPS. WRAP "ddp": the model in DistributedDataParallel (gradients averaged by
it); "reduce": no DDP, ZenFlowAdamW(reduce_gradients=True) averages them; "fsdp2": FSDP2's
fully_shard over a 1-D mesh of the L ranks (each holds its rows of every parameter); "hsdp":
fully_shard over a 2-D mesh, 2 replicas of L/2 shards. Under FSDP2 the records hold the whole
parameters (full_tensor()); "_mp": true shards with MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32). "_adamw": true trains with torch.optim.AdamW (models.adamw_factory; its lr
scaled by "_lr_scale") instead of ZenFlowAdamW, the reference on the same wrapped model.

Records per run: the losses, every 2-D weight's hot columns per step, the final parameters,
the per-step bytes pushed to the daemon (last_timings' bytes_to_host) and, read once every rank
has built and stepped its optimizer, the daemons' GetStats (pinned bytes, sessions). Saved with
torch.save to OUT/<run>-rank<r>.pt.

DIE_AT (environment, optional): "run:step:rank": that rank exits abruptly after that step of
that run; the others record the error they get (OUT/<run>-rank<r>.error) and exit 3.

usage: RANK=r WORLD_SIZE=L dp_worker.py PORT STEPS SEED OUT SOCKETS RUNS WRAP
"""
import datetime
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import models
import stallfree
import stallfree.dcp
from stallfree.torch import ZenFlowAdamW
from rank_exit import exit_rank


def whole(p):
    """The whole parameter (an FSDP2 DTensor gathered: a collective), else p."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def accelerate_fsdp2(rank, sharded=False):
    """accelerate's FSDP2 plugin with the Hugging Face Trainer's state dict type (FULL_STATE_DICT),
    or with `sharded` the plugin's own default (SHARDED_STATE_DICT: DCP), and what its
    checkpoint functions use of an Accelerator. (accelerate enables FSDP on GPUs only, so its
    Accelerator does not run FSDP2 here; its save_fsdp_optimizer and load_fsdp_optimizer do.)"""
    import types
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    PartialState(cpu=True)  # accelerate's logging needs it; it takes the gloo ranks as they are
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="SHARDED_STATE_DICT" if sharded else "FULL_STATE_DICT")
    return plugin, types.SimpleNamespace(process_index=rank, wait_for_everyone=dist.barrier)


def stats(sockets):
    return [stallfree._stallfree.Client(s, 3000).stats() for s in sockets]


def main():
    port, steps, seed, out, sockets, runs, wrap = sys.argv[1:8]
    steps, seed, sockets, runs = int(steps), int(seed), sockets.split(","), json.loads(runs)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    die = os.environ.get("DIE_AT", "").split(":") if os.environ.get("DIE_AT") else None
    torch.set_num_threads(1)
    cuda = models.DEVICE.type == "cuda"  # STALLFREE_TEST_DEVICE=cuda: NCCL, rank r on cuda:r
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    socket = sockets[rank * len(sockets) // world]
    rows = slice(rank * models.BATCH // world, (rank + 1) * models.BATCH // world)
    for name, config in runs.items():
        width = config.pop("_width", None)
        run_steps = config.pop("_steps", steps)
        save_at = config.pop("_save_at", None)
        odd = config.pop("_odd", False)
        bf16 = config.pop("_bf16", False)
        drop = config.pop("_drop", None)
        perturb = config.pop("_perturb", None)
        use_dcp = config.pop("_dcp", False)
        mixed = config.pop("_mp", False)
        use_dsd = config.pop("_dsd", False)
        reference = config.pop("_adamw", False)
        lr_scale = config.pop("_lr_scale", 1.0)
        resume = config.pop("_resume", None)
        llama = config.pop("_llama", False)
        if llama:
            model = models.LlamaLM(seed)
        else:
            model = models.make_model(seed, odd=odd, **(dict(vocab=width, d=width, hidden=width)
                                                        if width else {}))
        if bf16:
            model = model.to(torch.bfloat16)
        if perturb and perturb[1] == rank:
            with torch.no_grad():
                dict(model.named_parameters())[perturb[0]].add_(1e-3)
        net = DistributedDataParallel(model) if wrap == "ddp" else model
        shapes = {n: p.shape for n, p in model.named_parameters()}
        if wrap in ("fsdp2", "hsdp"):
            if odd:  # fully_shard takes no 0-D parameter: the scalar as one element, same sums
                model.scale = torch.nn.Parameter(model.scale.detach().reshape(1))
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            kind = models.DEVICE.type
            mesh = (init_device_mesh(kind, (world,)) if wrap == "fsdp2" else
                    init_device_mesh(kind, (2, world // 2),
                                     mesh_dim_names=("replicate", "shard")))
            if llama:  # each decoder layer a unit of its own, as with Hugging Face's wrap
                for layer in model.layers:
                    fully_shard(layer, mesh=mesh)
            if mixed:
                from torch.distributed.fsdp import MixedPrecisionPolicy
                fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
            else:
                fully_shard(model, mesh=mesh)
        two_d = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
        record = {"losses": [], "hot": [], "pushed": [], "agree": []}
        if reference:
            opt = models.adamw_factory(lr_scale)(models.param_groups(model))
        else:
            opt = ZenFlowAdamW(models.param_groups(model), socket=socket, session_name=name,
                               reduce_gradients=(wrap == "reduce"), timeout=30, **config)
        sched = models.make_scheduler(opt, steps)
        start = 1
        if resume:
            saved = torch.load(os.path.join(resume["dir"], f"{resume['run']}-model.pt"),
                               weights_only=True)
            if wrap in ("fsdp2", "hsdp"):  # the whole weights, into this rank's shards
                from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                     set_model_state_dict)
                set_model_state_dict(model, saved["model"],
                                     options=StateDictOptions(full_state_dict=True))
            else:
                model.load_state_dict(saved["model"])
            sched.load_state_dict(saved["sched"])
            if use_dsd in ("accelerate", "trainer", "accelerate-sharded"):  # accelerate's own
                from accelerate.utils.fsdp_utils import load_fsdp_optimizer
                plugin, acc = accelerate_fsdp2(rank, use_dsd == "accelerate-sharded")
                load_fsdp_optimizer(plugin, acc, opt, model,
                                    os.path.join(resume["dir"], f"{resume['run']}-acc"))
            elif use_dsd == "sharded":  # torch's distributed state dict through DCP
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                                     set_optimizer_state_dict)
                osd = {"optim": get_optimizer_state_dict(model, opt)}
                dcp.load(osd, checkpoint_id=os.path.join(resume["dir"],
                                                         f"{resume['run']}-sdcp"))
                set_optimizer_state_dict(model, opt, osd["optim"])
            elif use_dsd:  # torch's full optimizer state dict, every rank the same file
                from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                     set_optimizer_state_dict)
                osd = torch.load(os.path.join(resume["dir"], f"{resume['run']}-dsd.pt"),
                                 weights_only=True)
                set_optimizer_state_dict(model, opt, osd,
                                         options=StateDictOptions(full_state_dict=True))
            elif use_dcp:
                stallfree.dcp.load(opt, os.path.join(resume["dir"], f"{resume['run']}-dcp"))
            else:
                opt.load_state_dict([
                    torch.load(os.path.join(resume["dir"], f"{resume['run']}-opt-rank{j}.pt"),
                               mmap=True, weights_only=True) for j in range(resume["world"])])
            start = resume["step"] + 1
        try:
            for step in range(start, run_steps + 1):
                opt.zero_grad(set_to_none=True)
                loss = models.loss_fn(net, models.batch(seed, step)[rows])
                loss.backward()
                if drop and drop[1] == rank and drop[2] == step:
                    named = dict(model.named_parameters())
                    names = ([n for n, p in named.items() if p.dim() == 1] if drop[0] == "1-D"
                             else drop[0] if isinstance(drop[0], list) else [drop[0]])
                    for n in names:
                        p = named[n]
                        p.grad = None if drop[3] == "none" else torch.zeros_like(p.grad)
                opt.step()
                sched.step()
                record["losses"].append(loss.item())
                record["pushed"].append(0 if reference else
                                        opt.last_timings.get("bytes_to_host", 0))
                # Every rank holds the same parameters after every step (the all-gather, the
                # hot columns' alone between round boundaries), not only after close().
                digest = hashlib.sha1(b"".join(
                    whole(p).detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                    for p in model.parameters())).hexdigest()
                digests = [None] * world
                dist.all_gather_object(digests, digest)
                record["agree"].append(len(set(digests)) == 1)
                if config.get("mode") != "no-offload" and not reference:
                    record["hot"].append({n: opt.hot_columns(p) for n, p in two_d})
                if step == 1:
                    dist.barrier()
                    record["stats"] = stats(sorted(set(sockets)))
                    dist.barrier()
                if step == save_at:
                    if use_dsd in ("accelerate", "trainer", "accelerate-sharded"):
                        from accelerate.utils.fsdp_utils import save_fsdp_optimizer
                        if use_dsd == "trainer":  # the Trainer's callback consolidates first
                            opt.consolidate_state_dict(to=0)
                        plugin, acc = accelerate_fsdp2(rank, use_dsd == "accelerate-sharded")
                        save_fsdp_optimizer(plugin, acc, opt, model,
                                            os.path.join(out, f"{name}-acc"))
                    elif use_dsd == "refused":  # (under HSDP) the error it must get
                        from torch.distributed.checkpoint.state_dict import (
                            get_optimizer_state_dict)
                        try:
                            get_optimizer_state_dict(model, opt)
                        except stallfree.Error as e:
                            record["refused"] = str(e)
                    elif use_dsd == "sharded":  # torch's distributed state dict, by DCP
                        import torch.distributed.checkpoint as dcp
                        from torch.distributed.checkpoint.state_dict import (
                            get_optimizer_state_dict)
                        dcp.save({"optim": get_optimizer_state_dict(model, opt)},
                                 checkpoint_id=os.path.join(out, f"{name}-sdcp"))
                    elif use_dsd:  # as accelerate's FSDP2 FULL_STATE_DICT saving does
                        from torch.distributed.checkpoint.state_dict import (
                            StateDictOptions, get_optimizer_state_dict)
                        if use_dsd is True:  # "full": torch all-gathers the rows itself
                            opt.consolidate_state_dict(to=0)
                        osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(
                            full_state_dict=True, cpu_offload=True))
                        if rank == 0:
                            torch.save(osd, os.path.join(out, f"{name}-dsd.pt"))
                    elif use_dcp:
                        stallfree.dcp.save(opt, os.path.join(out, f"{name}-dcp"))
                    else:
                        torch.save(opt.state_dict(),
                                   os.path.join(out, f"{name}-opt-rank{rank}.pt"))
                    weights = model.state_dict()
                    if wrap in ("fsdp2", "hsdp"):  # gathered whole (a collective)
                        from torch.distributed.checkpoint.state_dict import (
                            StateDictOptions, get_model_state_dict)
                        weights = get_model_state_dict(model, options=StateDictOptions(
                            full_state_dict=True, cpu_offload=True))
                    if rank == 0:
                        torch.save({"model": weights, "sched": sched.state_dict()},
                                   os.path.join(out, f"{name}-model.pt"))
                if die and die[0] == name and int(die[1]) == step and int(die[2]) == rank:
                    os._exit(9)
        except stallfree.Error as e:
            with open(os.path.join(out, f"{name}-rank{rank}.error"), "w") as f:
                f.write(str(e))
            # Rank 0 serves the store here (torchrun's agent would): stay a moment, so that the
            # other ranks still read in it that this rank saw the failure and is not its cause.
            time.sleep(3)
            os._exit(3)
        if not reference:
            opt.close()
        record["params"] = {n: whole(p).detach().cpu().clone().reshape(shapes[n])
                            for n, p in model.named_parameters()}
        torch.save(record, os.path.join(out, f"{name}-rank{rank}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_rank()
