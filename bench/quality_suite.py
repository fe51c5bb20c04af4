#!/usr/bin/env python3
"""quality_suite: what ZenFlowAdamW's defaults cost in model quality, side by side with
torch.optim.AdamW, sync-offload and DeepSpeed's ZenFlow, on real text (issue 29).

    PYTHONPATH=bazel-bin/python .venv/bin/python bench/quality_suite.py --quick
    ... bench/quality_suite.py --tasks llama_scratch --optimizers adamw,zenflow,ds_zenflow
    ... bench/quality_suite.py --optimizers "adamw,zenflow,zenflow[update_interval=1]"

The text is what every Debian machine with the project's Python has: bytes as tokens (vocab 256)
of Python's language reference (pydoc_data.topics of the standard library: technical English,
about 465 KB) for pretraining and training from scratch, and of the licences in
/usr/share/common-licenses (base-files: legal English, about 250 KB) for fine-tuning, a domain
shift. Each text's last 10% is held out; the eval loss is the mean over fixed held-out batches.

Tasks (small transformers models built from configs, no download; one process, the CPU):
- llama_finetune: a LlamaForCausalLM pretrained on the reference (torch.optim.AdamW, once per
  run), then fine-tuned on the licences with warm-up + cosine;
- llama_finetune_const: the same fine-tune at a constant lr;
- gpt2_finetune: the same with a GPT2LMHeadModel;
- llama_scratch: a LlamaForCausalLM trained from its initialisation on the reference, 500 steps,
  warm-up + cosine;
- llama_bf16_finetune: the pretrained Llama as model.to(torch.bfloat16), fine-tuned (AdamW on
  bf16 parameters as torch runs it; ZenFlowAdamW with its fp32 masters).
Every run of a task starts from the same weights, sees the same batches in the same order and
the same schedule (the lr set on every parameter group before each step), with Hugging Face's
two parameter groups (weight decay 0.1 on the matrices and embeddings, none on norms and
biases) and the Trainer's default clipping (clip_grad_norm_ 1.0; DeepSpeed: gradient_clipping).

Optimizers (--optimizers, comma separated; NAME[key=value,...] passes options):
- adamw: torch.optim.AdamW (foreach=False);
- zenflow: stallfree.torch.ZenFlowAdamW(groups, lr=...) with nothing else set (the defaults);
- sync_offload: ZenFlowAdamW(mode="sync-offload") (equals AdamW: the control);
- zenflow_s4: the defaults with the round forced to S = 4 (a node whose CPU is slow; the
  defaults' round is "auto", the node's own);
- ds_zenflow: DeepSpeed's ZenFlow through deepspeed.initialize (ZeRO-2, offload_optimizer cpu,
  zenflow with topk_ratio 0.1, update_interval 4, select_interval 16, select_strategy "step";
  DeepSpeed's CPU accelerator, gloo, one rank), as the issue measured it;
- ds_offload: DeepSpeed's plain ZeRO-2 + CPU offload (its control: equals AdamW); for both,
  gradient_clipping=X sets DeepSpeed's clipping (default 1.0), other options its zenflow keys;
- ref: testing/python/zenflow_reference.py's ReferenceZenFlow (the engine's algorithm in plain
  PyTorch; options are its constructor's), for variants the engine does not have.

With ds_zenflow, a probe first: DeepSpeed's ZenFlow takes one step at lr 0 on the pretrained
Llama, and the suite prints how many tensors that changed and how many became their own
transpose's bytes (DeepSpeed 0.19.8 on its CPU accelerator: every 2-D weight; so its fine-tunes
start from a scrambled model, while from scratch a transposed random initialisation is still
one).

Printed: a line per run (eval loss, its ratio to AdamW's, the worst gradient-norm jump: a step's
norm over the median of its previous 10; for ZenFlowAdamW the round lengths it ran, "S xN" in
order, the warm-up's rounds of 1 first), then FIGURE quality_<task>_<optimizer>_vs_adamw_eval_loss
for every run, and for ZenFlowAdamW runs FIGURE quality_<task>_<optimizer>_optimizer_step_ms
(the optimizer's step, median), _step_vs_adamw (the whole step's median against AdamW's) and
_daemon_cpu_s_per_step (the private stallfreed's user + system CPU seconds over the run, per
step). --quick: one seed, fewer pretraining steps (7 min 21 s here with the default
optimizers); the default: seeds 0-2, the figures their mean.
"""

