"""Child process of test_state_dict.py: a fresh process builds TinyLM and ZenFlowAdamW (over its
own private stallfreed), loads the model's, the optimizer's and the scheduler's state dicts saved
by the parent after step N, trains steps N+1..STEPS and saves the losses and final parameters.

usage: resume_child.py CHECKPOINT CONFIG_JSON TOTAL_STEPS OUT STATE_DIR
"""
import json
import sys

import torch

import models
import stallfree
from stallfree.torch import ZenFlowAdamW


def main():
    ckpt_path, config_json, total_steps, out_path, state_dir = sys.argv[1:6]
    total_steps = int(total_steps)
    config = json.loads(config_json)
    ckpt = torch.load(ckpt_path)
    start = ckpt["step"] + 1
    with stallfree.Daemon(state_dir=state_dir, threads=1) as daemon:
        def factory(groups):
            return ZenFlowAdamW(groups, socket=daemon.socket, **config)

        def setup(model, opt, sched):
            model.load_state_dict(ckpt["model"])  # model weights first, as the spec says
            opt.load_state_dict(ckpt["opt"])
            sched.load_state_dict(ckpt["sched"])

        run = models.train(factory, total_steps, seed=ckpt["seed"], start=start, setup=setup)
    torch.save({"losses": run.losses, "params": run.params}, out_path)
    print("resumed at step", start, "losses", run.losses)


if __name__ == "__main__":
    main()
