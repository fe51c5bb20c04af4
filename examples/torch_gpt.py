#!/usr/bin/env python3
"""A small GPT in plain torch.nn, trained with stallfree's ZenFlowAdamW (or torch's AdamW).

    PYTHONPATH=bazel-bin/python .venv/bin/python examples/torch_gpt.py --steps 20
    ... examples/torch_gpt.py --mode sync-offload --data my_corpus.txt --steps 500
    ... examples/torch_gpt.py --mode torch          # plain torch.optim.AdamW, the reference

The model: byte tokens (vocab 256), a token embedding plus learned positions, --layers pre-norm
blocks (LayerNorm, causal multi-head self-attention, LayerNorm, GELU MLP of width 4 * d_model,
each with a residual connection), a final LayerNorm and an untied LM head. No dropout, so runs
with the same --seed are comparable across optimizers.

Data: --data FILE (read as bytes; UTF-8 text becomes its bytes) or, by default, the project's
generated English-like corpus (stallfree.default_corpus_text()). The last 10% of the bytes are
held out; the training batches are random windows of the first 90% (seeded), the evaluation
uses --eval_batches fixed, evenly spaced windows of the held-out part, every --eval_every steps
and at the last step.

Optimisation: two parameter groups, "decay" (the 2-D weights of every nn.Linear: attention,
MLP and the LM head) with --weight_decay, and "no_decay" (biases, LayerNorm gains and biases,
the token and position embeddings) with weight decay 0. Betas (0.9, 0.95), eps 1e-8. The
learning rate warms up linearly over --warmup steps to --lr, then follows a cosine down to
--lr * --min_lr_ratio at the last step (torch.optim.lr_scheduler.LambdaLR, the same schedule as
the C++ trainer). Gradients are clipped to a global norm of --clip.

--mode zenflow | sync-offload | no-offload: stallfree.torch.ZenFlowAdamW in that mode (the
offload modes talk to stallfreed at --socket, or $STALLFREE_SOCKET, or the default socket, and
start a private daemon when none answers); --mode torch: torch.optim.AdamW.

One progress line per step: loss, learning rate, gradient norm, tokens/s and the step time
split into compute (batch + forward + backward) and the optimizer step; for ZenFlowAdamW the
latter is broken down as its last_timings report it: optimizer (device-side AdamW, scores,
scatters), copies (gathers and scatters of offloaded columns) and stall (waiting for the copy
thread, the daemon's Update or a migration). At the end: a summary line, --out_dir/metrics.csv
and --out_dir/loss.png (matplotlib when installed, else gnuplot).

The functions build_parser(), train() and GPT are used by bench/torch_bench.py as well.
"""

import argparse
import csv
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
MODES = ("zenflow", "sync-offload", "no-offload", "torch")
BETAS = (0.9, 0.95)
EPS = 1e-8
EVAL_FRACTION = 0.1


def import_stallfree():
    """Imports stallfree (and stallfree.torch); falls back to <repo>/bazel-bin/python."""
    try:
        import stallfree
        import stallfree.torch  # noqa: F401
    except ImportError:
        path = str(REPO_ROOT / "bazel-bin" / "python")
        if path in sys.path:
            raise
        sys.path.insert(0, path)
        try:
            import stallfree
            import stallfree.torch  # noqa: F401
        except ImportError as e:
            raise SystemExit(
                f"cannot import stallfree ({e}); install it (pip install stallfree-*.whl) or build "
                f"it (bazel build //python/...) and run with PYTHONPATH={path}") from e
    return stallfree


