"""One rank of test_ddp.py: 2 processes over gloo, each with its own private stallfreed (two
"nodes"), ZenFlowAdamW zenflow with update_interval=1, await_updates, fp32 transfers, a
reselection every 2 steps. Rank r trains on rows [r*4, r*4+4) of the 8-row global batch.

mode `ddp`: the model is wrapped in DistributedDataParallel (gradients averaged).
mode `local`: no DDP: each rank steps on its own half-batch gradient (the ranks' parameters
diverge), but the hot-column selection still all-reduces the scores over the process group.
mode `own-group`: as `local`, with process_group= a group of this rank alone (each rank its own
data-parallel group, as under tensor parallelism): no score is reduced across the ranks.
Records, per step: the loss, the hot columns of every 2-D parameter as gathered from all ranks
(all_gather_object), last_timings, and (local mode) each 2-D gradient's per-column sum of
squares; then the final parameters. Saved with torch.save to OUT.

usage: RANK=r WORLD_SIZE=2 ddp_worker.py MODE PORT STEPS SEED OUT STATE_DIR
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import models
import stallfree
from stallfree.torch import ZenFlowAdamW

ZENFLOW = dict(mode="zenflow", topk_ratio=0.25, update_interval=1, select_interval=2,
               await_updates=True, grad_dtype="fp32", param_dtype="fp32",
               warmup_steps=0)  # reselections from step 3 on


def main():
    mode, port, steps, seed, out_path, state_dir = sys.argv[1:7]
    steps, seed = int(steps), int(seed)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    model = models.make_model(seed)
    net = DistributedDataParallel(model) if mode == "ddp" else model
    per_rank = models.BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    two_d = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    record = {"losses": [], "hot": [], "timings": [], "scores": []}
    # Every rank creates every group (torch.distributed's rule), then keeps its own.
    own = [dist.new_group([r]) for r in range(world)][rank] if mode == "own-group" else None
    with stallfree.Daemon(state_dir=state_dir, threads=1) as daemon:
        opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket, process_group=own,
                           **ZENFLOW)
        sched = models.make_scheduler(opt, steps)
        for step in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            loss = models.loss_fn(net, models.batch(seed, step)[rows])
            loss.backward()
            record["scores"].append({n: p.grad.pow(2).sum(0) for n, p in two_d})
            opt.step()
            sched.step()
            hot = {n: list(opt.hot_columns(p)) for n, p in two_d}
            gathered = [None] * world
            dist.all_gather_object(gathered, hot)
            record["losses"].append(loss.item())
            record["hot"].append(gathered)
            record["timings"].append(dict(opt.last_timings))
        opt.close()
    record["params"] = models.snapshot(model)
    record["daemon_socket"] = daemon.socket
    torch.save(record, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
