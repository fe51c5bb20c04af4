#!/usr/bin/env python3
"""zenflow_variants: ZenFlow's algorithm and variants of it, in plain PyTorch, against
torch.optim.AdamW on the same model, data and seed: the experiments behind the engine's cold
warm-up and the causes of ZenFlow's own loss spikes (README, "Known behaviour").

    .venv/bin/python bench/zenflow_variants.py [--steps 200] [--lr 3e-3] [--beta2 0.95] \\
        [--seeds 1,2,3] [--variants "NAME;..."]

The model is examples/torch_gpt.py's GPT (4 layers, d_model 128, 0.87M parameters, 8 x 64 bytes a
step, warm-up 10 steps + cosine, clip 1.0, weight decay 0.1 on the linear weights) on the
generated corpus. The optimizer is testing/python/zenflow_reference.py's ReferenceZenFlow (which
the engine equals, tests/python/test_zenflow_reference.py), configured per variant. Per
run: the mean train loss of the last 10 steps, the eval loss, both over AdamW's, and the largest
"own" jump: a step's gradient norm over the median of its previous 10, at steps where AdamW's own
ratio stays below 3, and for ZenFlow variants the hot columns' mean share of the split weights'
gradient mass (sum of grad^2, steps 2 on). A benchmark, not a test: it prints what it measures
(FIGURE lines: the mean over the seeds).
"""
import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "testing" / "python"))
import zenflow_reference as zr  # noqa: E402


def load_example():
    spec = importlib.util.spec_from_file_location("torch_gpt", REPO / "examples" / "torch_gpt.py")
    tg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tg)
    return tg


VARIANTS = {
    # name: ReferenceZenFlow arguments (ratio 0.1; W = warmup_steps, the engine warm-up of exact
    # AdamW steps; cold = cold_warmup, the daemon's lr ramp in rounds)
    "S4 async, W 0, cold 0 (the engine before)": dict(update_interval=4, warmup_steps=0,
                                                      cold_warmup=0),
    "S4 async, W 0, cold 10": dict(update_interval=4, warmup_steps=0, cold_warmup=10),
    "S4 async, W 0, cold 20": dict(update_interval=4, warmup_steps=0, cold_warmup=20),
    "S4 async, W 0, cold auto": dict(update_interval=4, warmup_steps=0, cold_warmup="auto"),
    "S4 async, W 20, cold 0 (the default)": dict(update_interval=4, warmup_steps=20,
                                                 cold_warmup=0),
    "S4 async, W 20, cold lr x2": dict(update_interval=4, warmup_steps=20, cold_lr_scale=2.0),
    "S4 async, W 20, cold lr x4": dict(update_interval=4, warmup_steps=20, cold_lr_scale=4.0),
    "S4 awaited, W 20, cold lr x2": dict(update_interval=4, await_updates=True,
                                         warmup_steps=20, cold_lr_scale=2.0),
    "S4 async, W 40, cold 0": dict(update_interval=4, warmup_steps=40, cold_warmup=0),
    "S4 awaited, W 0, cold 0": dict(update_interval=4, await_updates=True, warmup_steps=0,
                                    cold_warmup=0),
    "S4 awaited, W 0, cold 0, no reselection": dict(update_interval=4, await_updates=True,
                                                    warmup_steps=0, cold_warmup=0,
                                                    select_interval=10**6),
    "S4 awaited, W 20, cold 0": dict(update_interval=4, await_updates=True, warmup_steps=20,
                                     cold_warmup=0),
    "S1 async, W 0 (one step stale)": dict(update_interval=1, warmup_steps=0),
    "S1 async, W 20": dict(update_interval=1, warmup_steps=20),
    "S1 awaited, W 0 (= AdamW)": dict(update_interval=1, await_updates=True, warmup_steps=0),
    # Not ZenFlow: torch.optim.AdamW whose model sees every parameter one step late (the
    # staleness of S1 async on all columns, without hot columns or reselection).
    "AdamW one step stale (all columns)": dict(stale_adamw=True),
    "AdamW one step stale, predicted": dict(stale_adamw=True, predict=True),
    "S1 async, W 20, predicted": dict(update_interval=1, warmup_steps=20, predict_cold=True),
    "S4 async, W 20, predicted": dict(update_interval=4, warmup_steps=20, predict_cold=True),
    "S4 async, W 20, sqrt rule": dict(update_interval=4, warmup_steps=20, sqrt_rule=True),
    "S4 async, W 20, sqrt rule, migrate v": dict(update_interval=4, warmup_steps=20,
                                                 sqrt_rule=True, migrate_v=True),
    "S4 awaited, W 20, sqrt rule": dict(update_interval=4, warmup_steps=20, sqrt_rule=True,
                                        await_updates=True),
    "S4 async, W 20, migrate v": dict(update_interval=4, warmup_steps=20, migrate_v=True),
    "S4 awaited, W 20, cold frozen": dict(update_interval=4, warmup_steps=20, await_updates=True,
                                          cold_lr_scale=0.0),
    "S4 awaited, W 20, cold lr x0.5": dict(update_interval=4, warmup_steps=20,
                                           await_updates=True, cold_lr_scale=0.5),
    "S4 async, W 20, ratio 0.2": dict(update_interval=4, warmup_steps=20, topk_ratio=0.2),
    "S4 async, W 20, ratio 0.3": dict(update_interval=4, warmup_steps=20, topk_ratio=0.3),
    "S4 async, W 20, ratio 0.5": dict(update_interval=4, warmup_steps=20, topk_ratio=0.5),
    "S2 awaited, W 20": dict(update_interval=2, warmup_steps=20, await_updates=True),
    "S4 async, W 20, select snr": dict(update_interval=4, warmup_steps=20, select_by="snr"),
    "S4 async, W 20, sqrt rule, select snr": dict(update_interval=4, warmup_steps=20,
                                                  sqrt_rule=True, select_by="snr"),
}


