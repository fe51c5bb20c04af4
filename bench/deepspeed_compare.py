"""deepspeed_compare: part 3 of bench/torch_bench.py, DeepSpeed's CPU optimizers side by side with
stallfreed's AdamW on the same tensors in the same run.

    PYTHONPATH=bazel-bin/python .venv/bin/python bench/torch_bench.py --part 3

DeepSpeed runs with its CPU accelerator (DS_ACCELERATOR=cpu unless the environment says
otherwise) and its cpu_adam op, which DeepSpeed JIT-builds itself on first use (op_builder, ninja,
g++ -O3 -march=native -fopenmp) into TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions; that
build or load is timed apart from everything else and printed.

On one set of weights (part 2's: 5 x 2048 x 2048 = 21M fp32 elements by default, the same values
and fixed gradients for every optimizer, each optimizer on its own copy), after 2 untimed steps
each, these take their timed steps in alternation (the order rotated every round, a short pause
before each step), and each figure is a median:
- DeepSpeedCPUAdam (fp32, adamw_mode=True): DeepSpeed's AVX + OpenMP kernel in this process,
  on torch's OpenMP threads (torch.set_num_threads, --threads).
- ZenFlowCPUAdam, overlap_step=False: ZenFlow's sequential CPU step (the same kernel, driven as
  ZenFlowZeroOptimizerSequential drives it, step(step_id)).
- DeepSpeed's ZenFlow optimizer process (overlap_step=True): deepspeed.runtime.zenflow.
  zenflow_utils.zenflow_optimizer_process spawned as start_optimizer_process spawns it (one flat
  fp32 partition, as ZeRO-1/2 keeps per parameter group; its native ZenFlowAdam pool pinned to
  the cores that _split_affinity gives with pt_reserved_cores_perc = 0, i.e. all of them),
  driven by zenflow_adam_submit / zenflow_adam_wait. Timed twice: submit to done (the process's
  AdamW and its stale-copy, like the daemon's update) and with the copies around it (gradients
  into overlap_grad, the stale snapshot back into the weights, like ZenFlowAdamW's push/pull).
  It always uses buffer state 0: DeepSpeed alternates two gradient/moment buffers between update
  rounds, which is not AdamW step for step and would defeat the check below.
- stallfree ZenFlowAdamW(mode="sync-offload", grad_dtype="fp32", param_dtype="fp32"): the whole
  step (gradients pushed into shared memory, the daemon's Update, the parameters copied back),
  and the daemon's own AdamW time of that step (GetStats update_seconds through the binding's
  `Client.stats()`, read between steps; its accumulate, none in sync-offload, apart).
- ZenFlowSelectiveAdamW (offload=False): ZenFlow's per-step AdamW of the top-k (0.1) input
  columns of each weight (chosen as DeepSpeed chooses them: the largest column sums of |grad|),
  against its stallfree counterpart, the hot-column part of ZenFlowAdamW(mode="zenflow")'s step
  (last_timings["optimizer"]: hot AdamW and the scatter of the hot values; both in the trainer's
  process, torch ops on --threads threads for DeepSpeed, TBB for stallfree).

FIGURE daemon_adamw_vs_deepspeed_cpu_adam = the daemon's AdamW elements/s (its own update time)
/ DeepSpeedCPUAdam's elements/s; _best_of_3 and _median_of_3 the same over the timed rounds cut
into three consecutive runs of alternated rounds; _fastest the ratio of the two fastest steps,
and deepspeed_cpu_adam_fastest_gb_per_s, daemon_adamw_fastest_gb_per_s those steps as the bytes
each moves an element (28 and 32) per second: both near the memory's limit; the other FIGUREs are named for what they divide (a ratio of
elements/s, > 1 when stallfree's side is faster), and FIGURE deepspeed_cpu_adam_op_build_s
appears only in a run that built the op. After the
timed steps every full-AdamW optimizer's parameters are compared with torch.optim.AdamW(foreach=
False) run for the same steps (untimed), and the selective one's columns with torch's AdamW on
the same columns; a difference over 1e-4 stops the benchmark with an error.

Then a subprocess (`python bench/deepspeed_compare.py --engine_probe`) tries DeepSpeed's whole
ZenFlow engine on the CPU: deepspeed.initialize of a small MLP with ZeRO-2 + offload_optimizer
cpu + zenflow (sequential, sequential with the selective optimizer's states offloaded, and
overlap_step) and ZeRO-3 + zenflow, a few training steps each on gloo. What cannot run without a
GPU is printed with the exception and the line of DeepSpeed's code that raised it.
"""

