#!/usr/bin/env python3
"""Fine-tuning a bf16 model with stallfree's ZenFlowAdamW: the fp32 masters are the optimizer's.

    PYTHONPATH=bazel-bin/python .venv/bin/python examples/bf16_finetune.py    # about 25 s
    ... examples/bf16_finetune.py --steps 200 --compare none
    ... examples/bf16_finetune.py --mode sync-offload --socket /run/stallfree/stallfreed.sock

The model is examples/torch_gpt.py's GPT (byte tokens, 4 pre-norm blocks of width 128 by
default, 0.87M parameters). What the script does:

1. Pretraining, in fp32, with torch.optim.AdamW (--pretrain_steps at --pretrain_lr, on the
   project's generated text, stallfree.default_corpus_text(seed=1)): a stand-in for the
   released fp32 checkpoint a fine-tuning job starts from.
2. Fine-tuning in bf16: the pretrained weights, `model.to(torch.bfloat16)` (values and gradients
   in bf16, 2 bytes each), then ZenFlowAdamW(..., mode=--mode) on a shifted text (another
   generated text, seed 2, with its vowels rotated a->e->i->o->u->a, so there is something new
   to learn) for --steps at --lr. That is the whole change a training script needs:

       model = model.to(torch.bfloat16)
       opt = ZenFlowAdamW(model.named_parameters(), lr=3e-4, mode="zenflow")

   ZenFlowAdamW keeps an fp32 master of every bf16 parameter (in zenflow: on the device for the
   hot columns and the 1-D parameters, in stallfreed for the cold columns) and writes the bf16
   value as the master rounded to nearest even after each step, so updates smaller than a bf16
   ulp are not lost. The loss is computed from the logits widened to fp32.
3. The same fine-tuning again from the same weights with ZenFlowAdamW in --compare mode
   (default no-offload: AdamW on the device with fp32 masters, i.e. the usual bf16
   mixed-precision recipe), for the quality comparison. --compare none skips it.

Printed: a line every --log_every steps of each run, the held-out eval loss every --eval_every
steps and at the end, the two fine-tuning runs' eval losses and their ratio, and for each
ZenFlowAdamW run the device bytes per parameter (opt.device_bytes: the model's own bf16 values
and gradients, 4 bytes, plus what the optimizer's engine holds on the device, by category). For
reference, torch.optim.AdamW on an fp32 model holds 4 + 4 + 8 = 16 bytes per parameter on the
device, and the usual bf16 recipe (bf16 values and gradients, fp32 masters, m and v) 2 + 2 + 12 =
16. On a CUDA build with a model on the GPU the same numbers are GPU bytes; on the CPU they are
host bytes the engine would put on the device.

ZenFlowAdamW talks to the stallfreed at --socket, else $STALLFREE_SOCKET, else the node's
default socket, and starts a private daemon when none answers there. bench/torch_bench.py
(part 4) runs this script's pretrain() and finetune() for its bf16 fine-tuning figure.
"""

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.dont_write_bytecode = True  # no __pycache__ in examples/
import torch_gpt as tg  # noqa: E402  (the GPT, its data windows, parameter groups, schedule)

BETAS = tg.BETAS
EPS = tg.EPS
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The categories of ZenFlowAdamW.device_bytes that are not the engine's buffers themselves.
NOT_CATEGORIES = ("engine", "total", "params", "transient_peak")