# ---- The model ----


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, heads, max_len):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"--d_model {d_model} is not a multiple of --heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        mask = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, max_len, max_len), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.heads
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, hd).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(B, T, self.heads, hd).transpose(1, 2)
        v = v.view(B, T, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model, heads, max_len):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, max_len)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, d_model=128, heads=4, layers=4, max_len=64):
        super().__init__()
        self.max_len = max_len
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, max_len) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        # GPT-2 initialisation: N(0, 0.02), the residual projections scaled by 1/sqrt(2 layers).
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx):
        B, T = idx.shape
        if T > self.max_len:
            raise ValueError(f"sequence of {T} tokens is longer than the model's {self.max_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def param_groups(model, weight_decay, named=False):
    """decay: the 2-D weights of the nn.Linear layers; no_decay: everything else.
    named: (name, tensor) pairs instead of tensors (ZenFlowAdamW takes them and names the
    parameters in its messages and daemon sessions; torch's AdamW does not)."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if id(p) in linear_weights else no_decay).append((name, p) if named else p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def lr_factor(step, steps, warmup, min_ratio):
    """The learning rate of (1-based) `step` over the peak: linear warm-up, then cosine."""
    if warmup > 0 and step <= warmup:
        return step / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---- Data ----


def load_text(data):
    """The training bytes: --data FILE, or the project's generated corpus."""
    if data:
        with open(data, "rb") as f:
            text = f.read()
        return text, data
    sf = import_stallfree()
    return sf.default_corpus_text(), "the generated corpus (stallfree.default_corpus_text())"


class Batches:
    """Random training windows of the first 90% of the text; fixed windows of the last 10%."""

    def __init__(self, text, seq_len, batch, seed, eval_batches):
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        cut = int(len(data) * (1.0 - EVAL_FRACTION))
        self.train, self.eval = data[:cut], data[cut:]
        self.seq_len, self.batch = seq_len, batch
        if len(self.train) < seq_len + 2:
            raise SystemExit(f"the text is too short: {len(data)} bytes for --seq_len {seq_len}")
        self.gen = torch.Generator().manual_seed(seed + 1)
        # Evaluation windows: evenly spaced over the held-out part (overlapping if it is short).
        self.eval_batches = []
        room = len(self.eval) - seq_len - 1
        if room >= 0:
            n = eval_batches * batch
            starts = [round(i * room / max(n - 1, 1)) for i in range(n)]
            for b in range(eval_batches):
                s = starts[b * batch:(b + 1) * batch]
                self.eval_batches.append(self._windows(self.eval, s))

    def _windows(self, data, starts):
        idx = torch.tensor(starts)[:, None] + torch.arange(self.seq_len + 1)[None]
        w = data[idx]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def next(self):
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (self.batch,),
                               generator=self.gen)
        return self._windows(self.train, starts.tolist())


@torch.no_grad()
def evaluate(model, batches):
    if not batches.eval_batches:
        return float("nan")
    model.eval()
    total = 0.0
    for x, y in batches.eval_batches:
        logits = model(x)
        total += F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).item()
    model.train()
    return total / len(batches.eval_batches)


# ---- Output ----

CSV_FIELDS = ["step", "loss", "eval_loss", "lr", "tokens_per_s", "step_s", "compute_s",
              "opt_step_s", "engine_s", "optimizer_s", "copies_s", "stall_s", "bytes_to_host",
              "bytes_to_device", "grad_norm", "boundary", "reselected"]


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.9g}" if isinstance(v, float) else v) for k, v in r.items()})


BREAKDOWN = ("compute", "optimizer", "copies", "stall", "opt_other", "other")
BREAKDOWN_TITLES = {"optimizer": "optimizer", "copies": "copies", "stall": "stall",
                    "opt_other": "rest of opt.step", "other": "clip, lr, rest"}


def mean_times(path):
    """Mean seconds per step of a metrics.csv (rows after the first), split as BREAKDOWN."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    rows = rows[1:] or rows
    t = dict.fromkeys(BREAKDOWN, 0.0)
    for r in rows:
        g = {k: float(r[k]) for k in ("step_s", "compute_s", "opt_step_s", "optimizer_s",
                                      "copies_s", "stall_s")}
        t["compute"] += g["compute_s"]
        t["optimizer"] += g["optimizer_s"]
        t["copies"] += g["copies_s"]
        t["stall"] += g["stall_s"]
        t["opt_other"] += max(0.0, g["opt_step_s"] - g["optimizer_s"] - g["copies_s"]
                              - g["stall_s"])
        t["other"] += max(0.0, g["step_s"] - g["compute_s"] - g["opt_step_s"])
    return {k: v / max(len(rows), 1) for k, v in t.items()}


def plot_loss(png, runs, title):
    """Loss curves of runs [(label, metrics.csv)] and their mean step-time breakdown, with
    matplotlib when it is installed, else gnuplot; returns '' or why nothing was drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401  (the backend loads)
    except ImportError:
        if not shutil.which("gnuplot"):
            return "neither matplotlib nor gnuplot is installed (apt-get install gnuplot-nox)"
        return _plot_gnuplot(png, runs, title)
    return _plot_matplotlib(png, runs, title)