import argparse
import contextlib
import math
import os
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "testing" / "python"))
sys.path.insert(0, str(REPO / "examples"))
sys.dont_write_bytecode = True
# What the project has already: the DeepSpeed harness of torch_bench part 3, the gradient-norm
# jumps of zenflow_variants, Hugging Face's parameter groups as examples/hf_finetune.py builds
# them, and the example's import of stallfree.
from deepspeed_compare import free_port, import_deepspeed  # noqa: E402
from hf_finetune import param_groups, unnamed  # noqa: E402
from torch_gpt import import_stallfree  # noqa: E402
from zenflow_variants import jumps  # noqa: E402

LICENCES = Path("/usr/share/common-licenses")
TASKS = ("llama_finetune", "llama_finetune_const", "gpt2_finetune", "llama_scratch",
         "llama_bf16_finetune")
OPTIMIZERS = ("adamw", "sync_offload", "zenflow", "zenflow_s4", "ds_zenflow", "ds_offload")
DS_ZENFLOW = {"topk_ratio": 0.1, "update_interval": 4, "select_strategy": "step",
              "select_interval": 16, "full_warm_up_rounds": 0, "pt_reserved_cores_perc": 0.0}


# ---- text ----

def reference_text():
    import pydoc_data.topics
    topics = pydoc_data.topics.topics
    return "".join(topics[k] for k in sorted(topics)).encode("utf-8")


def licence_text():
    parts = []
    for f in sorted(LICENCES.iterdir()):
        if f.is_file() and not f.is_symlink():
            parts.append(f.read_bytes())
    if not parts:
        raise SystemExit(f"no licence texts in {LICENCES} (Debian's base-files ships them)")
    return b"\n\n".join(parts)


class Text:
    """A text as byte tokens: training windows drawn by a seeded generator, fixed held-out
    batches (the last 10%)."""

    def __init__(self, data, seq, batch, eval_batches):
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        cut = int(len(t) * 0.9)
        self.train, self.held = t[:cut], t[cut:]
        self.seq, self.batch = seq, batch
        n = min(eval_batches * batch, (len(self.held) - 1) // seq)
        self.eval = self.held[:n * seq].view(n, seq).split(batch)

    def batches(self, steps, seed):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(self.train) - self.seq - 1, (steps, self.batch), generator=g)
        for row in starts:
            yield torch.stack([self.train[s:s + self.seq] for s in row.tolist()])


# ---- models ----

def make_model(kind, size, seed):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    d, layers, heads, seq = size
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=seq, n_embd=d,
                                          n_layer=layers, n_head=heads, resid_pdrop=0.0,
                                          embd_pdrop=0.0, attn_pdrop=0.0))
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=d, intermediate_size=int(8 * d / 3 + 7) // 8 * 8,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=seq, tie_word_embeddings=False))


def schedule(kind, steps, warmup, floor=0.1):
    if kind == "const":
        return lambda t: 1.0

    def cosine(t):  # t = 1..steps
        if t <= warmup:
            return t / warmup
        p = (t - warmup) / max(1, steps - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
    return cosine


@torch.no_grad()
def eval_loss(model, text):
    was = model.training
    model.eval()
    losses = [float(model(input_ids=b, labels=b).loss) for b in text.eval]
    model.train(was)
    return sum(losses) / len(losses)


# ---- optimizers ----

def parse_spec(spec):
    """'name[k=v,k=v]' -> (name, {k: v}) with numbers, bools and None parsed."""
    m = re.fullmatch(r"([a-z0-9_]+)(?:\[(.*)\])?", spec.strip())
    if not m:
        raise SystemExit(f"--optimizers: {spec!r} is not NAME or NAME[key=value,...]")
    opts = {}
    for kv in filter(None, (m.group(2) or "").split(",")):
        k, _, v = kv.partition("=")
        v = v.strip()
        if v in ("true", "True"):
            v = True
        elif v in ("false", "False"):
            v = False
        elif v == "None":
            v = None
        else:
            try:
                v = int(v)
            except ValueError:
                try:
                    v = float(v)
                except ValueError:
                    pass
        opts[k.strip()] = v
    return m.group(1), opts


class TorchRunner:
    """A torch.optim optimizer (AdamW, ZenFlowAdamW, the reference) over the model."""

    def __init__(self, opt, model, daemon=None):
        self.opt, self.model, self.daemon = opt, model, daemon

    def step(self, batch, lr_of_group):
        for g, lr in zip(self.opt.param_groups, lr_of_group):
            g["lr"] = lr
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        t = time.perf_counter()
        self.opt.step()
        opt_s = time.perf_counter() - t
        self.opt.zero_grad(set_to_none=True)
        return float(loss), norm, opt_s

    def interval(self):
        """The round length the last step ran (ZenFlowAdamW's; None for the others)."""
        timings = getattr(self.opt, "last_timings", None)
        return timings.get("interval") if isinstance(timings, dict) else None

    def finish(self):
        for name in ("flush", "close"):
            if hasattr(self.opt, name):
                getattr(self.opt, name)()


class DeepSpeedRunner:
    """deepspeed.initialize of the model: ZeRO-2 with CPU offload, with or without ZenFlow."""

    _ready = False

    def __init__(self, model, groups, lr, zenflow, bf16, clip=1.0):
        deepspeed, _ = import_deepspeed()
        if not DeepSpeedRunner._ready:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                              LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,
                                       verbose=False)
            DeepSpeedRunner._ready = True
        zero = {"stage": 2, "overlap_comm": True,
                "offload_optimizer": {"device": "cpu", "pin_memory": False}}
        if zenflow is not None:
            zero["zenflow"] = zenflow
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999],
                                                         "eps": 1e-8}},
               "zero_optimization": zero, "gradient_clipping": clip,
               "bf16": {"enabled": bool(bf16)},
               "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
        with contextlib.redirect_stdout(sys.stderr):
            self.engine, self.opt, _, _ = deepspeed.initialize(
                model=model, model_parameters=unnamed(groups), config=cfg)
        self.model = model
        self.daemon = None

    def step(self, batch, lr_of_group):
        for g, lr in zip(self.opt.param_groups, lr_of_group):
            g["lr"] = lr
        loss = self.engine(input_ids=batch, labels=batch).loss
        with contextlib.redirect_stdout(sys.stderr):
            self.engine.backward(loss)
            t = time.perf_counter()
            self.engine.step()
        opt_s = time.perf_counter() - t
        norm = self.engine.get_global_grad_norm()
        return float(loss), float(norm) if norm is not None else float("nan"), opt_s

    def finish(self):
        self.engine.destroy()


