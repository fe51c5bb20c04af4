"""One rank of test_ddp.py: 2 processes over gloo, each with its own private stallfreed (two
"nodes"), ZenFlowAdamW zenflow with update_interval=1, await_updates, fp32 transfers, a
reselection every 2 steps. Rank r trains on rows [r*4, r*4+4) of the 8-row global batch.

mode `ddp`: the model is wrapped in DistributedDataParallel (gradients averaged).
mode `reduce`: no DDP: each rank has its own half-batch gradient, and ZenFlowAdamW
(reduce_gradients=True) averages them itself (a reduce-scatter of each rank's rows).
mode `own-group`: no DDP, with process_group= a group of this rank alone (each rank its own
data-parallel group, as under tensor parallelism): each rank trains alone on its half-batch, no
score crosses to the other rank (the ranks' parameters diverge).
Records, per step: the loss, the hot columns of every 2-D parameter as gathered from all ranks
(all_gather_object), last_timings, each 2-D gradient's per-column sum of squares (`scores`,
this rank's own gradient) and, in reduce mode, that of the ranks' mean gradient computed here
with a plain all_reduce (`mean_scores`); then the final parameters. Saved with torch.save.

usage: RANK=r WORLD_SIZE=2 ddp_worker.py PORT MODE STEPS SEED OUT_DIR (writes
OUT_DIR/MODE-rank<r>.pt, its daemon's state in OUT_DIR/MODE-state<r>)
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
from rank_exit import exit_rank

ZENFLOW = dict(mode="zenflow", topk_ratio=0.25, update_interval=1, select_interval=2,
               await_updates=True, grad_dtype="fp32", param_dtype="fp32",
               warmup_steps=0)  # reselections from step 3 on


def main():
    port, mode, steps, seed, out_dir = sys.argv[1:6]
    steps, seed = int(steps), int(seed)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out_path = os.path.join(out_dir, f"{mode}-rank{rank}.pt")
    state_dir = os.path.join(out_dir, f"{mode}-state{rank}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    model = models.make_model(seed)
    net = DistributedDataParallel(model) if mode == "ddp" else model
    per_rank = models.BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    two_d = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    record = {"losses": [], "hot": [], "timings": [], "scores": [], "mean_scores": []}
    # Every rank creates every group (torch.distributed's rule), then keeps its own.
    own = [dist.new_group([r]) for r in range(world)][rank] if mode == "own-group" else None
    with stallfree.Daemon(state_dir=state_dir, threads=1) as daemon:
        opt = ZenFlowAdamW(models.param_groups(model), socket=daemon.socket, process_group=own,
                           reduce_gradients=(mode == "reduce"), **ZENFLOW)
        sched = models.make_scheduler(opt, steps)
        for step in range(1, steps + 1):
            opt.zero_grad(set_to_none=True)
            loss = models.loss_fn(net, models.batch(seed, step)[rows])
            loss.backward()
            record["scores"].append({n: p.grad.pow(2).sum(0) for n, p in two_d})
            if mode == "reduce":
                means = {}
                for n, p in two_d:
                    g = p.grad.clone()
                    dist.all_reduce(g)
                    means[n] = (g / world).pow(2).sum(0)
                record["mean_scores"].append(means)
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


if __name__ == "__main__":
    main()
    exit_rank()