def _plot_gnuplot(png, runs, title):
    gp = [
        "set terminal pngcairo size 1300,550 noenhanced",
        f"set output '{png}'",
        "set datafile separator ','",
        "set datafile missing 'nan'",
        f"set multiplot layout 1,2 title '{title}'",
        "set title 'loss'", "set xlabel 'step'", "set ylabel 'cross-entropy (nats/byte)'",
        "set key top right", "set grid",
    ]
    curves = []
    for i, (label, path) in enumerate(runs, start=1):
        curves.append(f"'{path}' using 1:2 skip 1 with lines lw 2 lc {i} title '{label} train'")
        curves.append(f"'{path}' using 1:3 skip 1 with points pt 7 ps 1.2 lc {i} "
                      f"title '{label} eval'")
    gp.append("plot " + ", ".join(curves))
    dat = png + ".breakdown.dat"
    with open(dat, "w") as f:
        f.write("# run " + " ".join(BREAKDOWN) + "\n")
        for label, path in runs:
            t = mean_times(path)
            f.write(f'"{label}" ' + " ".join(f"{t[k]:.6f}" for k in BREAKDOWN) + "\n")
    gp += ["set datafile separator whitespace",
           "set title 'mean step time (steps after the first)'", "set xlabel ''",
           "set ylabel 'seconds'", "set style data histograms",
           "set style histogram rowstacked", "set style fill solid 0.8 border -1",
           "set boxwidth 0.6", "set key outside right top", "set yrange [0:*]",
           "set xtics nomirror rotate by 25 right", "unset grid",
           f"plot '{dat}' using 2:xtic(1) title 'compute', "
           + ", ".join(f"'' using {i + 3} title '{BREAKDOWN_TITLES[k]}'"
                       for i, k in enumerate(BREAKDOWN[1:]))]
    gp.append("unset multiplot")
    script = png + ".gp"
    with open(script, "w") as f:
        f.write("\n".join(gp) + "\n")
    r = subprocess.run(["gnuplot", script], capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(png):
        return f"gnuplot failed: {r.stderr.strip()[-300:]}"
    return ""


def _plot_matplotlib(png, runs, title):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(12, 5))
    for label, path in runs:
        with open(path) as f:
            rows = list(csv.DictReader(f))
        st = [int(r["step"]) for r in rows]
        ax[0].plot(st, [float(r["loss"]) for r in rows], label=f"{label} train")
        ev = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"] != "nan"]
        if ev:
            ax[0].plot(*zip(*ev), "o", label=f"{label} eval")
    ax[0].set_xlabel("step"), ax[0].set_ylabel("cross-entropy (nats/byte)"), ax[0].legend()
    bottom = [0.0] * len(runs)
    for k in BREAKDOWN:
        v = [mean_times(path)[k] for _, path in runs]
        ax[1].bar([lbl for lbl, _ in runs], v, bottom=bottom,
                  label=BREAKDOWN_TITLES.get(k, k))
        bottom = [b + x for b, x in zip(bottom, v)]
    ax[1].set_title("mean step time"), ax[1].set_ylabel("seconds"), ax[1].legend()
    fig.suptitle(title)
    fig.savefig(png)
    plt.close(fig)
    return ""


# ---- Training ----


def make_optimizer(args, model, socket):
    if args.mode == "torch":
        return torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr,
                                 betas=BETAS, eps=EPS, weight_decay=args.weight_decay)
    import_stallfree()
    from stallfree.torch import ZenFlowAdamW
    return ZenFlowAdamW(param_groups(model, args.weight_decay, named=True), lr=args.lr,
                        betas=BETAS, eps=EPS, weight_decay=args.weight_decay,
                        mode=args.mode, topk_ratio=args.topk_ratio,
                        update_interval=args.update_interval,
                        select_interval=args.select_interval or None,
                        await_updates=args.await_updates, grad_dtype=args.grad_dtype,
                        param_dtype=args.param_dtype, socket=socket)


