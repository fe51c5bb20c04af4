"""Child process of test_daemon.py: ZenFlowAdamW with socket=None where no daemon answers
($STALLFREE_SOCKET points at nothing), so it starts a private stallfreed. Trains 6 steps and
prints the daemon's pid and sockets. `exit`: returns normally without close(); `hang`: then
sleeps until killed.

usage: daemon_child.py exit|hang
"""
import sys
import time

import models
from stallfree.torch import ZenFlowAdamW


def main():
    how = sys.argv[1]
    model = models.make_model(0)
    opt = ZenFlowAdamW(models.param_groups(model), mode="zenflow", topk_ratio=0.25,
                       update_interval=2, grad_dtype="fp32", param_dtype="fp32")
    d = opt.daemon
    assert d is not None, "ZenFlowAdamW(socket=None) with no daemon answering has no .daemon"
    with open(f"/proc/{d.pid}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode()
    print("DAEMON_PID", d.pid, flush=True)
    print("DAEMON_SOCKET", d.socket, flush=True)
    print("OPT_SOCKET", opt.socket, flush=True)
    print("DAEMON_CMDLINE", cmdline, flush=True)
    losses = models.plain_steps(model, opt, 6)
    print("LOSSES", " ".join(repr(x) for x in losses), flush=True)
    if how == "hang":
        print("READY", flush=True)
        time.sleep(600)
    # `exit`: no close(): the optimizer (and its daemon) must be stopped at interpreter exit.


if __name__ == "__main__":
    main()