import argparse
import ctypes
import logging
import os
import socket as pysocket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
TOLERANCE = 1e-4  # max |param - torch AdamW's| beyond which the benchmark stops
TOPK_RATIO = 0.1


# ---- DeepSpeed: import, its op build, where a failure is in its code ----

def import_deepspeed():
    """deepspeed with its CPU accelerator (unless DS_ACCELERATOR says otherwise)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore", message=".*is_compiling.*")
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)
    return deepspeed, get_accelerator()


def ds_frame(exc):
    """'deepspeed/<file>:<line>: <code>' of the innermost frame of exc's traceback in DeepSpeed's
    own code (None if none is)."""
    found = None
    for fr in traceback.extract_tb(exc.__traceback__):
        parts = Path(fr.filename).parts
        if "deepspeed" in parts:
            rel = "/".join(parts[len(parts) - 1 - parts[::-1].index("deepspeed"):])
            found = f"{rel}:{fr.lineno}: {(fr.line or '').strip()}"
    return found


def print_failure(what, exc):
    msg = str(exc).strip().splitlines()
    print(f"  {what}: DID NOT RUN: {type(exc).__name__}: {msg[0] if msg else ''}", flush=True)
    where = ds_frame(exc)
    print(f"    raised in {where}" if where else "    (not raised in DeepSpeed's code)",
          flush=True)


def load_cpu_adam_op():
    """DeepSpeed's cpu_adam op, built by DeepSpeed (op_builder) if not yet in the cache.
    Returns (op, seconds, built, directory)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from torch.utils.cpp_extension import _get_build_directory
    # torch's JIT build runs `ninja` from PATH: the venv's (python/requirements.txt pins ninja)
    # when the venv is not activated and no system ninja exists.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    builder = CPUAdamBuilder()
    where = _get_build_directory(builder.name, verbose=False)
    cached = os.path.exists(os.path.join(where, builder.name + ".so"))
    t = time.perf_counter()
    op = builder.load(verbose=False)
    return op, time.perf_counter() - t, not cached, where


def omp_threads():
    """(libgomp files mapped in this process, omp_get_max_threads() of the first)."""
    libs = []
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if "libgomp" in path and path not in libs:
                libs.append(path)
    n = None
    if libs:
        try:
            n = ctypes.CDLL(libs[0]).omp_get_max_threads()
        except OSError:
            pass
    return libs, n


# ---- stallfreed's own update time ----

def daemon_stats(client):
    """The daemon's counters (GetStats, through the binding's client: no process per call)."""
    st = client.stats()
    return {k: st[k] for k in ("update_seconds", "accumulate_seconds", "updates",
                               "worker_threads")}


# ---- DeepSpeed's ZenFlow optimizer process, as start_optimizer_process runs it ----

