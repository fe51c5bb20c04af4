#!/usr/bin/env python3
"""dp_bench: ZenFlowAdamW's state partitioned over L data-parallel ranks on one stallfreed.

    PYTHONPATH=bazel-bin/python .venv/bin/python bench/dp_bench.py [--width 1024] [--steps 24]

A benchmark, not a test: it prints what it measured. One private stallfreed (stallfree.Daemon,
1 worker thread) serves every run; each run starts L gloo ranks (this file with --worker) that
train the same model: three width x width Linear layers (3.15M parameters at 1024) wrapped in
DistributedDataParallel, each rank on its own 16-row share of a fixed batch, ZenFlowAdamW with the
defaults (zenflow, ratio 0.1, S = 4, bf16 transfers) but warmup_steps 0, so every step is a
ZenFlow step and the daemon runs steps / 4 Updates.

Runs: partitioned with L = 1, 2, 4 (the default: process_group the world), the replicated
baseline with L = 4 (process_group= a group of each rank alone: every rank a full replica in the
daemon, as before partitioning) and L = 4 with reduce_gradients=True instead of DDP.

Figures, each run's own:
- dp_host_bytes_per_param_L<L>: the daemon's pinned bytes (GetStats, every rank's sessions open,
  after step 1) over the model's parameters: a node's host footprint per parameter.
- dp_push_bytes_per_rank_L4_over_L1: bytes a rank pushes to the daemon per step (ZenFlowAdamW's
  last_timings bytes_to_host, mean over steps and ranks), L = 4 over L = 1.
- dp_daemon_update_seconds_L4_over_L1: the daemon's AdamW time over the run (GetStats
  update_seconds, after minus before), L = 4 over L = 1: the CPU work of a node.
- the same three for the replicated baseline, and the step time (median, rank 0) of each run.
- communication per rank per step, by the ring algorithms' volume (gloo's and NCCL's; torch
  exposes no byte counters): DDP's all-reduce 2 (L-1)/L x 4N bytes (computed), and what the
  partition's own collectives sent (ZenFlowAdamW's last_timings collective_bytes, counted from
  the buffers it hands torch: the all-gather of the updated rows, only the hot columns' between
  round boundaries, the column scores at selections, and with reduce_gradients the
  reduce-scatter instead of DDP).
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ranks  # noqa: E402  (also makes this checkout's stallfree importable)
figure = _ranks.figure

ROWS_PER_RANK = 16


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import stallfree
    from stallfree.torch import ZenFlowAdamW

    rank, world = _ranks.init(args.port, 120)
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(w, w, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(w, w, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(w, w, bias=False))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS_PER_RANK * 4, w, generator=gen)[rank * ROWS_PER_RANK:][:ROWS_PER_RANK]
    target = torch.randn(ROWS_PER_RANK * 4, w, generator=gen)[rank * ROWS_PER_RANK:][
        :ROWS_PER_RANK]
    own = [dist.new_group([r]) for r in range(world)][rank]
    net = model if args.run == "reduce" else DistributedDataParallel(model)
    client = stallfree._stallfree.Client(args.socket, 3000)
    dist.barrier()
    before = client.stats()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, socket=args.socket, warmup_steps=0,
                       session_name=args.run, process_group=own if args.run == "replicated"
                       else None, reduce_gradients=args.run == "reduce")
    pushed, sent, times, pinned = [], [], [], None
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = (net(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        pushed.append(opt.last_timings["bytes_to_host"])
        sent.append(opt.last_timings.get("collective_bytes", 0))
        if step == 1:
            dist.barrier()
            pinned = client.stats()["pinned_bytes"]
            dist.barrier()
    opt.close()
    dist.barrier()
    after = client.stats()
    params = sum(p.numel() for p in model.parameters())
    out = {"rank": rank, "pushed": statistics.mean(pushed), "sent": statistics.mean(sent),
           "step_s": statistics.median(times),
           "pinned": pinned, "update_s": after["update_seconds"] - before["update_seconds"],
           "params": params}
    _ranks.report(out, args.out)


def launch(run, world, args, socket):
    ranks = _ranks.launch(__file__, "dp_bench", world, args, run, socket)
    r0 = ranks[0]
    res = {"pinned_per_param": r0["pinned"] / r0["params"],
           "pushed_per_rank": statistics.mean(r["pushed"] for r in ranks),
           "update_s": r0["update_s"], "step_s": r0["step_s"], "params": r0["params"],
           "sent": statistics.mean(r["sent"] for r in ranks)}
    print("%-11s L=%d: %.2f host bytes/param, %.0f pushed bytes/rank/step, daemon AdamW %.3f s, "
          "step %.1f ms" % (run, world, res["pinned_per_param"], res["pushed_per_rank"],
                            res["update_s"], 1e3 * res["step_s"]), flush=True)
    return res


def main():
    args = _ranks.arguments(__doc__, 24)
    if args.worker:
        return worker(args)
    runs = _ranks.runs(lambda run, world, socket: launch(run, world, args, socket),
                       (("partitioned", 1), ("partitioned", 2), ("partitioned", 4),
                        ("replicated", 4), ("reduce", 4)))
    one = runs["partitioned", 1]
    for world in (1, 2, 4):
        figure("dp_host_bytes_per_param_L%d" % world, runs["partitioned", world][
            "pinned_per_param"], "bytes")
    figure("dp_host_bytes_per_param_L4_replicated", runs["replicated", 4]["pinned_per_param"],
           "bytes")
    for run in ("partitioned", "replicated"):
        suffix = "" if run == "partitioned" else "_replicated"
        figure("dp_push_bytes_per_rank_L4_over_L1" + suffix,
               runs[run, 4]["pushed_per_rank"] / one["pushed_per_rank"], "ratio")
        figure("dp_daemon_update_seconds_L4_over_L1" + suffix,
               runs[run, 4]["update_s"] / one["update_s"], "ratio")
        figure("dp_step_ms_L4" + suffix, 1e3 * runs[run, 4]["step_s"], "ms")
    figure("dp_step_ms_L4_reduce_gradients", 1e3 * runs["reduce", 4]["step_s"], "ms")
    ddp = 2 * 3 / 4 * 4 * one["params"]
    figure("dp_comm_bytes_per_rank_step_ddp_allreduce", ddp, "bytes")
    figure("dp_comm_bytes_per_rank_step_partition", runs["partitioned", 4]["sent"], "bytes")
    figure("dp_comm_bytes_per_rank_step_reduce_gradients", runs["reduce", 4]["sent"], "bytes")
    figure("dp_comm_partitioned_ddp_over_ddp", (ddp + runs["partitioned", 4]["sent"]) / ddp,
           "ratio")
    figure("dp_comm_reduce_gradients_over_ddp_allreduce", runs["reduce", 4]["sent"] / ddp,
           "ratio")

if __name__ == "__main__":
    main()