class StaleAdamW(torch.optim.AdamW):
    """torch.optim.AdamW on fp32 masters that the model sees one step late: the forward of
    step t + 1 uses the masters after the update of step t - 1 (with predict, extrapolated one
    step: 2 * that - the masters after step t - 2)."""

    def __init__(self, params, predict=False, **kw):
        super().__init__(params, **kw)
        self.predict = predict

    @torch.no_grad()
    def step(self, closure=None):
        old = {}
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                master = st.get("master")
                if master is None:
                    master = p.data.clone()
                old[p] = master
                p.data = master.clone()
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["master"] = p.data
                prev = st.get("landed", old[p])
                st["landed"] = old[p]
                p.data = 2 * old[p] - prev if self.predict else old[p]


def hot_share(opt, model):
    """The hot columns' share of the split weights' gradient mass (sum of grad^2) this step."""
    hot = cold = 0.0
    for p in model.parameters():
        sp = opt.state[p].get("split") if p in opt.state else None
        if sp is None or p.grad is None:
            continue
        g2 = (p.grad.reshape(-1, sp.cols) ** 2).sum(0)
        hot += float(g2[sp.hot].sum())
        cold += float(g2[~sp.hot].sum())
    return hot / (hot + cold) if hot + cold > 0 else 0.0


def run(tg, text, make_opt, steps, lr, seed):
    torch.manual_seed(seed)
    model = tg.GPT(256, 128, 4, 4, 64)
    batches = tg.Batches(text, 64, 8, seed, 8)
    opt = make_opt(tg.param_groups(model, 0.1))
    losses, norms, shares = [], [], []
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr * tg.lr_factor(step, steps, 10, 0.1)
        x, y = batches.next()
        opt.zero_grad()
        loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        if isinstance(opt, zr.ReferenceZenFlow) and step > 1:
            shares.append(hot_share(opt, model))
        opt.step()
        losses.append(loss.item())
    if hasattr(opt, "close"):
        opt.close()
    return dict(train=statistics.mean(losses[-10:]), eval=tg.evaluate(model, batches),
                norms=norms, losses=losses, shares=shares)


def jumps(norms):
    return [0.0] * 10 + [norms[i] / statistics.median(norms[i - 10:i])
                         for i in range(10, len(norms))]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--variants", default="", help="semicolon-separated substrings of names")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--curves", default="", help="write each run's losses and norms (JSON) here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    try:
        import stallfree
    except ImportError:
        sys.path.insert(0, str(REPO / "bazel-bin" / "python"))
        import stallfree
    tg = load_example()
    text = stallfree.default_corpus_text()
    seeds = [int(s) for s in args.seeds.split(",")]
    betas = (0.9, args.beta2)
    wanted = [v for v in args.variants.split(";") if v]
    names = [n for n in VARIANTS if not wanted or any(w in n for w in wanted)]
    print(f"zenflow_variants: {args.steps} steps, lr {args.lr}, betas {betas}, seeds {seeds}")
    t0 = time.time()
    table = {n: [] for n in names}
    curves = {}
    for seed in seeds:
        ref = run(tg, text, lambda g: torch.optim.AdamW(g, lr=args.lr, betas=betas, eps=1e-8),
                  args.steps, args.lr, seed)
        ref_j = jumps(ref["norms"])
        for name in names:
            kw = dict(topk_ratio=0.1)
            kw.update(VARIANTS[name])
            if kw.pop("stale_adamw", False):
                make = lambda g: StaleAdamW(g, lr=args.lr, betas=betas, eps=1e-8,
                                            predict=kw.get("predict", False))
            else:
                make = lambda g: zr.ReferenceZenFlow(g, lr=args.lr, betas=betas, eps=1e-8, **kw)
            r = run(tg, text, make, args.steps, args.lr, seed)
            if args.curves:
                import json
                curves[f"{seed} {name}"] = dict(loss=r["losses"], norm=r["norms"])
                curves[f"{seed} AdamW"] = dict(loss=ref["losses"], norm=ref["norms"])
                Path(args.curves).write_text(json.dumps(curves))
            j = jumps(r["norms"])
            own = max((j[i], i + 1) for i in range(len(j)) if ref_j[i] < 3)
            table[name].append((r["train"] / ref["train"], r["eval"] / ref["eval"], own[0]))
            share = (f"  hot share of grad^2 {statistics.mean(r['shares']):.3f}"
                     if r["shares"] else "")
            print(f"  seed {seed}  {name:<42} train {r['train'] / ref['train']:.3f}x  eval "
                  f"{r['eval'] / ref['eval']:.3f}x  own jump {own[0]:6.1f}x at step {own[1]}"
                  f"{share}", flush=True)
    print(f"\n{'variant':<42} {'eval / AdamW':>14} {'worst own jump':>15}   (over {len(seeds)} seeds)")
    for name in names:
        ev = statistics.mean(r[1] for r in table[name])
        jmax = max(r[2] for r in table[name])
        print(f"{name:<42} {ev:14.3f} {jmax:15.1f}")
        key = name.split(" (")[0].replace(",", "").replace(" ", "_").lower()
        print(f"FIGURE zenflow_variant_{key}_eval_vs_adamw {ev:.4f} x")
        print(f"FIGURE zenflow_variant_{key}_max_own_jump {jmax:.1f} x")
    print(f"zenflow_variants: {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
