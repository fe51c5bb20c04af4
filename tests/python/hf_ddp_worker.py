"""One rank of test_hf_torchrun.py, started by `python -m torch.distributed.run
--nproc_per_node 2 hf_ddp_worker.py SOCKET OUT_DIR STEPS RUNS_JSON`: for each run of RUNS_JSON
({name: [optimizer, config] or [optimizer, config, more hf_models.train arguments]}) a Trainer
run (with {"accelerate": true, ...} among those arguments, accelerate's own loop instead:
hf_models.accelerate_train, Accelerator(cpu=True) on the gloo ranks torchrun made; with
{"fsdp2": true, ...}, the Trainer's FSDP2, fsdp_on_cpu) (hf_models.train) of the tiny Llama with
per_device_train_batch_size BATCH / WORLD and ddp_backend="gloo" (the Trainer wraps the model in
DistributedDataParallel itself), every ZenFlowAdamW of both ranks on the one stallfreed at
SOCKET (TrainingArguments, made first, initialise torch.distributed, so each optimizer opens its
sessions as its own rank). Saves rank r's results to OUT_DIR/<name>-rank<r>.pt.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import hf_models
from rank_exit import exit_rank


def fsdp_on_cpu():
    """accelerate takes its FSDP plugin for GPU distributed types only (AcceleratorState in
    accelerate/state.py), so on these CPU ranks a Trainer with fsdp would run DDP: the ranks'
    PartialState says MULTI_GPU instead of MULTI_CPU, its device staying the CPU, and the
    Trainer's Accelerator then runs FSDP2 (fully_shard on the gloo ranks) as on GPUs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    init = PartialState.__init__
    if getattr(init, "fsdp_on_cpu", False):
        return

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.MULTI_GPU
    patched.fsdp_on_cpu = True
    PartialState.__init__ = patched


def main():
    socket, out_dir = sys.argv[1], sys.argv[2]
    steps, runs = int(sys.argv[3]), json.loads(sys.argv[4])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    for name, (optimizer, config, *more) in runs.items():
        if config is not None:
            config = dict(config, socket=socket)
        more = dict(more[0]) if more else {}
        if more.pop("fsdp2", False):  # the Trainer's FSDP2 (fsdp_config's fsdp_version 2)
            fsdp_on_cpu()
            more.update(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
        if more.pop("accelerate", False):  # accelerate's own loop (hf_models.accelerate_train)
            result = hf_models.accelerate_train("llama", optimizer, config, max_steps=steps,
                                                **more)
            result["world"] = world
            torch.save(result, os.path.join(out_dir, f"{name}-rank{rank}.pt"))
            continue
        result = hf_models.train("llama", optimizer, config, max_steps=steps,
                                 out_dir=os.path.join(out_dir, name),
                                 per_device_batch=hf_models.BATCH // world, ddp_backend="gloo",
                                 ddp_find_unused_parameters=False, **more)
        assert dist.is_initialized() and dist.get_world_size() == world
        result["world"] = world
        torch.save(result, os.path.join(out_dir, f"{name}-rank{rank}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_rank()
