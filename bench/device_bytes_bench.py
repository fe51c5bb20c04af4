#!/usr/bin/env python3
"""device_bytes_bench: the device bytes a parameter costs with ZenFlowAdamW, by mode and dtype.

    PYTHONPATH=bazel-bin/python .venv/bin/python bench/device_bytes_bench.py     # about 30 s
    ... bench/device_bytes_bench.py --models linear --option some_new_option=true
    ... bench/device_bytes_bench.py --variant 'zenflow_s1:{"mode": "zenflow", "update_interval": 1}'

A benchmark, not a test: it prints what the engine reports, whatever it is, except that it fails
(exit status 1) when the engine's account of the caller's tensors is not what those tensors hold.

Models (each in bf16, `model.to(torch.bfloat16)`, and in fp32):
- linear: three width x width weights (--width 1024: 3.15M parameters), nn.Linear without bias,
  Tanh between them, a mean-squared loss; the model of README's "Device bytes per parameter"
  and of tests/engine/zenflow_bf16_test.
- gpt2: a transformers GPT2LMHeadModel built from a config (random initialisation, nothing
  downloaded: vocab 256, --gpt2_layers blocks of width --gpt2_d_model; tied embeddings,
  LayerNorms and biases, which stay wholly on the device), trained on byte tokens of the
  project's generated text.

Runs: ZenFlowAdamW in every mode of MODES (topk_ratio 0.1, update_interval 4, bf16 transfers,
warmup_steps 0 so that the steps are ZenFlow steps; the engine allocates its buffers when it is
built, so the figure does not depend on that): zenflow with its defaults (transfers "auto":
direct on the CPU, buffered on CUDA; the table says which), zenflow with transfers "direct" and
"buffered" and with stream_gradients=True, sync-offload and no-offload; plus --variant runs, and
two torch references computed from what torch allocates (the bytes of every tensor of the
parameters, their gradients and the optimizer's state):
- torch.optim.AdamW on the fp32 model: 4 (value) + 4 (gradient) + 8 (exp_avg, exp_avg_sq);
- the usual bf16 mixed-precision recipe: the bf16 model (2 + 2) and torch.optim.AdamW over fp32
  master copies (4 + 8); the masters' fp32 gradients exist only inside the step (each master's
  gradient is the model's widened, freed after the step: the transient column).

Each run takes --steps steps (forward, backward, step; by default 20, past the first reselection
at step 16), then reads ZenFlowAdamW.device_bytes (the engine's buffers by category, "params":
the caller's values and gradients, "transient_peak": the largest transient buffer one call held,
not in the total) while the gradients still exist. Checked (the bench exits 1 otherwise):
"params" equals the sum of the model's parameter and gradient tensor bytes, and "total" equals
"params" + "engine". Printed: a table per model (bytes per parameter: total, the caller's
parameters and gradients, then every category the engine reports, so a new category shows up as
a new column), and `FIGURE <name> <value> <unit>` lines:
- device_bytes_per_param_<mode>_<dtype> (linear) and device_bytes_per_param_gpt2_<mode>_<dtype>:
  the engine's bytes + the caller's parameters and gradients, over the parameter count;
- device_bytes_per_param_<mode>_<dtype>_<category> (linear): the breakdown;
- device_bytes_per_param[_gpt2]_torch_adamw_fp32 and ..._torch_mixed_bf16: the references;
- device_bytes_zenflow_bf16_over_torch_mixed_bf16[_gpt2];
- device_bytes_per_param[_gpt2]_zenflow_bf16_streamed: streamed gradients, what stays on the
  device plus one weight's gradient in flight (the largest: the engine's transient_peak);
- zenflow_step_ms_{direct,buffered}_{bf16,fp32} and zenflow_step_direct_over_buffered_*: what
  the transfers cost in time (step_times: 5 weights of 2048 x 2048, opt.step medians).

Adding a mode: a line in MODES (figure key, label, ZenFlowAdamW keywords), or --variant
'KEY:{json keywords}' on the command line. --option KEY=VALUE adds a keyword to every
ZenFlowAdamW run (a new engine option, say).
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
try:  # PYTHONPATH's stallfree, else the Bazel-built package of this checkout
    import stallfree  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(ROOT, "bazel-bin", "python"))
import stallfree  # noqa: E402
from stallfree.torch import ZenFlowAdamW  # noqa: E402

MODES = [  # (figure key, label, ZenFlowAdamW keywords)
    ("zenflow", "zenflow", dict(mode="zenflow")),
    ("zenflow_direct", "zenflow direct", dict(mode="zenflow", transfers="direct")),
    ("zenflow_buffered", "zenflow buffered", dict(mode="zenflow", transfers="buffered")),
    ("zenflow_streamed", "zenflow streamed grads", dict(mode="zenflow", stream_gradients=True)),
    ("sync_offload", "sync-offload", dict(mode="sync-offload")),
    ("no_offload", "no-offload", dict(mode="no-offload")),
]
DTYPES = [("bf16", torch.bfloat16), ("fp32", torch.float32)]
COMMON = dict(lr=1e-4, topk_ratio=0.1, update_interval=4, warmup_steps=0, weight_decay=0.01)
# device_bytes keys that are not categories of the engine's buffers.
NOT_CATEGORIES = ("engine", "total", "params", "transient_peak")
TARGET_ZENFLOW_BF16 = 5.3  # issue 22: the bf16 model plus the hot share's state


class Failure(Exception):
    pass


def figure(name, value, unit):
    print(f"FIGURE {name} {value:.4g} {unit}", flush=True)


def tensor_bytes(t):
    return 0 if t is None else t.numel() * t.element_size()


def params_and_grads_bytes(model):
    return sum(tensor_bytes(p) + tensor_bytes(p.grad) for p in model.parameters())


# ---- models ----


class Linear3:
    def __init__(self, args):
        self.width, self.weights = args.width, args.linear_weights
        self.title = (f"{args.linear_weights} {args.width} x {args.width} weights (nn.Linear, "
                      "no bias)")
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(16, args.width, generator=gen)
        self.target = torch.randn(16, args.width, generator=gen)

    def make(self, dtype):
        torch.manual_seed(0)
        w = self.width
        layers = []
        for i in range(self.weights):
            layers += [torch.nn.Linear(w, w, bias=False)] + ([torch.nn.Tanh()]
                                                             if i + 1 < self.weights else [])
        return torch.nn.Sequential(*layers).to(dtype)

    def loss(self, model, step):
        dtype = next(model.parameters()).dtype
        out = model(self.x.to(dtype)).float()
        return (out - self.target).pow(2).mean()


class GPT2:
    SEQ, BATCH = 32, 4  # few tokens: the bytes do not depend on them

    def __init__(self, args):
        from transformers import GPT2Config
        self.config = GPT2Config(vocab_size=256, n_positions=self.SEQ, n_embd=args.gpt2_d_model,
                                 n_layer=args.gpt2_layers, n_head=args.gpt2_heads,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.title = (f"transformers GPT2LMHeadModel from a config: {args.gpt2_layers} blocks, "
                      f"n_embd {args.gpt2_d_model}, vocab 256 (byte tokens), tied embeddings")
        data = torch.frombuffer(bytearray(stallfree.default_corpus_text(approx_bytes=1 << 18)),
                                dtype=torch.uint8).long()
        n = len(data) // self.SEQ
        self.rows = data[:n * self.SEQ].view(n, self.SEQ)

    def make(self, dtype):
        from transformers import GPT2LMHeadModel
        torch.manual_seed(0)
        return GPT2LMHeadModel(self.config).to(dtype)

    def loss(self, model, step):
        ids = self.rows[(step * self.BATCH) % (len(self.rows) - self.BATCH):][:self.BATCH]
        logits = model(input_ids=ids).logits.float()
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256),
                                                 ids[:, 1:].reshape(-1))


MODELS = {"linear": ("", Linear3), "gpt2": ("_gpt2", GPT2)}


# ---- runs ----


def train(spec, model, opt, steps, before_step=None):
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        spec.loss(model, step).backward()
        if before_step:
            before_step()
        opt.step()


def engine_run(spec, dtype, kwargs, steps, socket):
    """ZenFlowAdamW on the model in dtype: bytes by category (the engine's device_bytes)."""
    model = spec.make(dtype)
    opt = ZenFlowAdamW(model.named_parameters(), socket=socket, **kwargs)
    try:
        train(spec, model, opt, steps)
        db = dict(opt.device_bytes)
        transfers = getattr(opt, "device_transfers", None)
    finally:
        opt.close()
    held = params_and_grads_bytes(model)
    if db.get("params") != held:
        raise Failure(f"the engine reports {db.get('params')} bytes of parameters and gradients; "
                      f"the model's tensors hold {held} ({kwargs}, {dtype})")
    if db.get("total") != db["params"] + db.get("engine", 0):
        raise Failure(f"device_bytes total {db.get('total')} != params {db['params']} + engine "
                      f"{db.get('engine')} ({kwargs}, {dtype})")
    cats = {k: v for k, v in db.items() if k not in NOT_CATEGORIES}
    note = ""
    if sum(cats.values()) != db.get("engine", 0):
        note = (f"the categories {sorted(cats)} sum to {sum(cats.values())}, the engine's total "
                f"is {db.get('engine')}")
    return dict(total=db["total"], params=db["params"], cats=cats, transfers=transfers,
                transient=db.get("transient_peak", 0), note=note,
                n=sum(p.numel() for p in model.parameters()))


def torch_adamw_run(spec, steps):
    """torch.optim.AdamW on the fp32 model: what torch holds after the steps."""
    model = spec.make(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), **{k: COMMON[k] for k in ("lr", "weight_decay")})
    train(spec, model, opt, steps)
    moments = sum(tensor_bytes(v) for st in opt.state.values() for k, v in st.items()
                  if k in ("exp_avg", "exp_avg_sq"))
    other = sum(tensor_bytes(v) for st in opt.state.values() for k, v in st.items()
                if torch.is_tensor(v) and k not in ("exp_avg", "exp_avg_sq"))
    params = params_and_grads_bytes(model)
    return dict(total=params + moments + other, params=params,
                cats={"moments": moments, "other state": other}, transient=0, note="",
                n=sum(p.numel() for p in model.parameters()))


