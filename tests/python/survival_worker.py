"""One rank of test_survival.py's data-parallel run: 4 processes over gloo, the model wrapped in
DistributedDataParallel, ZenFlowAdamW partitioned over the 4 ranks (each rank's session holds a
quarter of the offloaded state) on ONE shared stallfreed at SOCKET, with reattach_timeout (the
test kills that daemon at random instants, from the first step's end on, when rank 0 writes
OUT_DIR/training, and starts another on SOCKET each time). Rank r trains
on rows [2r, 2r+2) of the 8-row global batch. Saves the losses and the final parameters to
OUT_DIR/rank<r>.pt.

usage: RANK=r WORLD_SIZE=4 survival_worker.py PORT SOCKET STEPS OUT_DIR
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import models
from stallfree.torch import ZenFlowAdamW
from rank_exit import exit_rank

# Rounds of two steps whose Updates each step waits for.
ZENFLOW = dict(mode="zenflow", topk_ratio=0.25, update_interval=2, select_interval=2,
               await_updates=True, warmup_steps=0, **models.FP32)


def main():
    port, socket, steps, out_dir = sys.argv[1:5]
    steps = int(steps)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    model = models.make_model(3)
    net = DistributedDataParallel(model)
    per_rank = models.BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    opt = ZenFlowAdamW(model.parameters(), socket=socket, reattach_timeout=60, **ZENFLOW)
    losses = []
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = models.loss_fn(net, models.batch(3, step)[rows])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 1 and rank == 0:  # the test's kills begin
            open(os.path.join(out_dir, "training"), "w").close()
    opt.close()
    torch.save({"losses": losses, "params": models.snapshot(model)},
               os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
    exit_rank()
