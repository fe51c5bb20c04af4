#!/usr/bin/env python3
"""state_dict_bench: how long ZenFlowAdamW's state_dict() and load_state_dict() take, the daemon's
part of the state moving out of and into its pinned memory through the session's staging area
(ExportState / ImportState: no file).

    .venv/bin/python bench/state_dict_bench.py [--layers 4] [--width 2048] [--repeats 3]

A benchmark, not a test: it prints what it measured. The model: `layers` Linear(width,
2 * width) layers in fp32 (33.6M parameters at the defaults), ZenFlowAdamW in zenflow with
topk_ratio 0.1 and rounds from the first step (warmup_steps 0), two steps taken so that the
daemon holds the cold columns' masters, moments and accumulator; one private stallfreed.

Figures (the median of `repeats`):
- state_dict_daemon_bytes: the daemon's part of the state dict.
- state_dict_seconds: state_dict() of the stepped optimizer.
- load_state_dict_seconds: load_state_dict() of that state dict into the same optimizer (its
  sessions closed and new ones restored, as a resume does).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _ranks  # noqa: E402  (makes this checkout's stallfree importable)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import torch
    import stallfree
    from stallfree.torch import ZenFlowAdamW
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, 2 * args.width, bias=False)
                                  if i % 2 == 0 else
                                  torch.nn.Linear(2 * args.width, args.width, bias=False)
                                  for i in range(args.layers)])
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(8, args.width)
    with tempfile.TemporaryDirectory() as state, \
            stallfree.Daemon(state_dir=state, threads=1) as daemon:
        opt = ZenFlowAdamW(model.parameters(), socket=daemon.socket, topk_ratio=0.1,
                           warmup_steps=0)
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        out, back, sd = [], [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            sd = opt.state_dict()
            out.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            opt.load_state_dict(sd)
            back.append(time.perf_counter() - t0)
        daemon_bytes = sum(e["zenflow_daemon"].numel() for e in sd["state"].values()
                           if "zenflow_daemon" in e)
        opt.close()
    print("%d parameters; state_dict %s s, load_state_dict %s s" % (
        params, ["%.3f" % t for t in out], ["%.3f" % t for t in back]), flush=True)
    _ranks.figure("state_dict_daemon_bytes", daemon_bytes, "bytes")
    _ranks.figure("state_dict_seconds", statistics.median(out), "s")
    _ranks.figure("load_state_dict_seconds", statistics.median(back), "s")


if __name__ == "__main__":
    main()