class Run:
    """One training run as `args` (build_parser()'s namespace) says, a step at a time, so that
    bench/torch_bench.py can interleave the steps of several runs. train() is the plain loop.

    text: the corpus bytes (loaded from args.data / the generated corpus when None).
    quiet: no per-step progress lines (the eval and summary lines are still printed).
    """

    def __init__(self, args, text=None, source=None, quiet=False, label=None):
        torch.set_num_threads(args.threads)
        if text is None:
            text, source = load_text(args.data)
        self.args, self.quiet = args, quiet
        self.label = label or args.mode
        torch.manual_seed(args.seed)
        self.model = GPT(256, args.d_model, args.heads, args.layers, args.seq_len)
        self.batches = Batches(text, args.seq_len, args.batch, args.seed, args.eval_batches)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        decayed = sum(p.numel() for p in param_groups(self.model, 0.0)[0]["params"])
        opt_name = "torch.optim.AdamW" if args.mode == "torch" else "ZenFlowAdamW " + args.mode
        print(f"{self.label}: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
              f"seq {args.seq_len}, batch {args.batch}, vocab 256: {self.n_params / 1e6:.2f}M "
              f"parameters ({decayed / 1e6:.2f}M with weight decay); optimizer {opt_name}; data "
              f"{source} ({len(self.batches.train)} train / {len(self.batches.eval)} eval "
              f"bytes); {args.threads} torch threads", flush=True)
        self.opt = make_optimizer(args, self.model, args.socket)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda i: lr_factor(i + 1, args.steps, args.warmup, args.min_lr_ratio))
        self.tokens = args.batch * args.seq_len
        self.rows, self.losses = [], []
        self.last_eval = float("nan")
        self.step_no = 0
        self.model.train()

    def step(self):
        """One training step (and the evaluation when it is due); returns the loss."""
        args, model, opt = self.args, self.model, self.opt
        self.step_no += 1
        step = self.step_no
        t0 = time.perf_counter()
        x, y = self.batches.next()
        opt.zero_grad(set_to_none=False)
        logits = model(x)
        loss_t = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss_t.backward()
        compute = time.perf_counter() - t0
        if args.clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip))
        else:
            norm = float(torch.norm(torch.stack(
                [p.grad.norm() for p in model.parameters() if p.grad is not None])))
        lr = opt.param_groups[0]["lr"]
        t1 = time.perf_counter()
        opt.step()
        opt_step = time.perf_counter() - t1
        self.sched.step()
        step_s = time.perf_counter() - t0
        tm = getattr(opt, "last_timings", None)
        if tm is None:  # torch.optim.AdamW: the whole step is optimizer time
            tm = dict(optimizer=opt_step, copies=0.0, stall=0.0, total=opt_step,
                      bytes_to_host=0, bytes_to_device=0, boundary=False, reselected=False)
        loss = loss_t.item()
        self.losses.append(loss)
        ev = float("nan")
        if (args.eval_every > 0 and step % args.eval_every == 0) or step == args.steps:
            ev = self.last_eval = evaluate(model, self.batches)
        self.rows.append(dict(
            step=step, loss=loss, eval_loss=ev, lr=lr, tokens_per_s=self.tokens / step_s,
            step_s=step_s, compute_s=compute, opt_step_s=opt_step,
            engine_s=float(tm.get("total", opt_step)), optimizer_s=float(tm["optimizer"]),
            copies_s=float(tm["copies"]), stall_s=float(tm["stall"]),
            bytes_to_host=int(tm.get("bytes_to_host", 0)),
            bytes_to_device=int(tm.get("bytes_to_device", 0)), grad_norm=norm,
            boundary=int(bool(tm.get("boundary", False))),
            reselected=int(bool(tm.get("reselected", False)))))
        if not self.quiet:
            print(f"step {step:4d}/{args.steps}  loss {loss:.4f}  lr {lr:.2e}  |g| {norm:.3f}  "
                  f"{self.tokens / step_s:6.0f} tok/s  step {step_s:.3f} s (compute "
                  f"{compute:.3f}, opt.step {opt_step:.3f}: optimizer {tm['optimizer']:.3f}, "
                  f"copies {tm['copies']:.3f}, stall {tm['stall']:.3f})", flush=True)
        if not math.isnan(ev):
            print(f"eval step {step}  loss {ev:.4f}", flush=True)
        if not math.isfinite(loss):
            raise SystemExit(f"{self.label}: the loss is {loss} at step {step}")
        return loss

    def close(self):
        """Closes the optimizer (ZenFlowAdamW: finishes offload work, ends its sessions)."""
        if hasattr(self.opt, "close"):
            self.opt.close()

    def finish(self, plot=True):
        """Closes the optimizer, writes metrics.csv (and loss.png), prints the summary line and
        returns the summary: means over the steps after the first (which pays allocation and
        session set-up), medians as well (robust to a busy machine), losses."""
        self.close()
        args, rows = self.args, self.rows
        timed = rows[1:] or rows
        keys = ("step_s", "compute_s", "opt_step_s", "optimizer_s", "copies_s", "stall_s")
        mean = {k: sum(r[k] for r in timed) / len(timed) for k in keys}
        median = {"median_" + k: statistics.median(r[k] for r in timed) for k in keys}
        n = len(self.losses)
        tail = min(10, n)
        traffic = sum(r["bytes_to_host"] + r["bytes_to_device"] for r in rows)
        summary = dict(label=self.label, mode=args.mode, params=self.n_params, steps=n,
                       first_loss=self.losses[0], final_loss=sum(self.losses[-tail:]) / tail,
                       tail=tail, eval_loss=self.last_eval,
                       tokens_per_s=self.tokens / mean["step_s"],
                       median_tokens_per_s=self.tokens / median["median_step_s"],
                       stall_share=mean["stall_s"] / max(mean["step_s"], 1e-12),
                       traffic_per_step=traffic / max(n, 1), losses=self.losses, csv="", png="",
                       **mean, **median)
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
            summary["csv"] = os.path.join(args.out_dir, "metrics.csv")
            write_csv(summary["csv"], rows)
            if plot:
                png = os.path.join(args.out_dir, "loss.png")
                why = plot_loss(png, [(self.label, summary["csv"])],
                                f"torch_gpt: {self.label}, {self.n_params / 1e6:.2f}M parameters")
                summary["png"] = png if not why else f"not drawn: {why}"
        print(f"summary: {self.label}, {self.n_params / 1e6:.2f}M parameters, {n} steps: train "
              f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} (mean of the "
              f"last {tail}), eval loss {self.last_eval:.4f}, {summary['tokens_per_s']:.0f} "
              f"tokens/s, step {mean['step_s']:.4f} s = compute {mean['compute_s']:.4f} + "
              f"opt.step {mean['opt_step_s']:.4f} (optimizer {mean['optimizer_s']:.4f}, copies "
              f"{mean['copies_s']:.4f}, stall {mean['stall_s']:.4f}; stall share "
              f"{100 * summary['stall_share']:.1f}%) + the rest, means over steps 2-{n}; host "
              f"traffic {summary['traffic_per_step'] / (2 * self.n_params):.2f}x the bf16 model "
              f"per step", flush=True)
        if args.out_dir:
            print(f"wrote {summary['csv']}" + (f"; plot {summary['png']}" if plot else ""),
                  flush=True)
        return summary


