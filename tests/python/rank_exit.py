"""The end of a test's rank process, once its results are written: the process group destroyed,
the output flushed, and the process gone without the interpreter's finalization.

torch 2.15's gloo ranks abort now and then in finalization, after all their work: "terminate
called without an active exception", and no Python frame on any thread (PYTHONFAULTHANDLER;
seen in make test and in CI, in DDP, FSDP2 and no-offload ranks alike, with and without a
daemon; pytorch/pytorch#190489 reports the same at a gloo process's exit). The tests judge the
ranks' work, which is saved before this, not the teardown of torch's threads; ZenFlowAdamW's own
teardown (close()) runs before it in every worker."""
import os
import sys

import torch.distributed as dist


def exit_rank(code=0):
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