def build_parser():
    p = argparse.ArgumentParser(
        description="Pretrain a small GPT in fp32, then fine-tune it in bf16 with stallfree's "
                    "ZenFlowAdamW (fp32 masters in the optimizer) on a shifted text; print the "
                    "losses and the device bytes per parameter.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=("zenflow", "sync-offload", "no-offload"), default="zenflow",
                   help="ZenFlowAdamW's mode for the fine-tuning run")
    p.add_argument("--compare", choices=("no-offload", "sync-offload", "zenflow", "none"),
                   default="no-offload",
                   help="a second fine-tuning run from the same weights in this mode, for the "
                        "loss ratio (none: skip it)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                   help="the model's dtype during fine-tuning (fp32: for comparison)")
    p.add_argument("--pretrain_steps", type=int, default=150,
                   help="fp32 pretraining steps (torch.optim.AdamW; 0: fine-tune the random "
                        "initialisation)")
    p.add_argument("--pretrain_lr", type=float, default=3e-3, help="peak lr of pretraining")
    p.add_argument("--steps", type=int, default=60, help="fine-tuning steps")
    p.add_argument("--lr", type=float, default=3e-4, help="peak lr of fine-tuning")
    p.add_argument("--warmup", type=int, default=10,
                   help="linear lr warm-up steps of each phase (then a cosine to 0.1 x the peak)")
    p.add_argument("--weight_decay", type=float, default=0.1,
                   help="AdamW weight decay of the 2-D Linear weights")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--topk_ratio", type=float, default=0.1,
                   help="zenflow: share of each weight's input columns updated on the device")
    p.add_argument("--update_interval", type=int, default=None,
                   help="zenflow: steps per round of the daemon's updates (default: "
                        "ZenFlowAdamW's, automatic)")
    p.add_argument("--warmup_steps", type=int, default=None,
                   help="zenflow: the engine's exact-AdamW warm-up steps (default: "
                        "ZenFlowAdamW's, 100)")
    p.add_argument("--await_updates", action="store_true",
                   help="zenflow: wait for each round's daemon update (no staleness)")
    p.add_argument("--transfers", choices=("auto", "direct", "buffered"), default=None,
                   help="zenflow: how the cold columns cross to the daemon (None: "
                        "ZenFlowAdamW's default, auto: direct on the CPU, buffered on CUDA)")
    p.add_argument("--stream_gradients", action="store_true",
                   help="zenflow: each weight's gradient goes to the engine during the backward "
                        "and is freed (clipped through ZenFlowAdamW.clip_grad_norm_)")
    p.add_argument("--grad_dtype", choices=("bf16", "fp32"), default="bf16",
                   help="the gradients' dtype on their way to the daemon")
    p.add_argument("--param_dtype", choices=("bf16", "fp32"), default="bf16",
                   help="the parameters' dtype on their way back from the daemon")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--d_model", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq_len", type=int, default=64, help="tokens (bytes) per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seed", type=int, default=1, help="initialisation and data order")
    p.add_argument("--eval_every", type=int, default=20,
                   help="held-out evaluation every N fine-tuning steps (and at the last)")
    p.add_argument("--eval_batches", type=int, default=8, help="batches per evaluation")
    p.add_argument("--log_every", type=int, default=10, help="steps between printed lines")
    p.add_argument("--socket", default=None, help="stallfreed's socket; None: "
                   "$STALLFREE_SOCKET, the node's default, else a private daemon")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    return p


# ---- data ----


def pretrain_text():
    sf = tg.import_stallfree()
    return sf.default_corpus_text(seed=1)


def shifted_text():
    """Another generated text (seed 2) with every vowel letter rotated a->e->i->o->u->a (either
    case): the same grammar, new spellings."""
    sf = tg.import_stallfree()
    return sf.default_corpus_text(seed=2).translate(bytes.maketrans(b"aeiouAEIOU",
                                                                    b"eiouaEIOUA"))


def loss_of(model, x, y):
    """Cross-entropy from the logits widened to fp32 (a bf16 loss has 3 significant digits)."""
    logits = model(x).float()
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


@torch.no_grad()
def evaluate(model, batches):
    model.eval()
    total = sum(loss_of(model, x, y).item() for x, y in batches.eval_batches)
    model.train()
    return total / len(batches.eval_batches)


def make_model(args):
    torch.manual_seed(args.seed)
    return tg.GPT(256, args.d_model, args.heads, args.layers, args.seq_len)


def train_loop(args, label, model, opt, batches, steps, quiet=False):
    """steps of warm-up + cosine schedule over opt's groups' lr; returns (train losses,
    {step: eval loss})."""
    base = [g["lr"] for g in opt.param_groups]
    losses, evals = [], {}
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        f = tg.lr_factor(step, steps, args.warmup, 0.1)
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * f
        x, y = batches.next()
        opt.zero_grad(set_to_none=False)
        loss = loss_of(model, x, y)
        loss.backward()
        if args.clip > 0 and hasattr(opt, "clip_grad_norm_"):
            opt.clip_grad_norm_(args.clip)  # ZenFlowAdamW's: streamed gradients included
        elif args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise SystemExit(f"{label}: the loss is {losses[-1]} at step {step}")
        if (args.eval_every > 0 and step % args.eval_every == 0) or step == steps:
            evals[step] = evaluate(model, batches)
        if not quiet and (step % args.log_every == 0 or step == 1 or step == steps):
            ev = f"  eval {evals[step]:.4f}" if step in evals else ""
            print(f"  [{label}] step {step:4d}  loss {losses[-1]:.4f}{ev}  lr "
                  f"{opt.param_groups[0]['lr']:.2e}  {time.monotonic() - t0:5.1f} s", flush=True)
    for g, lr in zip(opt.param_groups, base):
        g["lr"] = lr
    return losses, evals


# ---- the two phases ----


def pretrain(args, quiet=False):
    """fp32 pretraining with torch.optim.AdamW; returns (state_dict, eval loss)."""
    model = make_model(args)
    if args.pretrain_steps <= 0:
        return model.state_dict(), float("nan")
    batches = tg.Batches(pretrain_text(), args.seq_len, args.batch, args.seed, args.eval_batches)
    opt = torch.optim.AdamW(tg.param_groups(model, args.weight_decay), lr=args.pretrain_lr,
                            betas=BETAS, eps=EPS)
    sub = argparse.Namespace(**dict(vars(args), lr=args.pretrain_lr))
    _, evals = train_loop(sub, "pretrain fp32 AdamW", model, opt, batches, args.pretrain_steps,
                          quiet)
    return model.state_dict(), evals[args.pretrain_steps]