class MasterAdamW(torch.optim.AdamW):
    """The bf16 mixed-precision recipe: torch.optim.AdamW over fp32 master copies of the bf16
    model's parameters; each step widens the model's bf16 gradients into the masters' .grad,
    steps, rounds the masters into the model and frees the masters' gradients."""

    def __init__(self, model_params, **kw):
        self.model_params = list(model_params)
        self.masters = [p.detach().float().clone() for p in self.model_params]
        super().__init__(self.masters, **kw)
        self.peak = 0

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in zip(self.model_params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.peak = max(self.peak, sum(tensor_bytes(m.grad) for m in self.masters))
        super().step()
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)  # round to nearest even
            m.grad = None


def torch_mixed_run(spec, steps):
    model = spec.make(torch.bfloat16)
    opt = MasterAdamW(model.parameters(), **{k: COMMON[k] for k in ("lr", "weight_decay")})
    train(spec, model, opt, steps)
    masters = sum(tensor_bytes(m) + tensor_bytes(m.grad) for m in opt.masters)
    moments = sum(tensor_bytes(v) for st in opt.state.values() for k, v in st.items()
                  if k in ("exp_avg", "exp_avg_sq"))
    other = sum(tensor_bytes(v) for st in opt.state.values() for k, v in st.items()
                if torch.is_tensor(v) and k not in ("exp_avg", "exp_avg_sq"))
    params = params_and_grads_bytes(model)
    return dict(total=params + masters + moments + other, params=params,
                cats={"masters": masters, "moments": moments, "other state": other},
                transient=opt.peak, note="", n=sum(p.numel() for p in model.parameters()))