def daemon_cpu_s(daemon):
    """User + system CPU seconds of the daemon's process so far."""
    if daemon is None:
        return 0.0
    with open(f"/proc/{daemon.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_runner(name, opts, model, lr, daemon, bf16):
    groups = param_groups(model, 0.1)
    if name == "adamw":
        return TorchRunner(torch.optim.AdamW(groups, lr=lr, foreach=False, **opts), model)
    if name in ("zenflow", "sync_offload", "zenflow_s4"):
        from stallfree.torch import ZenFlowAdamW
        kw = {"sync_offload": {"mode": "sync-offload"},
              "zenflow_s4": {"update_interval": 4}}.get(name, {})
        kw.update(opts)
        return TorchRunner(ZenFlowAdamW(groups, lr=lr, socket=daemon.socket, **kw), model,
                           daemon)
    if name == "ref":
        import zenflow_reference
        return TorchRunner(zenflow_reference.ReferenceZenFlow(groups, lr=lr, **opts), model)
    if name in ("ds_zenflow", "ds_offload"):
        clip = opts.pop("gradient_clipping", 1.0)  # DeepSpeed's own key; the rest are zenflow's
        zen = dict(DS_ZENFLOW, **opts) if name == "ds_zenflow" else None
        return DeepSpeedRunner(model, groups, lr, zen, bf16, clip)
    raise SystemExit(f"--optimizers: unknown optimizer {name!r} (one of "
                     f"{', '.join(OPTIMIZERS + ('ref',))})")


def probe_deepspeed_first_step(suite):
    """DeepSpeed's ZenFlow at lr 0 on the pretrained Llama: which weights its first step changes,
    and whether each became its own transpose's bytes (w.t().reshape(w.shape)). Plain ZeRO-Offload
    changes nothing there."""
    state = suite.pretrained_state("llama", 0)
    model = make_model("llama", suite.size, 0)
    model.load_state_dict(state)
    before = eval_loss(model, suite.lic)
    runner = DeepSpeedRunner(model, param_groups(model, 0.0), 0.0, dict(DS_ZENFLOW), False, 0.0)
    runner.step(next(iter(suite.lic.batches(1, 0))), [0.0, 0.0])
    changed = transposed = 0
    for n, p in model.named_parameters():
        w = state[n]
        if not torch.equal(p.detach(), w):
            changed += 1
            transposed += w.dim() == 2 and torch.equal(p.detach(), w.t().reshape(w.shape))
    after = eval_loss(model, suite.lic)
    runner.finish()
    print(f"  DeepSpeed's ZenFlow, one step at lr 0 on the pretrained Llama: {changed} of "
          f"{len(state)} tensors changed, {transposed} of them into their transpose's bytes; "
          f"eval on the licences {before:.4f} -> {after:.4f}", flush=True)
    print(f"FIGURE deepspeed_zenflow_lr0_first_step_changed_tensors {changed} tensors")
    print(f"FIGURE deepspeed_zenflow_lr0_first_step_transposed_tensors {transposed} tensors")


# ---- tasks ----

class Suite:
    def __init__(self, args):
        self.args = args
        q = args.quick
        self.size = (args.d_model, args.layers, args.heads, args.seq)
        self.ref = Text(reference_text(), args.seq, args.batch, args.eval_batches)
        self.lic = Text(licence_text(), args.seq, args.batch, args.eval_batches)
        self.pretrain_steps = args.pretrain_steps or (300 if q else 600)
        self.pretrained = {}

    def pretrained_state(self, kind, seed):
        """kind's model pretrained on the reference text with AdamW (once per run)."""
        key = (kind, seed)
        if key not in self.pretrained:
            t = time.perf_counter()
            model = make_model(kind, self.size, seed)
            runner = TorchRunner(torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3,
                                                   foreach=False), model)
            sched = schedule("cosine", self.pretrain_steps, 20)
            for i, b in enumerate(self.ref.batches(self.pretrain_steps, 1000 + seed), 1):
                runner.step(b, [3e-3 * sched(i)] * 2)
            self.pretrained[key] = {k: v.clone() for k, v in model.state_dict().items()}
            print(f"  pretrained {kind} (seed {seed}) {self.pretrain_steps} steps on the "
                  f"reference text: eval {eval_loss(model, self.ref):.4f} there, "
                  f"{eval_loss(model, self.lic):.4f} on the licences "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
        return self.pretrained[key]

    def task(self, name):
        a = self.args
        if name == "llama_scratch":
            return dict(kind="llama", text=self.ref, steps=a.scratch_steps, lr=3e-3,
                        sched="cosine", warmup=20, pretrained=False, bf16=False)
        base = dict(kind="gpt2" if name.startswith("gpt2") else "llama", text=self.lic,
                    steps=a.finetune_steps, lr=1e-3, sched="cosine", warmup=10,
                    pretrained=True, bf16="bf16" in name)
        if name.endswith("_const"):
            base.update(sched="const", lr=5e-4)
        return base

    def run(self, task_name, spec, seed, daemon):
        name, opts = parse_spec(spec)
        t = self.task(task_name)
        model = make_model(t["kind"], self.size, seed)
        if t["pretrained"]:
            model.load_state_dict(self.pretrained_state(t["kind"], seed))
        if t["bf16"]:
            model = model.to(torch.bfloat16)
        runner = make_runner(name, opts, model, t["lr"], daemon, t["bf16"])
        sched = schedule(t["sched"], t["steps"], t["warmup"])
        losses, norms, opt_s, step_s, rounds = [], [], [], [], []
        cpu0 = daemon_cpu_s(runner.daemon)
        start = time.perf_counter()
        for i, b in enumerate(t["text"].batches(t["steps"], seed), 1):
            s = time.perf_counter()
            loss, norm, o = runner.step(b, [t["lr"] * sched(i)] * 2)
            step_s.append(time.perf_counter() - s)
            losses.append(loss)
            norms.append(norm)
            opt_s.append(o)
            if getattr(runner, "interval", None) is not None:
                rounds.append(runner.interval())
            if not math.isfinite(loss):
                break
        runner.finish()
        cpu = daemon_cpu_s(runner.daemon) - cpu0
        ev = eval_loss(runner.model, t["text"]) if math.isfinite(losses[-1]) else float("nan")
        js = jumps(norms)
        return dict(eval=ev, jump=max(js), jump_step=1 + js.index(max(js)),
                    opt_ms=1e3 * statistics.median(opt_s[5:]),
                    step_ms=1e3 * statistics.median(step_s[5:]),
                    daemon_cpu=cpu / len(step_s) if runner.daemon else None,
                    rounds=round_lengths(rounds), seconds=time.perf_counter() - start)


def round_lengths(per_step):
    """ZenFlowAdamW's round lengths as "S x steps, ..." in the order they ran (the warm-up's
    rounds of 1 included), or None."""
    if not per_step or per_step[0] is None:
        return None
    runs = []
    for s in per_step:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return ", ".join(f"{s} x{n}" for s, n in runs)


def figure_name(spec):
    return re.sub(r"[^a-z0-9]+", "_", spec.lower()).strip("_")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one seed, shorter pretraining")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma separated, of: " +
                   ", ".join(TASKS))
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS),
                   help="comma separated NAME or NAME[key=value,...] (see above)")
    p.add_argument("--seeds", default=None, help="comma separated (default 0,1,2; --quick: 0)")
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128, help="tokens (bytes) a sample")
    p.add_argument("--batch", type=int, default=8, help="samples a step")
    p.add_argument("--eval_batches", type=int, default=16)
    p.add_argument("--pretrain_steps", type=int, default=None,
                   help="AdamW pretraining of the fine-tuned models (default 600; --quick 300)")
    p.add_argument("--finetune_steps", type=int, default=200)
    p.add_argument("--scratch_steps", type=int, default=500)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    specs = [s for s in re.split(r",(?![^\[]*\])", args.optimizers) if s.strip()]
    tasks = [t for t in args.tasks.split(",") if t]
    for t in tasks:
        if t not in TASKS:
            p.error(f"--tasks: unknown task {t!r}")
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    sf = import_stallfree()
    suite = Suite(args)
    print(f"quality_suite: tasks {', '.join(tasks)}; optimizers {', '.join(specs)}; seeds "
          f"{seeds}; model d {args.d_model} x {args.layers} layers, {args.batch} x {args.seq} "
          f"bytes a step; reference text {len(suite.ref.train) + len(suite.ref.held)} bytes, "
          f"licences {len(suite.lic.train) + len(suite.lic.held)} bytes", flush=True)
    # results[(task, spec)][seed]; each figure pairs a run with AdamW's of the same seed.
    results, failed = {}, []
    t0 = time.perf_counter()
    with sf.Daemon() as daemon:
        if any(parse_spec(x)[0] == "ds_zenflow" for x in specs):
            probe_deepspeed_first_step(suite)
        for task in tasks:
            for seed in seeds:
                for spec in specs:
                    try:
                        r = suite.run(task, spec, seed, daemon)
                    except Exception as e:  # noqa: BLE001 - report the run, go on with the rest
                        print(f"  {task:22s} seed {seed} {spec:34s} FAILED: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}", flush=True)
                        failed.append((task, spec))
                        continue
                    results.setdefault((task, spec), {})[seed] = r
                    base = results.get((task, "adamw"), {}).get(seed)
                    ratio = r["eval"] / base["eval"] if base else float("nan")
                    cpu = f", daemon {r['daemon_cpu'] * 1e3:.1f} ms CPU a step" \
                        if r["daemon_cpu"] is not None else ""
                    took = "%.0f s" % r["seconds"]
                    rounds = f"  rounds {r['rounds']}" if r.get("rounds") else ""
                    print(f"  {task:22s} seed {seed} {spec:34s} eval {r['eval']:.4f}  "
                          f"x{ratio:.4f} AdamW  worst jump {r['jump']:5.2f}x at step "
                          f"{r['jump_step']:3d}  step "
                          f"{r['step_ms']:6.1f} ms (optimizer {r['opt_ms']:5.1f}){cpu}  "
                          f"[{took}]{rounds}", flush=True)
    print(f"quality_suite: {time.perf_counter() - t0:.0f} s")
    for task in tasks:
        base = results.get((task, "adamw"), {})
        for spec in specs:
            runs = results.get((task, spec), {})
            if not runs or (task, spec) in failed:
                continue
            rs = list(runs.values())
            pairs = [(r, base[seed]) for seed, r in runs.items() if seed in base]
            fig = f"quality_{task}_{figure_name(spec)}"
            if pairs and spec != "adamw":
                ratio = statistics.mean(r["eval"] / b["eval"] for r, b in pairs)
                print(f"FIGURE {fig}_vs_adamw_eval_loss {ratio:.4f} x")
            print(f"FIGURE {fig}_eval_loss {statistics.mean(r['eval'] for r in rs):.4f} nats")
            print(f"FIGURE {fig}_worst_grad_norm_jump {max(r['jump'] for r in rs):.2f} x")
            if rs[0]["daemon_cpu"] is not None:
                print(f"FIGURE {fig}_optimizer_step_ms "
                      f"{statistics.mean(r['opt_ms'] for r in rs):.2f} ms")
                print(f"FIGURE {fig}_daemon_cpu_s_per_step "
                      f"{statistics.mean(r['daemon_cpu'] for r in rs):.5f} s")
            if pairs and spec != "adamw":
                print(f"FIGURE {fig}_step_vs_adamw "
                      f"{statistics.mean(r['step_ms'] / b['step_ms'] for r, b in pairs):.3f} x")
    if failed:
        print("quality_suite: failed runs: " + ", ".join(f"{t} {s}" for t, s in failed))
        sys.exit(1)



if __name__ == "__main__":
    main()