class ZenFlowProcess:
    """deepspeed.runtime.zenflow.zenflow_utils.zenflow_optimizer_process over one flat fp32
    partition holding `params` (start_optimizer_process's steps, without the deepspeed.comm
    all_gather it uses only to split cores between ranks)."""

    def __init__(self, op, params, hp):
        import multiprocessing
        from deepspeed.runtime.zenflow import zenflow_utils as zu
        self.op, self.params, self.hp, self.proc = op, params, hp, None
        self.slices, off = [], 0
        for p in params:
            self.slices.append((off, p.numel()))
            off += p.numel()
        self.flat = torch.cat([p.detach().reshape(-1) for p in params]).share_memory_()
        self.grad = [torch.zeros(off).share_memory_(), torch.zeros(off).share_memory_()]
        self.stale = torch.zeros(off).share_memory_()
        self.ctrl = torch.zeros(op.zenflow_adam_ctrl_size(), dtype=torch.uint8).share_memory_()
        op.zenflow_adam_ctrl_init(self.ctrl.data_ptr(), 1)
        self.cores, _ = zu._split_affinity(sorted(os.sched_getaffinity(0)), 0.0)
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        self.proc = ctx.Process(target=zu.zenflow_optimizer_process,
                                args=([(self.flat, self.grad[0], self.grad[1], self.stale)],
                                      self.ctrl, ready, self.cores, True))
        self.proc.daemon = True
        t = time.perf_counter()
        self.proc.start()
        if not ready.wait(timeout=300):
            self.close()
            raise RuntimeError("DeepSpeed's ZenFlow optimizer process did not become ready")
        self.start_s = time.perf_counter() - t

    def step(self, step_id):
        """(whole step with the copies, submit to done) in seconds."""
        t0 = time.perf_counter()
        g = self.grad[0]
        for (off, n), p in zip(self.slices, self.params):
            g[off:off + n].copy_(p.grad.reshape(-1))
        t1 = time.perf_counter()
        hp = self.hp
        self.op.zenflow_adam_submit(self.ctrl.data_ptr(), 0, step_id, [hp["lr"]],
                                    [hp["betas"][0]], [hp["betas"][1]], [hp["eps"]],
                                    [hp["weight_decay"]], [1])
        while not self.op.zenflow_adam_wait(self.ctrl.data_ptr(), 60):
            if not self.proc.is_alive():
                raise RuntimeError("DeepSpeed's ZenFlow optimizer process died in a step")
        t2 = time.perf_counter()
        with torch.no_grad():
            for (off, n), p in zip(self.slices, self.params):
                p.view(-1).copy_(self.stale[off:off + n])
        return time.perf_counter() - t0, t2 - t1

    def close(self):
        if self.proc is None:
            return
        if self.proc.is_alive():
            self.op.zenflow_adam_ctrl_exit(self.ctrl.data_ptr())
            self.proc.join(timeout=20)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=5)
        self.proc = None


def topk_columns(grad, ratio):
    """DeepSpeed ZenFlow's selection: the input columns with the largest sums of |grad|,
    max(1, int(cols * ratio)) of them, sorted."""
    k = max(1, int(grad.shape[1] * ratio))
    return torch.topk(grad.abs().sum(dim=0), k).indices.sort().values


# ---- part 3 ----

