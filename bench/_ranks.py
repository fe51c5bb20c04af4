"""The gloo ranks of a multi-process benchmark (dp_bench.py, fsdp2_bench.py): `world` copies of
the benchmark's own script started with --worker, the torch.distributed environment (RANK,
WORLD_SIZE; --port: a free loopback port), the stallfree package this process imports on their
PYTHONPATH, and --out: the JSON file rank 0 writes, returned parsed."""
import argparse
import datetime
import json
import os
import socket as so
import subprocess
import sys
import tempfile

try:  # PYTHONPATH's stallfree, else the Bazel-built package of this checkout
    import stallfree  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "bazel-bin", "python"))


def init(port, timeout_s):
    """In a worker: torch.distributed over gloo on the launcher's port, one torch thread;
    returns (rank, world)."""
    import torch
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world


def launch(script, name, world, args, run, socket):
    """Runs `world` ranks of `script` --worker for `run` (args: the command line's --width and
    --steps; socket: the daemon's); exits naming `name` and the run if one fails; returns every
    rank's record as rank 0 wrote them to --out (report())."""
    worker_args = ["--run", run, "--socket", socket, "--width", str(args.width),
                   "--steps", str(args.steps)]
    name = "%s: run %s" % (name, run)
    with so.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    import stallfree
    package = os.path.dirname(os.path.dirname(os.path.abspath(stallfree.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package, os.environ.get("PYTHONPATH", "")]),
               WORLD_SIZE=str(world))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(script), "--worker",
                               "--port", str(port), "--out", out] + list(worker_args),
                              env=dict(env, RANK=str(r)))
             for r in range(world)]
    codes = [p.wait(timeout=900) for p in procs]
    if codes != [0] * world:
        sys.exit("%s L=%d: ranks exited %s" % (name, world, codes))
    with open(out) as f:
        ranks = json.load(f)
    os.unlink(out)
    return ranks


def report(record, out):
    """In a worker: every rank's record gathered, written by rank 0 to `out` (a collective that
    ends the worker's process group)."""
    import torch.distributed as dist
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, record)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


def arguments(doc, steps):
    """The benchmark's command line: --width, --steps (default `steps`), and the workers'
    hidden ones (--worker, --run, --socket, --out, --port)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--run", "--socket", "--out"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args()


def runs(launch, plan):
    """{(run, L): launch(run, L, socket)} for (run, L) in plan, every run on one private
    stallfreed (1 worker thread)."""
    import stallfree
    with tempfile.TemporaryDirectory() as state, \
            stallfree.Daemon(state_dir=state, threads=1) as daemon:
        return {(run, world): launch(run, world, daemon.socket) for run, world in plan}


def figure(name, value, unit):
    print("FIGURE %s %.4g %s" % (name, value, unit), flush=True)
