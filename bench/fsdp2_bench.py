#!/usr/bin/env python3
"""fsdp2_bench: ZenFlowAdamW on FSDP2 (fully_shard) parameters, L = 1, 2, 4 gloo ranks on one
stallfreed, against FSDP2 with torch.optim.AdamW and FSDP2's own CPUOffloadPolicy.

    PYTHONPATH=bazel-bin/python .venv/bin/python bench/fsdp2_bench.py [--width 1024] [--steps 16]

A benchmark, not a test: it prints what it measured. The model: four width x width Linear
layers in bf16 (4.2M parameters at 1024), each its own fully_shard unit and the root another,
on a 1-D mesh of the L ranks, each rank a 16-row batch of its own. ZenFlowAdamW runs its defaults
(zenflow, topk_ratio 0.1, bf16 transfers) with warmup_steps 0 and rounds of 4, so every step is
a ZenFlow step. One private stallfreed (1 worker thread) serves every run.

Figures:
- fsdp2_device_bytes_per_model_param_L<L>: what a rank holds of the model and its optimizer in
  the memory it trains in, over the model's parameter count: its shard of the parameters and of
  their gradients (FSDP2's sharded DTensors, bf16) and every allocation the engine accounts for
  (opt.device_bytes["engine"]: fp32 masters, moments and transfer buffers of its rows' hot
  columns and of the parameters it keeps whole), after a step. The issue's target: <= 5.3 / L +
  0.2. On this CPU the engine runs its CPU backend, whose direct transfers need no buffers; with
  CUDA's default buffered transfers the engine adds the cold columns' bf16 gradient and value
  buffers (4 bytes an element, measured in bench/device_bytes_bench.py): the line after the
  figures prints that estimate too.
- fsdp2_host_bytes_per_model_param_L4: the daemon's pinned bytes (GetStats after step 1, every
  rank's sessions open) over the model's parameters: the node's copy of the offloaded state.
- fsdp2_step_ms_<run>_L4 and the ratios fsdp2_zenflow_over_adamw_step_L4 and
  fsdp2_zenflow_over_cpu_offload_step_L4 (median step, rank 0, in the same run): ZenFlowAdamW
  against FSDP2 with torch.optim.AdamW on the ranks (all state in the trainer) and against FSDP2's
  CPUOffloadPolicy (parameters, gradients and AdamW state in host memory, AdamW on the CPU: the
  peer an FSDP2 user would pick). What the CPU can show: the host side (the daemon's update and the
  trainer's waits) and the bytes; not the GPU's step time, where CPUOffloadPolicy copies every
  parameter and gradient over PCIe each step and runs AdamW on the CPU in the step's critical
  path, and ZenFlowAdamW moves only the cold columns' gradients and overlaps the update.
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ranks  # noqa: E402  (also makes this checkout's stallfree importable)
figure = _ranks.figure

ROWS_PER_RANK = 16
LAYERS = 4


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import stallfree
    from stallfree.torch import ZenFlowAdamW

    rank, world = _ranks.init(args.port, 300)
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(*[torch.nn.Linear(w, w, bias=False) for _ in range(LAYERS)])
    model = model.to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,))
    # pin_memory=False: pinning needs a CUDA driver, which this CPU run need not have.
    extra = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} \
        if args.run == "cpu_offload" else {}
    for layer in model:
        fully_shard(layer, mesh=mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(ROWS_PER_RANK, w, generator=gen).to(torch.bfloat16)
    target = torch.randn(ROWS_PER_RANK, w, generator=gen).to(torch.bfloat16)
    client = stallfree._stallfree.Client(args.socket, 3000)
    if args.run == "zenflow":
        opt = ZenFlowAdamW(model.parameters(), lr=1e-3, socket=args.socket, warmup_steps=0,
                           update_interval=4, session_name="fsdp2")
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, pinned, device = [], None, None
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = (model(x).float() - target.float()).pow(2).mean()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if step == 1:
            local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
            grads = sum(p.grad.to_local().numel() * p.grad.element_size()
                        for p in model.parameters() if p.grad is not None)
            engine = opt.device_bytes["engine"] if args.run == "zenflow" else 0
            cold = 0
            if args.run == "zenflow":  # the cold columns' elements this rank offloads
                cold = sum(p.to_local().numel() - len(opt.hot_columns(p)) * p.to_local().shape[0]
                           for p in model.parameters())
            device = {"params": local, "grads": grads, "engine": engine, "cold": cold}
            dist.barrier()
            pinned = client.stats()["pinned_bytes"]
            dist.barrier()
    if args.run == "zenflow":
        opt.close()
    out = {"rank": rank, "step_s": statistics.median(times[1:]), "pinned": pinned,
           "device": device, "params": params}
    _ranks.report(out, args.out)


def launch(run, world, args, socket):
    ranks = _ranks.launch(__file__, "fsdp2_bench", world, args, run, socket)
    r0 = ranks[0]
    dev = max(sum(r["device"][k] for k in ("params", "grads", "engine")) for r in ranks)
    cold = max(r["device"]["cold"] for r in ranks)
    res = {"device_per_param": dev / r0["params"], "cold_per_param": cold / r0["params"],
           "pinned_per_param": r0["pinned"] / r0["params"], "step_s": r0["step_s"]}
    print("%-11s L=%d: %.3f device bytes/param on the fullest rank (%s on rank 0), %.2f host "
          "bytes/param, step %.1f ms" % (run, world, res["device_per_param"], r0["device"],
                                         res["pinned_per_param"], 1e3 * res["step_s"]),
          flush=True)
    return res


def main():
    args = _ranks.arguments(__doc__, 16)
    if args.worker:
        return worker(args)
    runs = _ranks.runs(lambda run, world, socket: launch(run, world, args, socket),
                       (("zenflow", 1), ("zenflow", 2), ("zenflow", 4), ("adamw", 4),
                        ("cpu_offload", 4)))
    for world in (1, 2, 4):
        r = runs["zenflow", world]
        figure("fsdp2_device_bytes_per_model_param_L%d" % world, r["device_per_param"], "bytes")
        print("  target <= %.3f; with CUDA's buffered bf16 transfers about %.3f" % (
            5.3 / world + 0.2, r["device_per_param"] + 4 * r["cold_per_param"]), flush=True)
    figure("fsdp2_host_bytes_per_model_param_L4", runs["zenflow", 4]["pinned_per_param"], "bytes")
    for run in ("zenflow", "adamw", "cpu_offload"):
        figure("fsdp2_step_ms_%s_L4" % run, 1e3 * runs[run, 4]["step_s"], "ms")
    figure("fsdp2_zenflow_over_adamw_step_L4",
           runs["zenflow", 4]["step_s"] / runs["adamw", 4]["step_s"], "ratio")
    figure("fsdp2_zenflow_over_cpu_offload_step_L4",
           runs["zenflow", 4]["step_s"] / runs["cpu_offload", 4]["step_s"], "ratio")


if __name__ == "__main__":
    main()