def part3(args, sf, socket, figure, make_params):
    from stallfree.torch import ZenFlowAdamW
    t_part = time.perf_counter()
    n_w, rows, cols = args.opt_weights, args.opt_rows, args.opt_cols
    numel = n_w * rows * cols
    timed = args.ds_steps or (12 if args.quick else 24)
    warm = 2
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    print(f"\n== Part 3: DeepSpeed side by side, {n_w} weights of {rows} x {cols} = "
          f"{numel / 1e6:.1f}M fp32 elements (part 2's), lr {hp['lr']}, betas {hp['betas']}, "
          f"eps {hp['eps']}, weight decay {hp['weight_decay']}, {warm} untimed + {timed} timed "
          f"steps each in alternation; load average {os.getloadavg()[0]:.2f} (other work on "
          f"this machine competes for the same cores)", flush=True)
    try:
        t = time.perf_counter()
        deepspeed, acc = import_deepspeed()
        print(f"deepspeed {deepspeed.__version__} (import {time.perf_counter() - t:.1f} s), "
              f"accelerator '{acc._name}' (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')})",
              flush=True)
    except Exception as e:  # noqa: BLE001 - reported, the rest of the run goes on
        print(f"part 3 skipped: deepspeed does not import ({type(e).__name__}: {e}); "
              f"`make deps` installs it", flush=True)
        return None
    try:
        op, load_s, built, where = load_cpu_adam_op()
    except Exception as e:  # noqa: BLE001
        print_failure("DeepSpeed's cpu_adam op (CPUAdamBuilder().load())", e)
        print("part 3 skipped: no cpu_adam op", flush=True)
        return None
    how = ("JIT-built by DeepSpeed (op_builder, ninja, g++)" if built
           else "loaded from its build cache (rebuilt there if its sources, flags or ninja "
                "changed)")
    print(f"DeepSpeed's cpu_adam op: {how} in {load_s:.1f} s, {where} (not part of any timing)",
          flush=True)
    from deepspeed.ops.adam import DeepSpeedCPUAdam, ZenFlowCPUAdam, ZenFlowSelectiveAdamW

    client = sf._stallfree.Client(socket, 3000)
    cores = len(os.sched_getaffinity(0))
    # DeepSpeed's OpenMP kernels and torch's ops get as many threads as the daemon has workers.
    n_thr = int(daemon_stats(client)["worker_threads"]) or args.daemon_threads or cores
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(n_thr)
    libs, omp_n = omp_threads()

    # Every optimizer on its own copy of the same weights and gradients.
    ref = make_params(n_w, rows, cols, seed=7)
    init = [p.detach().clone() for p in ref]
    variants = {}   # key -> (label, optimizer-like, step function returning seconds)
    times = {}      # key -> [seconds]
    extra = {}      # key -> [seconds] for derived timings
    opts = []
    zproc = None
    failures = []

    def add(key, label, make):
        try:
            variants[key] = (label,) + make()
            times[key] = []
        except Exception as e:  # noqa: BLE001 - printed with DeepSpeed's line
            failures.append(key)
            print_failure(label, e)

    def mk_ds():
        p = make_params(n_w, rows, cols, seed=7)
        o = DeepSpeedCPUAdam(p, adamw_mode=True, **hp)
        opts.append(o)
        return o, p, lambda: o.step()

    def mk_zf_seq():
        p = make_params(n_w, rows, cols, seed=7)
        o = ZenFlowCPUAdam(p, adamw_mode=True, overlap_step=False, **hp)
        opts.append(o)
        count = [0]

        def step():
            count[0] += 1
            o.step(step_id=count[0])
        return o, p, step

    def mk_zf_proc():
        nonlocal zproc
        p = make_params(n_w, rows, cols, seed=7)
        zproc = ZenFlowProcess(op, p, hp)
        count = [0]
        extra["ds_zenflow_process"] = []

        def step():
            count[0] += 1
            whole, proc_s = zproc.step(count[0])
            extra["ds_zenflow_process"].append(proc_s)
            return whole
        return zproc, p, step

    def mk_sync():
        p = make_params(n_w, rows, cols, seed=7)
        o = ZenFlowAdamW(p, mode="sync-offload", grad_dtype="fp32", param_dtype="fp32",
                         socket=socket, **hp)
        opts.append(o)
        for k in ("daemon_adamw", "daemon_accumulate", "sync_stall", "sync_copies"):
            extra[k] = []
        skipped = [0]

        def step():
            before = daemon_stats(client)
            t = time.perf_counter()
            o.step()
            took = time.perf_counter() - t
            lt = o.last_timings
            extra["sync_stall"].append(lt.get("stall", 0.0))
            extra["sync_copies"].append(lt.get("copies", 0.0))
            after = daemon_stats(client)
            if after["updates"] - before["updates"] == 1:
                # The update alone, as DeepSpeedCPUAdam's step is its update alone (a separate
                # accumulate of pushed gradients, none in sync-offload's fused Update, apart).
                extra["daemon_adamw"].append(after["update_seconds"] - before["update_seconds"])
                extra["daemon_accumulate"].append(
                    after["accumulate_seconds"] - before["accumulate_seconds"])
            else:  # another session's update fell in the window
                skipped[0] += 1
            return took
        step.skipped = skipped
        return o, p, step

    sel_idx = [topk_columns(p.grad, TOPK_RATIO) for p in ref]
    sel_elems = rows * sum(len(i) for i in sel_idx)

    def mk_sel():
        p = make_params(n_w, rows, cols, seed=7)
        o = ZenFlowSelectiveAdamW(p, offload=False, **hp)
        for q, idx in zip(p, sel_idx):
            q.selected_indices = idx

        def step():
            # The selected gradient columns: gathered by DeepSpeed in its gradient reduction
            # (_process_selected_fp32_groups_grad), before the step; not timed.
            for q in p:
                q.selected_grad = q.grad[:, q.selected_indices]
            t = time.perf_counter()
            o.step()
            return time.perf_counter() - t
        return o, p, step

    def mk_zen():
        p = make_params(n_w, rows, cols, seed=7)
        o = ZenFlowAdamW(p, mode="zenflow", topk_ratio=TOPK_RATIO, update_interval=4,
                         warmup_steps=0, grad_dtype="fp32", param_dtype="fp32", socket=socket,
                         **hp)
        opts.append(o)
        extra["hot_update"] = []

        def step():
            t = time.perf_counter()
            o.step()
            took = time.perf_counter() - t
            lt = o.last_timings
            extra["hot_update"].append(lt.get("optimizer", 0.0))
            if lt.get("boundary"):
                time.sleep(args.ds_settle)  # its asynchronous daemon Update runs now
            return took
        return o, p, step

    print("threads: DeepSpeedCPUAdam / ZenFlowCPUAdam: OpenMP, omp_get_max_threads() = "
          f"{omp_n} ({'one libgomp shared with torch: ' if len(libs) == 1 else ''}"
          f"{', '.join(libs) or 'libgomp not found'}), torch.get_num_threads() = "
          f"{torch.get_num_threads()}; the machine: {cores} cores", flush=True)
    try:
        add("ds_cpu_adam", "DeepSpeedCPUAdam", mk_ds)
        add("ds_zenflow_cpu_adam", "ZenFlowCPUAdam (overlap_step=False)", mk_zf_seq)
        add("ds_zenflow_overlap", "DeepSpeed ZenFlow optimizer process (overlap_step=True)",
            mk_zf_proc)
        if zproc is not None:
            print(f"threads: DeepSpeed's ZenFlow optimizer process: its native pool, "
                  f"{len(zproc.cores)} threads pinned to cores {zproc.cores} (pid "
                  f"{zproc.proc.pid}, started in {zproc.start_s:.1f} s)", flush=True)
        add("sf_sync_fp32", "ZenFlowAdamW sync-offload fp32", mk_sync)
        print(f"threads: stallfreed: {n_thr} oneTBB workers (Daemon(threads="
              f"{args.daemon_threads}){'): all cores' if not args.daemon_threads else ')'}; "
              f"its update time from its GetStats", flush=True)
        add("ds_selective", "ZenFlowSelectiveAdamW (offload=False)", mk_sel)
        add("sf_zenflow", "ZenFlowAdamW zenflow", mk_zen)
        print(f"threads: ZenFlowSelectiveAdamW: torch ops, {n_thr} threads; ZenFlowAdamW zenflow's hot update: the "
              "engine's CPU ops (oneTBB, all cores) in this process", flush=True)

        keys = list(variants)
        for _ in range(warm):
            for key in keys:
                variants[key][3]()
        for k in extra:
            extra[k].clear()
        if "sf_sync_fp32" in variants:
            variants["sf_sync_fp32"][3].skipped[0] = 0
        for r in range(timed):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                time.sleep(args.pause)
                t = time.perf_counter()
                got = variants[key][3]()
                times[key].append(got if got is not None else time.perf_counter() - t)

        # torch.optim.AdamW for the same steps, untimed.
        t = time.perf_counter()
        ref_opt = torch.optim.AdamW(ref, foreach=False, **hp)
        for _ in range(warm + timed):
            ref_opt.step()
        sub = []
        for p0, q, idx in zip(init, ref, sel_idx):
            s = torch.nn.Parameter(p0[:, idx].clone())
            s.grad = q.grad[:, idx].clone()
            sub.append(s)
        sub_opt = torch.optim.AdamW(sub, foreach=False, **hp)
        for _ in range(warm + timed):
            sub_opt.step()
        ref_s = time.perf_counter() - t
        moved = max(float((a.detach() - b).abs().max()) for a, b in zip(ref, init))
        diffs = {}
        for key in keys:
            params = variants[key][2]
            if key == "ds_selective":
                d = max(float((p.detach()[:, idx] - s.detach()).abs().max())
                        for p, s, idx in zip(params, sub, sel_idx))
                rest = 0.0
                for p, p0, idx in zip(params, init, sel_idx):
                    mask = torch.ones(cols, dtype=torch.bool)
                    mask[idx] = False
                    rest = max(rest, float((p.detach()[:, mask] - p0[:, mask]).abs().max()))
                diffs[key] = (d, rest)
            elif key != "sf_zenflow":
                diffs[key] = (max(float((p.detach() - r.detach()).abs().max())
                                  for p, r in zip(params, ref)), None)
    finally:
        torch.set_num_threads(prev_threads)
        if zproc is not None:
            zproc.close()
        for o in opts:
            if hasattr(o, "close"):
                o.close()

    print(f"(load average {os.getloadavg()[0]:.2f} at the end of the timed steps)", flush=True)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    xmed = {k: statistics.median(v) for k, v in extra.items() if v}
    rows_out = []  # (label, key-for-figures, list of seconds, elements, threads)
    for key, label, elems, thr in (
            ("ds_cpu_adam", "DeepSpeedCPUAdam step", numel, f"OpenMP {omp_n}"),
            ("ds_zenflow_cpu_adam", "ZenFlowCPUAdam step (sequential)", numel, f"OpenMP {omp_n}"),
            ("ds_zenflow_process", "DS ZenFlow process, submit->done", numel,
             f"pool {len(zproc.cores) if zproc else '-'}"),
            ("ds_zenflow_overlap", "DS ZenFlow process + copies", numel,
             f"pool {len(zproc.cores) if zproc else '-'}"),
            ("daemon_adamw", "stallfreed AdamW (its update)", numel, "TBB all"),
            ("sf_sync_fp32", "ZenFlowAdamW sync-offload fp32", numel, "TBB all"),
            ("ds_selective", "ZenFlowSelectiveAdamW step", sel_elems, f"torch {n_thr}"),
            ("hot_update", "ZenFlowAdamW zenflow hot update", sel_elems, "TBB all"),
            ("sf_zenflow", "ZenFlowAdamW zenflow step", numel, "TBB all")):
        v = times.get(key) or extra.get(key)
        if v:
            rows_out.append((label, key, v, elems, thr))
    print(f"\n{'optimizer':<34} {'median ms':>10} {'mean ms':>9} {'min ms':>8} {'max ms':>8} "
          f"{'Melem':>7} {'Gelem/s':>8} {'threads':>9}")
    for label, key, v, elems, thr in rows_out:
        e = elems
        m = statistics.median(v)
        print(f"{label:<34} {1e3 * m:10.2f} {1e3 * statistics.fmean(v):9.2f} "
              f"{1e3 * min(v):8.2f} {1e3 * max(v):8.2f} {e / 1e6:7.2f} {e / m / 1e9:8.3f} "
              f"{thr:>9}")
    if "sf_sync_fp32" in variants:
        sk = variants["sf_sync_fp32"][3].skipped[0]
        print(f"(ZenFlowAdamW sync-offload fp32: median copies "
              f"{1e3 * xmed.get('sync_copies', 0):.2f} "
              f"ms and stall {1e3 * xmed.get('sync_stall', 0):.2f} ms of its step (last_timings); "
              f"the daemon's update: GetStats update_seconds (its accumulate apart: median "
              f"{1e3 * xmed.get('daemon_accumulate', 0):.2f} ms accumulating) over "
              f"{len(extra.get('daemon_adamw', []))} steps"
              f"{f', {sk} dropped (another update in the window)' if sk else ''}. "
              f"ZenFlowSelectiveAdamW: {sel_elems / 1e6:.2f}M selected elements; zenflow hot "
              f"update: {sel_elems / 1e6:.2f}M hot elements, last_timings['optimizer'], "
              f"which holds reselections too.)")
    print(f"check, after {warm + timed} steps against torch.optim.AdamW(foreach=False) (run "
          f"untimed, {ref_s:.1f} s; the steps moved the parameters by up to {moved:.3g}):")
    bad = []
    for key, (d, rest) in diffs.items():
        label = variants[key][0]
        if rest is None:
            print(f"  {label}: max |difference| {d:.3g}")
        else:
            print(f"  {label}: selected columns, max |difference| from torch AdamW on those "
                  f"columns {d:.3g}; the other columns moved by {rest:.3g}")
        if not d <= TOLERANCE or (rest is not None and rest != 0.0):
            bad.append(label)

    # Figures: elements/s ratios (a ratio of elements/s is the inverse ratio of medians).
    def rate(key, elems=numel):
        m = med.get(key, xmed.get(key))
        return elems / m if m else None

    def ratio(name, a, b):
        if a and b:
            figure(name, a / b, "x")

    ds = rate("ds_cpu_adam")
    daemon = rate("daemon_adamw") or rate("sf_sync_fp32")
    sync = rate("sf_sync_fp32")
    if daemon and ds:
        basis = ("the daemon's own update" if rate("daemon_adamw")
                 else "the whole ZenFlowAdamW sync-offload step")
        # The same ratio per round (both timed in it), less exposed to drift on this machine.
        paired = []
        if rate("daemon_adamw") and len(extra["daemon_adamw"]) == len(times["ds_cpu_adam"]):
            paired = [d / s for d, s in zip(times["ds_cpu_adam"], extra["daemon_adamw"])]
        print(f"\ndaemon_adamw_vs_deepspeed_cpu_adam: {basis} {daemon / 1e9:.3f} Gelem/s over "
              f"DeepSpeedCPUAdam {ds / 1e9:.3f} Gelem/s"
              + (f"; median of the per-round ratios {statistics.median(paired):.3f}"
                 if paired else ""), flush=True)
    ratio("daemon_adamw_vs_deepspeed_cpu_adam", daemon, ds)
    # The timed rounds as three consecutive runs of alternated rounds (thirds), each run's ratio
    # of medians: interference on this shared machine only slows a side down, so the best of
    # the three is the least disturbed, and the median of the three says how typical it is.
    if rate("daemon_adamw") and len(extra["daemon_adamw"]) == len(times["ds_cpu_adam"]) >= 3:
        n3 = len(times["ds_cpu_adam"]) // 3
        thirds = [statistics.median(times["ds_cpu_adam"][i * n3:(i + 1) * n3]) /
                  statistics.median(extra["daemon_adamw"][i * n3:(i + 1) * n3])
                  for i in range(3)]
        print("daemon_adamw_vs_deepspeed_cpu_adam over three runs of %d alternated rounds: %s"
              % (n3, ", ".join("%.3f" % x for x in thirds)), flush=True)
        figure("daemon_adamw_vs_deepspeed_cpu_adam_best_of_3", max(thirds), "x")
        figure("daemon_adamw_vs_deepspeed_cpu_adam_median_of_3", statistics.median(thirds), "x")
    # The memory's limit: each side's fastest step as the bytes it moves an element (DeepSpeed:
    # the parameter, m and v read and written and the gradient read, 28; the daemon's update
    # of an fp32 session: the same and the parameter slot streamed, 32). Both near the same
    # GB/s means the ratio is set by the bytes, not by the kernels (optimizer_bench prints the
    # streaming limit of the pattern, stream_limit_4r3w).
    if times.get("ds_cpu_adam") and extra.get("daemon_adamw"):
        fastest_ds, fastest_daemon = min(times["ds_cpu_adam"]), min(extra["daemon_adamw"])
        figure("deepspeed_cpu_adam_fastest_gb_per_s", numel * 28 / fastest_ds / 1e9, "GB/s")
        figure("daemon_adamw_fastest_gb_per_s", numel * 32 / fastest_daemon / 1e9, "GB/s")
        figure("daemon_adamw_vs_deepspeed_cpu_adam_fastest", fastest_ds / fastest_daemon, "x")
    ratio("torch_sync_offload_fp32_step_vs_deepspeed_cpu_adam", sync, ds)
    ratio("daemon_adamw_vs_deepspeed_zenflow_cpu_adam", daemon, rate("ds_zenflow_cpu_adam"))
    ratio("daemon_adamw_vs_deepspeed_zenflow_process", daemon, rate("ds_zenflow_process"))
    ratio("torch_sync_offload_fp32_step_vs_deepspeed_zenflow_process_with_copies", sync,
          rate("ds_zenflow_overlap"))
    ratio("zenflow_hot_update_vs_deepspeed_selective_adamw", rate("hot_update", sel_elems),
          rate("ds_selective", sel_elems))
    for key, name, elems in (("ds_cpu_adam", "deepspeed_cpu_adam", numel),
                             ("ds_zenflow_cpu_adam", "deepspeed_zenflow_cpu_adam", numel),
                             ("ds_zenflow_process", "deepspeed_zenflow_process", numel),
                             ("daemon_adamw", "daemon_adamw", numel),
                             ("sf_sync_fp32", "torch_sync_offload_fp32_step", numel),
                             ("ds_selective", "deepspeed_selective_adamw", sel_elems),
                             ("hot_update", "zenflow_hot_update", sel_elems)):
        r = rate(key, elems) if elems else None
        if r:
            figure(f"{name}_elements_per_s", r, "elements/s")
    for key, (d, _) in diffs.items():
        figure(f"{key}_max_abs_diff_vs_torch_adamw", d, "abs")
    if built:  # a first run only; later runs load it from the cache in seconds
        figure("deepspeed_cpu_adam_op_build_s", load_s, "s")

    if not args.ds_skip_engine:
        engine_probe_subprocess()
    if bad:
        raise SystemExit(f"torch_bench part 3: parameters differ from torch.optim.AdamW beyond "
                         f"{TOLERANCE} (or unselected columns moved): {', '.join(bad)}")
    if failures:
        print(f"part 3: did not run: {', '.join(failures)} (above)", flush=True)
    print(f"part 3: {time.perf_counter() - t_part:.1f} s", flush=True)
    return med


