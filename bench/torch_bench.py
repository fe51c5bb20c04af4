#!/usr/bin/env python3
"""torch_bench: stallfree's PyTorch front-end (stallfree.torch.ZenFlowAdamW) against torch's AdamW.

    PYTHONPATH=bazel-bin/python .venv/bin/python bench/torch_bench.py --quick   # about 2 min here
    PYTHONPATH=bazel-bin/python .venv/bin/python bench/torch_bench.py [--part 1|2|3|4] [--steps N]

A benchmark, not a test: it prints what it measured, whatever it is. One private stallfreed
(stallfree.Daemon) serves the whole run, started before anything is timed; every optimizer is
given its socket.

Part 1: the GPT of examples/torch_gpt.py (same seed, same data, same learning-rate schedule)
trained from scratch with ZenFlowAdamW in its three modes (no-offload, sync-offload, zenflow;
bf16 transfers, ratio 0.1, S = 4) and with torch.optim.AdamW. The four runs step in alternation
(one step of each in turn, the order rotated every step) so that whatever else runs on this
shared machine falls on all of them alike; zenflow's background work in the daemon (small at
this model size) can overlap another run's step. Reported: tokens/s, the mean step split into
compute (batch + forward + backward) and opt.step (whose optimizer / copies / stall parts come
from ZenFlowAdamW.last_timings; torch's AdamW step counts wholly as optimizer), the median step,
the stall share, the final train loss (mean of the last 10 steps) and the held-out eval loss.
On this machine the "device" is the CPU and shares its cores with the daemon, so tokens/s do
not show what offloading saves on a GPU; the losses show what each mode does to training.

Part 2: the optimizer step alone on >= 20M fp32 parameters (5 Linear-shaped 2048 x 2048 weights
by default) with fixed random gradients: ZenFlowAdamW sync-offload (bf16 and fp32 transfers),
zenflow and no-offload against torch.optim.AdamW(foreach=False) (torch 1.13's default on the
CPU) and torch.optim.AdamW(foreach=True). Each optimizer has its own copy of the same parameters;
after two untimed steps each, the optimizers take their timed steps in alternation (the order
rotated every round), with a short pause before each step so that one optimizer's background
work (zenflow's asynchronous daemon Update and pushes) does not land in another's timing. The
figure is the median step. zenflow's step is the time the trainer is blocked; its deferred work
runs in the daemon in the background (measured here with nothing else to overlap it). The fp32
sync-offload run also checks its parameters against torch's AdamW after the same steps.

Part 3 (bench/deepspeed_compare.py): DeepSpeed side by side, on part 2's weights and gradients in
the same run. DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu) and its cpu_adam op, JIT-built by
DeepSpeed itself on first use (75-90 s here, then cached in TORCH_EXTENSIONS_DIR or
~/.cache/torch_extensions; printed apart from every timing; the engine try below builds DeepSpeed's
shm_comm op the same way, about 60 s once). After 2 untimed steps each, in alternation (the order
rotated every round) with medians: DeepSpeedCPUAdam (fp32, adamw_mode=True, OpenMP on as many
threads as stallfreed has workers), ZenFlowCPUAdam (overlap_step=False), DeepSpeed's ZenFlow
optimizer process (overlap_step=True: zenflow_optimizer_process spawned as start_optimizer_process
does, its pool on all cores; submit to done, and with the gradient and parameter copies around it),
ZenFlowAdamW sync-offload fp32 (the whole step with its shared-memory copies, and the daemon's own
AdamW time from `stallfreectl stats`; stallfreed's oneTBB workers on all cores), and
ZenFlowSelectiveAdamW on the top 10% columns against ZenFlowAdamW zenflow's hot-column update.
FIGURE daemon_adamw_vs_deepspeed_cpu_adam is the daemon's AdamW elements/s over DeepSpeedCPUAdam's.
Every full-AdamW result is checked against torch.optim.AdamW after the same steps (max |difference|
printed; over 1e-4 the run fails). Then a subprocess tries DeepSpeed's whole ZenFlow engine
(deepspeed.initialize, ZeRO-2 and ZeRO-3 with offload_optimizer cpu and zenflow) on the CPU and
prints what runs and, for what does not, the exception and DeepSpeed's line that raised it.

Part 4 (examples/bf16_finetune.py's pretrain() and finetune()): fine-tuning a bf16 model. Part 1's
GPT is pretrained in fp32 with torch.optim.AdamW (150 steps, lr 3e-3, the generated text), then
fine-tuned from those weights in bf16 (`model.to(torch.bfloat16)`; the loss from logits widened
to fp32) on a shifted text (another generated text with its vowels rotated) at a 10x lower lr
(3e-4), with ZenFlowAdamW zenflow (the defaults: ratio 0.1, S = 4, 20-step engine warm-up, bf16
transfers) and ZenFlowAdamW no-offload, both keeping fp32 masters; and the same two in fp32, to
tell what bf16 adds. FIGURE torch_zenflow_vs_nooffload_eval_loss_finetune_bf16 is zenflow's
held-out eval loss after the last step over no-offload's (mean over --ft_seeds; each seed its
own pretraining).

Every figure is printed as `FIGURE <name> <value> <unit>`.
"""

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent


def import_example():
    sys.dont_write_bytecode = True  # no __pycache__ in examples/
    path = REPO_ROOT / "examples" / "torch_gpt.py"
    spec = importlib.util.spec_from_file_location("torch_gpt", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["torch_gpt"] = mod
    spec.loader.exec_module(mod)
    return mod


def import_bf16_example():
    """examples/bf16_finetune.py (which imports torch_gpt: import_example() first)."""
    sys.dont_write_bytecode = True
    path = REPO_ROOT / "examples" / "bf16_finetune.py"
    spec = importlib.util.spec_from_file_location("bf16_finetune", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bf16_finetune"] = mod
    spec.loader.exec_module(mod)
    return mod


def figure(name, value, unit):
    text = f"{value:.1f}" if abs(value) >= 1000 else f"{value:.4g}"
    print(f"FIGURE {name} {text} {unit}", flush=True)


# ---- Part 1 ----

PART1_RUNS = [  # (label, --mode, figure key)
    ("torch.optim.AdamW", "torch", "torch_adamw"),
    ("no-offload", "no-offload", "no_offload"),
    ("sync-offload", "sync-offload", "sync_offload"),
    ("zenflow", "zenflow", "zenflow"),
]


def part1(args, sf, tg, socket):
    text = sf.default_corpus_text()
    steps = args.steps or (60 if args.quick else 300)
    common = ["--steps", str(steps), "--batch", str(args.batch), "--seq_len", str(args.seq_len),
              "--layers", str(args.layers), "--d_model", str(args.d_model), "--heads",
              str(args.heads), "--lr", str(args.lr), "--warmup", "10", "--seed", str(args.seed),
              "--eval_every", str(max(steps // 4, 1)), "--eval_batches", "8", "--threads",
              str(args.threads), "--socket", socket]
    print(f"\n== Part 1: examples/torch_gpt.py, {args.layers} layers, d_model {args.d_model}, "
          f"{args.heads} heads, seq {args.seq_len}, batch {args.batch}, {steps} steps from "
          f"scratch, lr {args.lr}, seed {args.seed}, the generated corpus; zenflow: ratio 0.1, "
          f"S = 4, bf16 transfers", flush=True)
    # The runs step in alternation (step i of every run, the order rotated each step), so that
    # whatever else the machine does falls on all of them alike.
    runs = {}
    try:
        for label, mode, key in PART1_RUNS:
            ns = tg.build_parser().parse_args(
                common + ["--mode", mode, "--out_dir", os.path.join(args.out_dir, key)])
            runs[key] = tg.Run(ns, text=text, source="the generated corpus", quiet=True,
                               label=label)
        keys = [key for _, _, key in PART1_RUNS]
        for i in range(steps):
            for key in keys[i % len(keys):] + keys[:i % len(keys)]:
                runs[key].step()
    except BaseException:
        for r in runs.values():
            r.close()
        raise
    results = {key: runs[key].finish(plot=False) for key in runs}
    png = os.path.join(args.out_dir, "torch_bench_loss.png")
    why = tg.plot_loss(png, [(lbl, results[k]["csv"]) for lbl, _, k in PART1_RUNS],
                       f"torch_bench part 1: {steps} steps, same seed and data")

    print(f"\n{'optimizer':<18} {'tok/s':>7} {'step ms':>8} {'median':>7} {'compute':>8} "
          f"{'opt.step':>9} {'optimizer':>9} {'copies':>7} {'stall':>7} {'stall %':>7} "
          f"{'train loss':>10} {'eval loss':>9}")
    for label, _, key in PART1_RUNS:
        r = results[key]
        print(f"{label:<18} {r['tokens_per_s']:7.0f} {1e3 * r['step_s']:8.2f} "
              f"{1e3 * r['median_step_s']:7.2f} {1e3 * r['compute_s']:8.2f} "
              f"{1e3 * r['opt_step_s']:9.2f} {1e3 * r['optimizer_s']:9.2f} "
              f"{1e3 * r['copies_s']:7.2f} {1e3 * r['stall_s']:7.2f} "
              f"{100 * r['stall_share']:7.2f} {r['final_loss']:10.4f} {r['eval_loss']:9.4f}")
    print("(ms: means over the steps after the first, and the median step; optimizer / copies / "
          "stall: ZenFlowAdamW.last_timings, torch's AdamW step counts as optimizer; train loss: "
          "mean of the last 10 steps; eval loss: at the last step, before close())")
    print(f"plot: {png if not why else 'not drawn: ' + why}\n", flush=True)

    t, z, y, n = (results[k] for k in ("torch_adamw", "zenflow", "sync_offload", "no_offload"))
    figure("torch_zenflow_vs_torch_adamw_final_loss", z["final_loss"] / t["final_loss"], "x")
    figure("torch_zenflow_vs_torch_adamw_eval_loss", z["eval_loss"] / t["eval_loss"], "x")
    figure("torch_sync_offload_vs_torch_adamw_final_loss", y["final_loss"] / t["final_loss"], "x")
    figure("torch_nooffload_vs_torch_adamw_final_loss", n["final_loss"] / t["final_loss"], "x")
    figure("torch_zenflow_vs_sync_offload_step_time", z["step_s"] / y["step_s"], "x")
    for _, _, key in PART1_RUNS:
        r = results[key]
        figure(f"torch_gpt_tokens_per_s_{key}", r["tokens_per_s"], "tokens/s")
        figure(f"torch_gpt_step_{key}", 1e3 * r["step_s"], "ms")
        figure(f"torch_gpt_median_step_{key}", 1e3 * r["median_step_s"], "ms")
        figure(f"torch_gpt_opt_step_{key}", 1e3 * r["opt_step_s"], "ms")
        figure(f"torch_gpt_final_loss_{key}", r["final_loss"], "nats")
        figure(f"torch_gpt_eval_loss_{key}", r["eval_loss"], "nats")
    for key in ("sync_offload", "zenflow"):
        figure(f"torch_gpt_stall_share_{key}", results[key]["stall_share"], "fraction")
    return results


# ---- Part 2 ----


def make_params(n_weights, rows, cols, seed):
    """The same weights and gradients for every optimizer (a gradient scale that varies by
    column, as real ones do, so zenflow's selection has something to select)."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for _ in range(n_weights):
        p = torch.nn.Parameter(torch.randn(rows, cols, generator=g) * 0.02)
        col_scale = torch.rand(cols, generator=g) ** 4 * 1e-2 + 1e-4
        p.grad = torch.randn(rows, cols, generator=g) * col_scale
        params.append(p)
    return params


def part2(args, sf, socket):
    from stallfree.torch import ZenFlowAdamW
    n_w, rows, cols = args.opt_weights, args.opt_rows, args.opt_cols
    numel = n_w * rows * cols
    timed = args.opt_steps or (12 if args.quick else 24)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    variants = [  # (label, figure key, constructor)
        ("torch AdamW foreach=False", "torch_adamw",
         lambda p: torch.optim.AdamW(p, foreach=False, **hp)),
        ("torch AdamW foreach=True", "torch_adamw_foreach",
         lambda p: torch.optim.AdamW(p, foreach=True, **hp)),
        ("ZenFlow sync-offload bf16", "sync_offload",
         lambda p: ZenFlowAdamW(p, mode="sync-offload", socket=socket, **hp)),
        ("ZenFlow sync-offload fp32", "sync_offload_fp32",
         lambda p: ZenFlowAdamW(p, mode="sync-offload", grad_dtype="fp32", param_dtype="fp32",
                                socket=socket, **hp)),
        ("ZenFlow zenflow bf16", "zenflow",
         # warmup_steps=0: the steady state (the default's first 20 steps are exact, awaited
         # AdamW steps, which this part's 14 steps would otherwise measure)
         lambda p: ZenFlowAdamW(p, mode="zenflow", warmup_steps=0, socket=socket, **hp)),
        ("ZenFlow no-offload", "no_offload",
         lambda p: ZenFlowAdamW(p, mode="no-offload", socket=socket, **hp)),
    ]
    print(f"\n== Part 2: the optimizer step alone, {n_w} weights of {rows} x {cols} = "
          f"{numel / 1e6:.1f}M fp32 parameters, fixed random gradients, 2 untimed + {timed} timed "
          f"steps each in alternation, {args.threads} torch threads", flush=True)
    params = {key: make_params(n_w, rows, cols, seed=7) for _, key, _ in variants}
    opts = {}
    times = {key: [] for _, key, _ in variants}
    try:
        for _, key, make in variants:
            opts[key] = make(params[key])
        for _ in range(2):
            for _, key, _ in variants:
                opts[key].step()
        order = [key for _, key, _ in variants]
        for r in range(timed):
            for key in order[r % len(order):] + order[:r % len(order)]:
                time.sleep(args.pause)
                t = time.perf_counter()
                opts[key].step()
                times[key].append(time.perf_counter() - t)
        # The fp32 sync-offload parameters against torch's AdamW after the same steps.
        diff = max(float((a - b).abs().max()) for a, b in
                   zip(params["sync_offload_fp32"], params["torch_adamw"]))
        moved = max(float((a.detach() - b).abs().max()) for a, b in
                    zip(params["torch_adamw"], make_params(n_w, rows, cols, seed=7)))
    finally:
        for o in opts.values():
            if hasattr(o, "close"):
                o.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    base = med["torch_adamw"]
    print(f"\n{'optimizer':<28} {'median ms':>10} {'mean ms':>9} {'min ms':>8} {'max ms':>8} "
          f"{'Gelem/s':>8} {'vs torch AdamW':>15}")
    for label, key, _ in variants:
        v = times[key]
        print(f"{label:<28} {1e3 * med[key]:10.2f} {1e3 * mean[key]:9.2f} {1e3 * min(v):8.2f} "
              f"{1e3 * max(v):8.2f} {numel / med[key] / 1e9:8.3f} {med[key] / base:14.3f}x")
    print(f"(vs torch AdamW: median step over torch.optim.AdamW(foreach=False)'s; zenflow's mean "
          f"covers {timed // 4} whole rounds of S = 4 when the step count is a multiple of 4)")
    print(f"fp32 sync-offload vs torch AdamW after {2 + timed} steps: max |difference| "
          f"{diff:.3g} (the steps moved the parameters by up to {moved:.3g})\n", flush=True)

    figure("torch_sync_offload_step_vs_torch_adamw_step", med["sync_offload"] / base, "x")
    figure("torch_sync_offload_step_vs_torch_adamw_foreach_step",
           med["sync_offload"] / med["torch_adamw_foreach"], "x")
    figure("torch_sync_offload_fp32_step_vs_torch_adamw_step", med["sync_offload_fp32"] / base,
           "x")
    figure("torch_zenflow_step_vs_torch_adamw_step", med["zenflow"] / base, "x")
    figure("torch_zenflow_mean_step_vs_torch_adamw_step", mean["zenflow"] / base, "x")
    figure("torch_nooffload_step_vs_torch_adamw_step", med["no_offload"] / base, "x")
    for _, key, _ in variants:
        figure(f"torch_opt_step_{key}", 1e3 * med[key], "ms")
    figure("torch_opt_params", numel / 1e6, "M")
    figure("torch_sync_offload_fp32_max_abs_diff_vs_torch_adamw", diff, "abs")
    return med


# ---- Part 4 ----

PART4_MODES = [("zenflow", "zenflow"), ("no-offload", "no_offload")]  # (mode, figure key)


def part4(args, socket):
    bf = import_bf16_example()
    steps = args.ft_steps or (60 if args.quick else 200)
    seeds = [int(s) for s in (args.ft_seeds or ("1" if args.quick else "1,2,3")).split(",")]
    ns = bf.build_parser().parse_args(["--steps", str(steps), "--threads", str(args.threads),
                                       "--socket", socket])
    print(f"\n== Part 4: fine-tuning a bf16 model (examples/bf16_finetune.py): part 1's GPT "
          f"pretrained in fp32 ({ns.pretrain_steps} steps, torch.optim.AdamW, lr "
          f"{ns.pretrain_lr}), then {steps} steps at lr {ns.lr} on a shifted text with "
          f"ZenFlowAdamW zenflow (defaults) and no-offload, fp32 masters, the model in bf16 (and "
          f"in fp32 for comparison); seeds {seeds}", flush=True)
    res = {}  # (seed, dtype, key) -> finetune()'s summary
    pre = {}
    for seed in seeds:
        ns.seed = seed
        state, pre[seed] = bf.pretrain(ns, quiet=True)
        for dtype in ("bf16", "fp32"):
            ns.dtype = dtype
            for mode, key in PART4_MODES:
                res[seed, dtype, key] = bf.finetune(ns, state, mode, quiet=True)
    print(f"\n{'seed':>4} {'model':>5} {'optimizer':<24} {'eval before':>11} {'eval after':>10} "
          f"{'after flush':>11} {'train loss':>10} {'seconds':>8} {'device B/param':>14}")
    for (seed, dtype, key), r in res.items():
        print(f"{seed:4d} {dtype:>5} {'ZenFlowAdamW ' + r['mode']:<24} {r['eval_before']:11.4f} "
              f"{r['eval_loss']:10.4f} {r['eval_flushed']:11.4f} {r['final_loss']:10.4f} "
              f"{r['seconds']:8.1f} {r['device_bytes']['total']:14.2f}")
    print("(pretraining's eval loss: " + ", ".join(f"seed {s} {v:.4f}" for s, v in pre.items())
          + "; eval after: at the last step, as part 1's; after flush: once zenflow's last "
          "daemon update has landed; train loss: mean of the last 10 steps)")

    def mean(xs):
        return sum(xs) / len(xs)

    ratio = {d: [res[s, d, "zenflow"]["eval_loss"] / res[s, d, "no_offload"]["eval_loss"]
                 for s in seeds] for d in ("bf16", "fp32")}
    for d in ("bf16", "fp32"):
        print(f"zenflow / no-offload eval loss, {d}: " + ", ".join(f"{x:.4f}" for x in ratio[d]))
    print(flush=True)
    figure("torch_zenflow_vs_nooffload_eval_loss_finetune_bf16", mean(ratio["bf16"]), "x")
    figure("torch_zenflow_vs_nooffload_eval_loss_finetune_fp32", mean(ratio["fp32"]), "x")
    for _, key in PART4_MODES:
        figure(f"torch_finetune_bf16_vs_fp32_eval_loss_{key}",
               mean([res[s, "bf16", key]["eval_loss"] / res[s, "fp32", key]["eval_loss"]
                     for s in seeds]), "x")
        for d in ("bf16", "fp32"):
            figure(f"torch_finetune_eval_loss_{d}_{key}",
                   mean([res[s, d, key]["eval_loss"] for s in seeds]), "nats")
    for d in ("bf16", "fp32"):
        figure(f"torch_finetune_device_bytes_per_param_zenflow_{d}",
               res[seeds[0], d, "zenflow"]["device_bytes"]["total"], "bytes")
    return res


def main():
    p = argparse.ArgumentParser(
        description="ZenFlowAdamW (stallfree.torch) against torch.optim.AdamW: a small GPT "
                    "trained in every mode (part 1), the optimizer step alone on >= 20M "
                    "parameters (part 2), and DeepSpeed side by side on the same tensors "
                    "(part 3: DeepSpeedCPUAdam, ZenFlowCPUAdam, DeepSpeed's ZenFlow optimizer "
                    "process and ZenFlowSelectiveAdamW against the daemon's AdamW, checked "
                    "against torch's AdamW; then DeepSpeed's ZenFlow engine tried on the CPU), "
                    "and a bf16 model fine-tuned with zenflow and no-offload (part 4). "
                    "Prints FIGURE lines.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="fewer steps (about 2 min on 2 cores, DeepSpeed's ops built)")
    p.add_argument("--part", choices=("all", "1", "2", "3", "4"), default="all",
                   help="which part to run (3: DeepSpeed side by side; 4: bf16 fine-tuning)")
    p.add_argument("--steps", type=int, default=0, help="part 1 steps per run (0: 60 quick, 300)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--opt_weights", type=int, default=5, help="parts 2 and 3: number of weights")
    p.add_argument("--opt_rows", type=int, default=2048, help="parts 2 and 3: rows of each weight")
    p.add_argument("--opt_cols", type=int, default=2048,
                   help="parts 2 and 3: columns of each weight")
    p.add_argument("--opt_steps", type=int, default=0,
                   help="part 2: timed steps per optimizer (0: 12 quick, 24)")
    p.add_argument("--pause", type=float, default=0.05,
                   help="parts 2 and 3: seconds of idle before each timed step")
    p.add_argument("--ds_steps", type=int, default=0,
                   help="part 3: timed steps per optimizer (0: 12 quick, 24)")
    p.add_argument("--ds_settle", type=float, default=0.25,
                   help="part 3: seconds after a zenflow round boundary (its daemon Update)")
    p.add_argument("--ds_skip_engine", action="store_true",
                   help="part 3: do not try DeepSpeed's ZenFlow engine (deepspeed.initialize)")
    p.add_argument("--ft_steps", type=int, default=0,
                   help="part 4: fine-tuning steps per run (0: 60 quick, 200)")
    p.add_argument("--ft_seeds", default="",
                   help="part 4: comma-separated seeds, each with its own pretraining (empty: "
                        "1 quick, 1,2,3)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch.set_num_threads (part 3 sets DeepSpeed's OpenMP and torch's threads "
                        "to the daemon's workers instead)")
    p.add_argument("--daemon_threads", type=int, default=0,
                   help="stallfreed's optimizer workers (0: all cores)")
    p.add_argument("--out_dir", default="/tmp/stallfree-torch-bench",
                   help="part 1's metrics and plot")
    args = p.parse_args()

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    tg = import_example()
    sf = tg.import_stallfree()  # the example's: installed, else <repo>/bazel-bin/python
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"torch_bench: torch {torch.__version__}, {args.threads} torch threads, "
          f"{os.cpu_count()} cores, stallfree from {os.path.dirname(sf.__file__)}", flush=True)
    with sf.Daemon(threads=args.daemon_threads, log_level="warning") as daemon:
        print(f"stallfreed pid {daemon.pid} on {daemon.socket} (started before any timing)",
              flush=True)
        if args.part in ("all", "1"):
            part1(args, sf, tg, daemon.socket)
        if args.part in ("all", "2"):
            part2(args, sf, daemon.socket)
        if args.part in ("all", "3"):
            import deepspeed_compare  # bench/, this script's directory, is on sys.path
            deepspeed_compare.part3(args, sf, daemon.socket, figure, make_params)
        if args.part in ("all", "4"):
            part4(args, daemon.socket)
    print(f"\ntorch_bench: {time.perf_counter() - t_start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