def device_bytes_report(opt, model):
    """ZenFlowAdamW.device_bytes per parameter, by category, with the caller's parameters and
    gradients checked against the tensors' own bytes."""
    db = opt.device_bytes
    n = sum(p.numel() for p in model.parameters())
    held = sum(p.numel() * p.element_size() + (0 if p.grad is None else
                                               p.grad.numel() * p.grad.element_size())
               for p in model.parameters())
    if db.get("params") != held:
        raise SystemExit(f"ZenFlowAdamW.device_bytes reports {db.get('params')} bytes of "
                         f"parameters and gradients; the model's tensors hold {held}")
    per = {k: v / n for k, v in db.items()}
    per["categories"] = {k: v / n for k, v in db.items() if k not in NOT_CATEGORIES}
    return per


def finetune(args, state, mode, socket=None, label=None, quiet=False):
    """Fine-tunes the pretrained `state` in args.dtype with ZenFlowAdamW(mode); returns a summary
    (losses, evals, eval_loss, final_loss, device bytes per parameter, seconds)."""
    from stallfree.torch import ZenFlowAdamW
    label = label or f"finetune {args.dtype} {mode}"
    model = make_model(args)
    model.load_state_dict(state)
    model = model.to(DTYPES[args.dtype])
    batches = tg.Batches(shifted_text(), args.seq_len, args.batch, args.seed + 1,
                         args.eval_batches)
    kw = dict(mode=mode, topk_ratio=args.topk_ratio, await_updates=args.await_updates, grad_dtype=args.grad_dtype,
              param_dtype=args.param_dtype, socket=socket if socket is not None else args.socket)
    if args.update_interval is not None:
        kw["update_interval"] = args.update_interval
    if args.warmup_steps is not None:
        kw["warmup_steps"] = args.warmup_steps
    if args.transfers is not None:
        kw["transfers"] = args.transfers
    if args.stream_gradients and mode == "zenflow":
        kw["stream_gradients"] = True
    opt = ZenFlowAdamW(tg.param_groups(model, args.weight_decay, named=True), lr=args.lr,
                       betas=BETAS, eps=EPS, **kw)
    t0 = time.monotonic()
    try:
        before = evaluate(model, batches)
        losses, evals = train_loop(args, label, model, opt, batches, args.steps, quiet)
        per = device_bytes_report(opt, model)
        transfers = getattr(opt, "device_transfers", None) if mode == "zenflow" else None
        opt.flush()  # zenflow: the cold columns brought to the newest daemon update
        flushed = evaluate(model, batches)
    finally:
        opt.close()
    tail = min(10, len(losses))
    return dict(label=label, mode=mode, dtype=args.dtype, losses=losses, evals=evals,
                eval_before=before, eval_loss=evals[args.steps], eval_flushed=flushed,
                final_loss=sum(losses[-tail:]) / tail, device_bytes=per, transfers=transfers,
                params=sum(p.numel() for p in model.parameters()),
                seconds=time.monotonic() - t0,
                dtypes=sorted({str(p.dtype) for p in model.parameters()}))


def print_device_bytes(r):
    per = r["device_bytes"]
    cats = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per["categories"].items()))
    how = f" (transfers {r['transfers']})" if r.get("transfers") else ""
    print(f"{r['label']}{how}: device bytes per parameter {per['total']:.2f} = the model's "
          f"values and gradients {per['params']:.2f} + the engine's {per['engine']:.2f} ({cats}; "
          f"largest transient {per.get('transient_peak', 0):.2f})")


def main(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("steps", "batch", "seq_len", "layers", "d_model", "heads", "threads",
                 "eval_batches", "log_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1")
    tg.import_stallfree()
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    n = sum(p.numel() for p in make_model(args).parameters())
    print(f"GPT: {args.layers} layers, d_model {args.d_model}, {n:,} parameters; pretraining "
          f"{args.pretrain_steps} steps in fp32 (torch.optim.AdamW), then fine-tuning "
          f"{args.steps} steps in {args.dtype} with ZenFlowAdamW on a shifted text", flush=True)
    state, pre_eval = pretrain(args)
    print(f"pretraining: eval loss {pre_eval:.4f}", flush=True)
    runs = [finetune(args, state, args.mode)]
    if args.compare != "none":
        runs.append(finetune(args, state, args.compare))
    print()
    for r in runs:
        print(f"{r['label']}: parameters {', '.join(r['dtypes'])}; eval loss {r['eval_before']:.4f}"
              f" -> {r['eval_loss']:.4f} ({r['eval_flushed']:.4f} after flush()), train loss "
              f"(mean of the last 10 steps) {r['final_loss']:.4f}, {r['seconds']:.1f} s")
    for r in runs:
        print_device_bytes(r)
    print("for reference: torch.optim.AdamW on an fp32 model holds 4 + 4 + 8 = 16 bytes per "
          "parameter, the bf16 mixed-precision recipe 2 + 2 + 12 = 16")
    if len(runs) == 2:
        a, b = runs
        print(f"eval loss {a['mode']} / {b['mode']}: {a['eval_loss'] / b['eval_loss']:.4f}")
    print(f"total {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
