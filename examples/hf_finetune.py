#!/usr/bin/env python3
"""Hugging Face fine-tuning with stallfree: ZenFlowAdamW against torch.optim.AdamW.

    PYTHONPATH=bazel-bin/python .venv/bin/python examples/hf_finetune.py
    ... examples/hf_finetune.py --model gpt2 --finetune_data README.md --out_dir /tmp/ft
    ... examples/hf_finetune.py --mode sync-offload --socket /run/stallfree/stallfreed.sock

1. Pretraining: a small transformers LlamaForCausalLM (or GPT2LMHeadModel with --model gpt2)
   from a random initialisation, on the bytes (vocab 256) of the project's generated English-like
   text, stallfree.default_corpus_text(seed=1), for --pretrain_steps with the Trainer's own
   optimizer (torch.optim.AdamW). The weights go to --out_dir/pretrained (save_pretrained).
2. Fine-tuning, twice from those same weights, on another text (--finetune_data FILE, read as
   bytes; by default another generated text, stallfree.default_corpus_text(seed=2)): with
   stallfree.torch.ZenFlowAdamW (--mode, default "zenflow" with its defaults: 100 steps of
   exact AdamW, then the top 10% of each weight's input columns by gradient norm updated at
   once and the rest by stallfreed in the shortest round the node hides, a round of one step
   landed predicted a step ahead) and with torch.optim.AdamW, both handed to the Trainer as
   `Trainer(optimizers=(optimizer, scheduler))`, with the Trainer's parameter groups (weight
   decay on the weight matrices, none on biases and norms), the same learning rate, betas,
   epsilon and cosine schedule, the same data order and seed.

Every phase holds out the last 10% of its text: the evaluation loss on it is measured every
--eval_every steps. Printed: a line every --log_every steps of each run, then the two fine-tuning
runs side by side and a summary. Written to --out_dir: losses.csv (phase, optimizer, step,
train_loss, eval_loss, learning_rate; every step) and losses.png (matplotlib). ZenFlowAdamW
talks to the stallfreed at --socket, else $STALLFREE_SOCKET, else the node's default socket,
and starts a private daemon when none answers there.

The defaults run in about 30 s on 2 CPU cores (measured 27-31 s on a busy machine).

What to expect (measured; eval loss after the 150 fine-tuning steps, ZenFlowAdamW vs AdamW):
pretraining ends at an eval loss of 1.41; fine-tuning reaches 1.2010 with ZenFlowAdamW's
defaults and 1.2008 with AdamW (+0.02%; the curves lie on top of each other in losses.png;
--model gpt2: 2.0108 and 2.0104, +0.02%). The defaults' first 100 steps are exact AdamW, so
here most of the run is: with --warmup_steps 20 the rounds (of one step here) start at step
21 and the gap is +1.72%. Before the automatic round, the 100-step warm-up and the prediction
(S = 4 after 20 steps) it was +8.2% (GPT-2 +2.2%); --update_interval 1 --await_updates (no
staleness) gives AdamW's 1.2007, --mode sync-offload 1.2009.
"""

import argparse
import csv
import inspect
import math
import os
import sys
import time
from pathlib import Path


os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("WANDB_DISABLED", "true")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.dont_write_bytecode = True  # no __pycache__ in examples/
from torch_gpt import import_stallfree  # noqa: E402  (installed, else <repo>/bazel-bin/python)