# ---- DeepSpeed's ZenFlow engine on the CPU, in a subprocess ----

def free_port():
    with pysocket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_probe_subprocess():
    print("\nDeepSpeed's ZenFlow engine on the CPU (deepspeed.initialize, gloo, one rank; a "
          "subprocess: bench/deepspeed_compare.py --engine_probe):", flush=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    t = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--engine_probe"],
                             env=env, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired:
        print("  the probe did not finish in 400 s", flush=True)
        return
    for line in out.stdout.splitlines():
        if line.startswith("  "):
            print(line, flush=True)
    if out.returncode != 0:
        print(f"  the probe exited {out.returncode}; its last output:", flush=True)
        for line in (out.stdout + out.stderr).splitlines()[-15:]:
            print("    " + line, flush=True)
    print(f"  ({time.perf_counter() - t:.1f} s)", flush=True)


ENGINE_CONFIGS = [  # (label, ZeRO stage, zenflow options)
    ("ZeRO-2 + ZenFlow, sequential (ZenFlowCPUAdam, ZenFlowSelectiveAdamW)", 2, {}),
    ("ZeRO-2 + ZenFlow, sequential, selective states offloaded (offload: true)", 2,
     {"offload": True}),
    ("ZeRO-2 + ZenFlow, overlap_step (the ZenFlow optimizer process)", 2,
     {"overlap_step": True}),
    ("ZeRO-3 + ZenFlow", 3, {}),
]


def engine_probe(steps=8):
    deepspeed, acc = import_deepspeed()
    warnings.filterwarnings("ignore")
    t = time.perf_counter()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    print(f"  deepspeed.init_distributed(gloo) on accelerator '{acc._name}': "
          f"{time.perf_counter() - t:.1f} s (the first time it JIT-builds DeepSpeed's "
          f"shm_comm op)", flush=True)
    for label, stage, zen in ENGINE_CONFIGS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                    torch.nn.Linear(512, 256))
        cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
               "zero_optimization": {
                   "stage": stage, "overlap_comm": True,
                   "offload_optimizer": {"device": "cpu", "pin_memory": False},
                   "zenflow": dict({"topk_ratio": TOPK_RATIO, "update_interval": 4,
                                    "select_strategy": "step", "select_interval": 4,
                                    "full_warm_up_rounds": 0, "pt_reserved_cores_perc": 0.0},
                                   **zen)},
               "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
        try:
            t = time.perf_counter()
            engine, opt, _, _ = deepspeed.initialize(model=model,
                                                     model_parameters=model.parameters(),
                                                     config=cfg)
            init_s = time.perf_counter() - t
            losses, step_s = [], []
            x = torch.randn(8, 256)
            y = torch.randn(8, 256)
            for _ in range(steps):
                t = time.perf_counter()
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                step_s.append(time.perf_counter() - t)
                losses.append(float(loss.detach()))
            print(f"  {label}: ran ({type(opt).__name__}), initialize {init_s:.1f} s, {steps} "
                  f"steps, median {1e3 * statistics.median(step_s):.1f} ms, loss "
                  f"{losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        except Exception as e:  # noqa: BLE001 - the point of the probe
            print_failure(label, e)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine_probe", action="store_true",
                   help="try DeepSpeed's ZenFlow engine on the CPU (torch_bench part 3 runs "
                        "this in a subprocess); the comparison itself runs from torch_bench.py")
    args = p.parse_args()
    if not args.engine_probe:
        p.error("run the comparison as bench/torch_bench.py --part 3")
    engine_probe()


if __name__ == "__main__":
    main()