def print_table(title, n, steps, rows):
    cats = []
    for _, r in rows:
        cats += [c for c in r["cats"] if c not in cats]
    print(f"\n{title}: {n:,} parameters; bytes per parameter after {steps} steps")
    head = f"{'run':<50} {'total':>7} {'params+grads':>13}" + "".join(
        f" {c:>{max(len(c), 9)}}" for c in cats) + f" {'transient':>10}"
    print(head)
    for label, r in rows:
        line = f"{label:<50} {r['total'] / n:7.2f} {r['params'] / n:13.2f}"
        for c in cats:
            w = max(len(c), 9)
            line += f" {r['cats'][c] / n:{w}.2f}" if c in r["cats"] else f" {'-':>{w}}"
        print(line + f" {r['transient'] / n:10.2f}")
        if r["note"]:
            print(f"  NOTE ({label}): {r['note']}")
    print("(total = params+grads + the categories; params+grads: the caller's values and "
          "gradients; transient: the largest transient, not in the total: the engine's "
          "transient_peak, the recipe's fp32 master gradients inside a step)", flush=True)


def parse_value(text):
    try:
        return json.loads(text)
    except ValueError:
        return text


def step_times(socket, weights, width, steps):
    """What the transfers cost in time: opt.step() of zenflow direct against buffered (bf16 and
    fp32; `weights` weights of width x width, fixed random gradients, warm-up 0), the runs
    stepping in alternation with a pause before each step so one run's background work does not
    land in another's timing. Medians of `steps` timed steps after two untimed ones."""
    runs = {}
    for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for how in ("direct", "buffered"):
            torch.manual_seed(0)
            ps = [torch.nn.Parameter(torch.randn(width, width, dtype=dtype) * 0.02)
                  for _ in range(weights)]
            gs = [torch.randn(width, width, dtype=dtype) * 1e-3 for _ in range(weights)]
            opt = ZenFlowAdamW(ps, lr=1e-4, warmup_steps=0, transfers=how, socket=socket)
            runs[(dname, how)] = (opt, ps, gs, [])
    try:
        for it in range(steps + 2):
            order = list(runs.items())
            order = order[it % len(order):] + order[:it % len(order)]
            for _, (opt, ps, gs, times) in order:
                for p_, g in zip(ps, gs):
                    p_.grad = g.clone()
                time.sleep(0.05)
                t0 = time.perf_counter()
                opt.step()
                if it >= 2:
                    times.append(time.perf_counter() - t0)
    finally:
        for opt, _, _, _ in runs.values():
            opt.close()
    print(f"\nopt.step() of zenflow, {weights} weights of {width} x {width}, median of {steps}:")
    for dname in ("bf16", "fp32"):
        ms = {how: statistics.median(runs[(dname, how)][3]) * 1e3 for how in ("direct", "buffered")}
        figure(f"zenflow_step_ms_direct_{dname}", ms["direct"], "ms")
        figure(f"zenflow_step_ms_buffered_{dname}", ms["buffered"], "ms")
        figure(f"zenflow_step_direct_over_buffered_{dname}", ms["direct"] / ms["buffered"], "x")