def build_parser():
    p = argparse.ArgumentParser(
        description="Pretrain a small Llama/GPT-2 briefly, then fine-tune it on another text "
                    "with stallfree's ZenFlowAdamW and with torch.optim.AdamW; print and plot "
                    "both losses.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("llama", "gpt2"), default="llama",
                   help="LlamaForCausalLM or GPT2LMHeadModel (no dropout), random init")
    p.add_argument("--d_model", type=int, default=64, help="hidden size")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq_len", type=int, default=64, help="tokens (bytes) per sample")
    p.add_argument("--batch", type=int, default=16, help="samples per step")
    p.add_argument("--pretrain_steps", type=int, default=300, help="pretraining steps")
    p.add_argument("--pretrain_lr", type=float, default=3e-3, help="peak lr of pretraining")
    p.add_argument("--finetune_steps", type=int, default=150, help="fine-tuning steps")
    p.add_argument("--finetune_lr", type=float, default=1e-3, help="peak lr of fine-tuning")
    p.add_argument("--finetune_data", default=None,
                   help="the fine-tuning text (a file read as bytes); None: "
                        "stallfree.default_corpus_text(seed=2)")
    p.add_argument("--text_bytes", type=int, default=400_000,
                   help="bytes of each generated text")
    p.add_argument("--weight_decay", type=float, default=0.1,
                   help="decoupled weight decay of the weight matrices")
    p.add_argument("--warmup", type=int, default=10, help="learning-rate warm-up steps")
    p.add_argument("--eval_every", type=int, default=25, help="steps between evaluations")
    p.add_argument("--eval_batches", type=int, default=8,
                   help="batches of held-out text per evaluation")
    p.add_argument("--log_every", type=int, default=10, help="steps between printed lines")
    p.add_argument("--mode", choices=("zenflow", "sync-offload", "no-offload"), default="zenflow",
                   help="ZenFlowAdamW's mode")
    p.add_argument("--topk_ratio", type=float, default=0.1,
                   help="ZenFlowAdamW: share of hot columns")
    p.add_argument("--update_interval", type=lambda x: x if x == "auto" else int(x),
                   default="auto", help="ZenFlowAdamW: steps per round of the daemon's updates "
                   "(auto: the shortest the node hides, ZenFlowAdamW's default)")
    p.add_argument("--warmup_steps", type=int, default=None,
                   help="ZenFlowAdamW: first steps of exact AdamW (default: ZenFlowAdamW's)")
    p.add_argument("--await_updates", action="store_true",
                   help="ZenFlowAdamW: wait for each round's daemon update (no staleness)")
    p.add_argument("--socket", default=None, help="stallfreed's socket; None: "
                   "$STALLFREE_SOCKET, the node's default, else a private daemon")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (1 is fastest for this size on 2 cores)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    p.add_argument("--out_dir", default="torch-out/hf_finetune",
                   help="where losses.csv, losses.png and the pretrained model go")
    return p