def train(args, text=None, source=None, quiet=False, label=None, plot=True):
    """Trains one model as `args` says (see Run); returns the run's summary."""
    run = Run(args, text, source, quiet, label)
    try:
        for _ in range(args.steps):
            run.step()
    except BaseException:
        run.close()
        raise
    return run.finish(plot)


def build_parser():
    p = argparse.ArgumentParser(
        description="Trains a small GPT (torch.nn, byte tokens) with stallfree's ZenFlowAdamW "
                    "or torch.optim.AdamW; writes metrics.csv and loss.png to --out_dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="zenflow",
                   help="ZenFlowAdamW mode, or 'torch' for torch.optim.AdamW")
    p.add_argument("--data", default="", help="training text (read as bytes); default: the "
                   "project's generated corpus")
    p.add_argument("--steps", type=int, default=200, help="training steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq_len", type=int, default=64, help="tokens (bytes) per sequence")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--d_model", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=10, help="linear learning-rate warm-up steps")
    p.add_argument("--min_lr_ratio", type=float, default=0.1,
                   help="final learning rate over the peak (cosine)")
    p.add_argument("--weight_decay", type=float, default=0.1,
                   help="AdamW weight decay of the 2-D Linear weights (biases, norms and "
                        "embeddings get none)")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--topk_ratio", type=float, default=0.1,
                   help="zenflow: fraction of each weight's columns updated on the device")
    p.add_argument("--update_interval", type=int, default=4,
                   help="zenflow: steps per round (S); the daemon updates the cold columns once "
                        "a round")
    p.add_argument("--select_interval", type=int, default=0,
                   help="zenflow: steps between hot-column selections (0: the engine's 4S)")
    p.add_argument("--await_updates", action="store_true",
                   help="zenflow: wait for each round's daemon Update (no staleness)")
    p.add_argument("--grad_dtype", choices=("bf16", "fp32"), default="bf16",
                   help="gradient dtype sent to the daemon")
    p.add_argument("--param_dtype", choices=("bf16", "fp32"), default="bf16",
                   help="parameter dtype returned by the daemon")
    p.add_argument("--seed", type=int, default=1, help="model initialisation and data order")
    p.add_argument("--socket", default=None,
                   help="stallfreed socket (default: $STALLFREE_SOCKET, the default socket, "
                        "else a private daemon)")
    p.add_argument("--eval_every", type=int, default=50,
                   help="held-out evaluation every N steps (and at the last step; 0: only then)")
    p.add_argument("--eval_batches", type=int, default=8, help="batches per evaluation")
    p.add_argument("--out_dir", default="torch-out", help="where metrics.csv and loss.png go")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("steps", "batch", "seq_len", "layers", "d_model", "heads", "threads",
                 "eval_batches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1")
    try:
        train(args)
    except RuntimeError as e:
        if not type(e).__module__.startswith("stallfree"):
            raise
        raise SystemExit(f"torch_gpt: {type(e).__name__}: {e}") from None  # stallfree.Error


if __name__ == "__main__":
    main()