def main():
    p = argparse.ArgumentParser(
        description="Device bytes per parameter of ZenFlowAdamW by mode and dtype (the engine's "
                    "footprint by category plus the caller's parameters and gradients), against "
                    "torch.optim.AdamW and the bf16 mixed-precision recipe. Prints FIGURE lines.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="linear,gpt2", help="comma-separated: linear, gpt2")
    p.add_argument("--steps", type=int, default=20, help="steps before the bytes are read")
    p.add_argument("--width", type=int, default=1024, help="linear: the weights' width")
    p.add_argument("--linear_weights", type=int, default=3, help="linear: how many weights")
    p.add_argument("--gpt2_layers", type=int, default=4)
    p.add_argument("--gpt2_d_model", type=int, default=256)
    p.add_argument("--gpt2_heads", type=int, default=4)
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a ZenFlowAdamW keyword for every engine run (VALUE as JSON, else a "
                        "string); repeatable")
    p.add_argument("--variant", action="append", default=[], metavar="KEY:JSON",
                   help="another engine run: figure key and its ZenFlowAdamW keywords, e.g. "
                        "'zenflow_s1:{\"mode\": \"zenflow\", \"update_interval\": 1}'; repeatable")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--step_time_steps", type=int, default=16,
                   help="timed steps of the direct-vs-buffered step time (0: skip it)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    options = {}
    for o in args.option:
        key, sep, value = o.partition("=")
        if not sep:
            p.error(f"--option {o!r}: KEY=VALUE")
        options[key] = parse_value(value)
    modes = list(MODES)
    for v in args.variant:
        key, sep, kw = v.partition(":")
        if not sep:
            p.error(f"--variant {v!r}: KEY:JSON")
        modes.append((key, key, json.loads(kw)))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            p.error(f"--models: {m!r} is not one of {sorted(MODELS)}")

    t0 = time.perf_counter()
    print(f"device_bytes_bench: torch {torch.__version__}, stallfree from "
          f"{os.path.dirname(stallfree.__file__)}; ZenFlowAdamW {COMMON}"
          + (f", options {options}" if options else ""), flush=True)
    results = {}
    try:
        with stallfree.Daemon(threads=1, log_level="warning") as daemon:
            for m in models:
                prefix, cls = MODELS[m]
                spec = cls(args)
                rows = [("torch.optim.AdamW, fp32 model", torch_adamw_run(spec, args.steps)),
                        ("bf16 recipe: AdamW on fp32 masters", torch_mixed_run(spec, args.steps))]
                runs = {"torch_adamw_fp32": rows[0][1], "torch_mixed_bf16": rows[1][1]}
                for key, label, kw in modes:
                    for dname, dtype in DTYPES:
                        r = engine_run(spec, dtype, dict(COMMON, **kw, **options), args.steps,
                                       daemon.socket)
                        runs[f"{key}_{dname}"] = r
                        how = (f" ({r['transfers']})" if r["transfers"] and "transfers" not in kw
                               and kw.get("mode") == "zenflow" else "")
                        rows.append((f"ZenFlowAdamW {label}{how}, {dname}", r))
                n = rows[0][1]["n"]
                print_table(spec.title, n, args.steps, rows)
                results[m] = (prefix, n, runs)
            if args.step_time_steps > 0:
                step_times(daemon.socket, 5, 2048, args.step_time_steps)
    except Failure as e:
        print(f"device_bytes_bench: FAILED: {e}", file=sys.stderr, flush=True)
        sys.exit(1)

    print()
    for m in models:
        prefix, n, runs = results[m]
        for key, r in runs.items():
            figure(f"device_bytes_per_param{prefix}_{key}", r["total"] / n, "bytes")
        if "zenflow_bf16" in runs:
            figure(f"device_bytes_zenflow_bf16_over_torch_mixed_bf16{prefix}",
                   runs["zenflow_bf16"]["total"] / runs["torch_mixed_bf16"]["total"], "x")
        if "zenflow_streamed_bf16" in runs:
            # Issue 22's streamed figure: what stays, plus the one gradient in flight (the
            # largest weight's: the engine's transient_peak), target <= 3.5.
            r = runs["zenflow_streamed_bf16"]
            figure(f"device_bytes_per_param{prefix}_zenflow_bf16_streamed",
                   (r["total"] + r["transient"]) / n, "bytes (target <= 3.5)")
        if m == "linear":
            for key, r in runs.items():
                if key.startswith("torch_"):
                    continue
                figure(f"device_bytes_per_param_{key}_params", r["params"] / n, "bytes")
                for c, v in r["cats"].items():
                    figure(f"device_bytes_per_param_{key}_{c.replace(' ', '_')}", v / n, "bytes")
                figure(f"device_bytes_per_param_{key}_transient_peak", r["transient"] / n,
                       "bytes")
    if "linear" in results and "zenflow_bf16" in results["linear"][2]:
        _, n, runs = results["linear"]
        v = runs["zenflow_bf16"]["total"] / n
        how = runs["zenflow_bf16"]["transfers"]
        print(f"zenflow bf16 (linear, the defaults{', transfers ' + how if how else ''}): "
              f"{v:.3f} bytes per parameter, target <= {TARGET_ZENFLOW_BF16}: "
              f"{'met' if v <= TARGET_ZENFLOW_BF16 else 'NOT met'}")
    print(f"device_bytes_bench: {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