# ---- data ----


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive windows of seq_len bytes: input_ids == labels (the model shifts them)."""

    def __init__(self, data, seq_len):
        n = len(data) // seq_len
        if n < 1:
            raise SystemExit(f"the text has {len(data)} bytes, less than one window of {seq_len}")
        t = torch.frombuffer(bytearray(data[:n * seq_len]), dtype=torch.uint8).long()
        self.rows = t.view(n, seq_len)

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def split(text, args):
    """(train, eval) datasets: the first 90% and the last 10% of the text (at most
    --eval_batches batches of it)."""
    cut = int(len(text) * 0.9)
    held_out = text[cut:cut + args.eval_batches * args.batch * args.seq_len]
    return ByteWindows(text[:cut], args.seq_len), ByteWindows(held_out, args.seq_len)


# ---- model ----


def make_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(args.seed)
    if args.model == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
            num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.heads, max_position_embeddings=args.seq_len,
            tie_word_embeddings=False))
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=256, n_positions=args.seq_len, n_embd=args.d_model, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def param_groups(model, weight_decay):
    """The two groups Trainer.create_optimizer builds: weight decay on what
    Trainer.get_decay_parameter_names names (weight matrices, embeddings), none on the rest
    (biases, norms). (name, tensor) pairs: ZenFlowAdamW names the parameters in its messages."""
    from transformers import Trainer
    decay = set(Trainer.get_decay_parameter_names(None, model))  # (it does not use self)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [(n, p) for n, p in named if n in decay], "weight_decay": weight_decay},
            {"params": [(n, p) for n, p in named if n not in decay], "weight_decay": 0.0}]


def unnamed(groups):
    return [dict(g, params=[p for _, p in g["params"]]) for g in groups]


# ---- training ----


def training_args(args, out_dir, steps, lr):
    from transformers import TrainingArguments
    return TrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, learning_rate=lr,
        weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        lr_scheduler_type="cosine", warmup_steps=args.warmup, max_grad_norm=1.0,
        logging_steps=1, eval_strategy="steps", eval_steps=args.eval_every,
        save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
        seed=args.seed, data_seed=args.seed, disable_tqdm=True)


def run(args, label, model, train_set, eval_set, steps, lr, optimizers=(None, None)):
    """One Trainer run; returns its rows {step: {...}} for the CSV."""
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    class Progress(TrainerCallback):
        def __init__(self):
            self.start = time.monotonic()

        def on_log(self, a, state, control, logs=None, **kw):
            s = state.global_step
            if "eval_loss" in logs:
                print(f"  [{label}] step {s:4d}  eval loss {logs['eval_loss']:.4f}")
            elif "loss" in logs and (s % args.log_every == 0 or s == 1):
                print(f"  [{label}] step {s:4d}  loss {logs['loss']:.4f}  lr "
                      f"{logs.get('learning_rate', 0):.2e}  "
                      f"{time.monotonic() - self.start:6.1f} s", flush=True)

    trainer = Trainer(model=model, args=training_args(args, os.path.join(args.out_dir, "runs",
                                                                         label), steps, lr),
                      train_dataset=train_set, eval_dataset=eval_set, optimizers=optimizers,
                      callbacks=[Progress()])
    trainer.remove_callback(PrinterCallback)
    before = trainer.evaluate()["eval_loss"]
    print(f"{label}: evaluation before training: loss {before:.4f}")
    trainer.train()  # (a new TrainerState: its log_history starts here)
    rows = {0: {"step": 0, "eval_loss": before}}
    for e in trainer.state.log_history:
        row = rows.setdefault(e["step"], {"step": e["step"]})
        if "loss" in e:
            row["train_loss"] = e["loss"]
            row["learning_rate"] = e.get("learning_rate")
        if "eval_loss" in e:
            row["eval_loss"] = e["eval_loss"]
    return rows, trainer


def finetune_text(args, sf):
    if args.finetune_data:
        with open(args.finetune_data, "rb") as f:
            return f.read(), args.finetune_data
    return (sf.default_corpus_text(approx_bytes=args.text_bytes, seed=2),
            "stallfree.default_corpus_text(seed=2)")


def mean_tail(rows, key, n=10):
    vals = [r[key] for _, r in sorted(rows.items()) if key in r][-n:]
    return sum(vals) / len(vals) if vals else math.nan


def write_csv(path, runs):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["phase", "optimizer", "step", "train_loss", "eval_loss", "learning_rate"])
        for (phase, opt), rows in runs.items():
            for step, r in sorted(rows.items()):
                w.writerow([phase, opt, step, r.get("train_loss", ""), r.get("eval_loss", ""),
                            r.get("learning_rate", "")])


def plot(path, runs, title, warmup_end=None):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    styles = {"AdamW": dict(color="tab:blue"), "ZenFlowAdamW": dict(color="tab:red"),
              "Trainer AdamW": dict(color="tab:gray")}
    offset = 0
    pre = runs.get(("pretrain", "Trainer AdamW"), {})
    if pre:
        offset = max(pre)
    for (phase, opt), rows in runs.items():
        steps = sorted(s for s in rows if "train_loss" in rows[s])
        evals = sorted(s for s in rows if "eval_loss" in rows[s])
        shift = 0 if phase == "pretrain" else offset
        style = styles.get(opt, {})
        for ax in (axes[0],) + ((axes[1],) if phase == "finetune" else ()):
            s0 = shift if ax is axes[0] else 0
            ax.plot([s + s0 for s in steps], [rows[s]["train_loss"] for s in steps],
                    alpha=0.5, lw=1, label=f"{phase} {opt} (train)", **style)
            ax.plot([s + s0 for s in evals], [rows[s]["eval_loss"] for s in evals], "o-",
                    lw=2, label=f"{phase} {opt} (eval)", **style)
    axes[0].axvline(offset, color="k", ls=":", lw=1)
    if warmup_end:
        axes[1].axvline(warmup_end, color="tab:red", ls=":", lw=1)
        axes[1].annotate(" ZenFlow warm-up ends", (warmup_end, 1), va="top", fontsize=8,
                         xycoords=("data", "axes fraction"), color="tab:red")
    axes[0].set_title("pretraining, then fine-tuning")
    axes[1].set_title("fine-tuning: ZenFlowAdamW vs AdamW")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""


def main(argv=None):
    args = build_parser().parse_args(argv)
    sf = import_stallfree()
    from stallfree.torch import ZenFlowAdamW
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    transformers.logging.set_verbosity_error()
    t0 = time.monotonic()
    runs = {}

    # 1. Pretraining with the Trainer's own AdamW.
    pre_text = sf.default_corpus_text(approx_bytes=args.text_bytes, seed=1)
    pre_train, pre_eval = split(pre_text, args)
    model = make_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.model}, {n_params:,} parameters; pretraining {args.pretrain_steps} "
          f"steps on stallfree.default_corpus_text(seed=1) ({len(pre_text):,} bytes)")
    rows, trainer = run(args, "pretrain", model, pre_train, pre_eval, args.pretrain_steps,
                        args.pretrain_lr)
    runs[("pretrain", "Trainer AdamW")] = rows
    pretrained = os.path.join(args.out_dir, "pretrained")
    trainer.save_model(pretrained)
    del trainer, model

    # 2. Fine-tuning from the same weights with ZenFlowAdamW and with AdamW.
    text, what = finetune_text(args, sf)
    ft_train, ft_eval = split(text, args)
    print(f"fine-tuning {args.finetune_steps} steps on {what} ({len(text):,} bytes) from "
          f"{pretrained}")
    zen_kw = dict(mode=args.mode, topk_ratio=args.topk_ratio,
                  update_interval=args.update_interval, await_updates=args.await_updates,
                  socket=args.socket)
    if args.warmup_steps is not None:
        zen_kw["warmup_steps"] = args.warmup_steps
    zen_round = None
    for name in ("ZenFlowAdamW", "AdamW"):
        model = AutoModelForCausalLM.from_pretrained(pretrained)
        groups = param_groups(model, args.weight_decay)
        if name == "ZenFlowAdamW":
            opt = ZenFlowAdamW(groups, lr=args.finetune_lr, betas=(0.9, 0.999), eps=1e-8,
                               **zen_kw)
        else:
            opt = torch.optim.AdamW(unnamed(groups), lr=args.finetune_lr, betas=(0.9, 0.999),
                                    eps=1e-8)
        sched = transformers.get_cosine_schedule_with_warmup(opt, args.warmup,
                                                             args.finetune_steps)
        try:
            rows, _ = run(args, f"finetune {name}", model, ft_train, ft_eval,
                          args.finetune_steps, args.finetune_lr, optimizers=(opt, sched))
        finally:
            if hasattr(opt, "close"):
                if name == "ZenFlowAdamW":
                    zen_round = opt.last_timings.get("interval")
                opt.close()
        runs[("finetune", name)] = rows

    # Results.
    zen, ref = runs[("finetune", "ZenFlowAdamW")], runs[("finetune", "AdamW")]
    print(f"\nfine-tuning, {args.model}: ZenFlowAdamW ({args.mode}) vs torch.optim.AdamW")
    print(f"{'step':>5}  {'ZenFlowAdamW':>12}  {'AdamW':>12}  {'eval Zen':>9}  {'eval AdamW':>10}")
    for step in sorted(ref):
        if step % args.log_every and step > 1 and "eval_loss" not in ref[step]:
            continue
        z, r = zen.get(step, {}), ref[step]

        def fmt(row, key, width):
            return f"{row[key]:{width}.4f}" if key in row else " " * width
        print(f"{step:5d}  {fmt(z, 'train_loss', 12)}  {fmt(r, 'train_loss', 12)}  "
              f"{fmt(z, 'eval_loss', 9)}  {fmt(r, 'eval_loss', 10)}")
    csv_path = os.path.join(args.out_dir, "losses.csv")
    png_path = os.path.join(args.out_dir, "losses.png")
    write_csv(csv_path, runs)
    why = plot(png_path, runs, f"{args.model} ({n_params:,} parameters): fine-tuning with "
               f"ZenFlowAdamW ({args.mode}) vs torch.optim.AdamW",
               warmup_end=(zen_kw.get("warmup_steps", inspect.signature(ZenFlowAdamW)
                                      .parameters["warmup_steps"].default)
                           if args.mode == "zenflow" else None))
    last_eval = last_step_with(ref, "eval_loss")
    ze, re_ = zen[last_eval]["eval_loss"], ref[last_eval]["eval_loss"]
    pre = runs[("pretrain", "Trainer AdamW")]
    print(f"\npretraining: eval loss {pre[last_step_with(pre, 'eval_loss')]['eval_loss']:.4f} "
          f"at step {last_step_with(pre, 'eval_loss')}")
    print(f"fine-tuning, mean train loss of the last 10 steps: ZenFlowAdamW "
          f"{mean_tail(zen, 'train_loss'):.4f}, AdamW {mean_tail(ref, 'train_loss'):.4f}")
    print(f"fine-tuning, eval loss at step {last_eval}: ZenFlowAdamW {ze:.4f}, AdamW {re_:.4f} "
          f"({100 * (ze - re_) / re_:+.2f}%)")
    if args.mode == "zenflow" and zen_round:
        print(f"ZenFlowAdamW's rounds at the end: {zen_round} step(s) (update_interval "
              f"{args.update_interval})")
    print(f"wrote {csv_path}" + (f" and {png_path}" if not why else f" ({why})"))
    print(f"total {time.monotonic() - t0:.1f} s")


def last_step_with(rows, key):
    return max(s for s in rows if key in rows[s])


if __name__ == "__main__":
    main()
