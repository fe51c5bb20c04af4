"""Hugging Face models, data and Trainer runs for the test_hf_*.py tests (and their workers).

Models: transformers' LlamaForCausalLM and GPT2LMHeadModel from tiny configs, random
initialisation from a fixed seed (nothing downloaded). Tokens are bytes (vocab 256) of the
project's generated text, stallfree.default_corpus_text(seed=CORPUS_SEED): sample i of the
dataset is the SEQ bytes at offset i * SEQ (input_ids == labels: the model shifts them).

A run (`train`) is what a user writes: TrainingArguments(use_cpu=True, report_to=[], seed,
logging_steps=1, ...) and Trainer(model, args, train_dataset=..., optimizers=(optimizer,
scheduler)), with the optimizer's parameter groups built the way Trainer.create_optimizer builds
them (decay: what Trainer.get_decay_parameter_names names; no decay: biases and norms), and
transformers' cosine schedule with warm-up. Per step it records the logged loss and gradient
norm (logging_steps=1: the loss of that step, unrounded) and, at the end, the parameters.
"""
import json
import math
import os
import sys

import torch

import stallfree
from models import (FP32, LOSS_RTOL, PARAM_ATOL,  # noqa: F401 (used by the tests)
                    max_abs_diff, rel_diff, snapshot)

# Hugging Face must not reach the network (the tests' runner sets these too).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import transformers  # noqa: E402
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments)

VOCAB = 256
SEQ = 32
BATCH = 8  # global batch (rows)
SAMPLES = 128  # dataset size: 16 steps per epoch at BATCH 8
CORPUS_SEED = 1

LR = 3e-3
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.999)
EPS = 1e-8
WARMUP = 3  # the scheduler's warm-up steps (not ZenFlow's)
MAX_GRAD_NORM = 1.0

MODELS = ("llama", "gpt2")


def make_model(kind, seed=0, dropout=None):
    """A tiny LlamaForCausalLM or GPT2LMHeadModel, the same weights for the same seed in any
    process (transformers' own initialisation under torch.manual_seed)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(1000 + seed)
    try:
        if kind == "llama":
            config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=SEQ,
                                 tie_word_embeddings=False, attention_dropout=dropout or 0.0)
            model = LlamaForCausalLM(config)
        elif kind == "gpt2":
            drop = {} if dropout is None else dict(resid_pdrop=dropout, embd_pdrop=dropout,
                                                   attn_pdrop=dropout)
            # GPT-2's default dropout (0.1) stays on unless `dropout` is given.
            config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                **drop)
            model = GPT2LMHeadModel(config)
        else:
            raise ValueError(kind)
    finally:
        torch.random.set_rng_state(gen_state)
    return model


class ByteDataset(torch.utils.data.Dataset):
    """Sample i: the SEQ bytes of the corpus at i * SEQ, as input_ids and labels."""

    def __init__(self, samples=SAMPLES, seq=SEQ, corpus_seed=CORPUS_SEED, offset=0):
        need = offset + samples * seq
        text = stallfree.default_corpus_text(approx_bytes=max(need + 1024, 4096), seed=corpus_seed)
        data = torch.frombuffer(bytearray(text[offset:need]), dtype=torch.uint8).long()
        self.rows = data.view(samples, seq)

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        row = self.rows[i]
        return {"input_ids": row, "labels": row}


def param_groups(model, weight_decay=WEIGHT_DECAY):
    """The two groups Trainer.create_optimizer builds: weight decay on what
    Trainer.get_decay_parameter_names names, none on the rest (biases, norms)."""
    decay = set(Trainer.get_decay_parameter_names(None, model))  # (it does not use self)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def adamw(groups, lr=LR, eps=EPS, **_):
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=eps)


def coupled_adam(groups, lr=LR, eps=EPS, **_):
    """A WRONG AdamW: L2 weight decay added to the gradient (torch.optim.Adam's weight_decay)
    instead of decoupled decay; for the tolerance checks."""
    return torch.optim.Adam(groups, lr=lr, betas=BETAS, eps=eps)


def zenflow_adamw(groups, lr=LR, eps=EPS, **config):
    from stallfree.torch import ZenFlowAdamW
    return ZenFlowAdamW(groups, lr=lr, betas=BETAS, eps=eps, **config)


OPTIMIZERS = {"adamw": adamw, "coupled_adam": coupled_adam, "zenflow": zenflow_adamw}


def make_scheduler(opt, max_steps):
    return transformers.get_cosine_schedule_with_warmup(opt, WARMUP, max_steps)


class Recorder(TrainerCallback):
    """Per optimizer step: the Trainer's optimizer (unwrapped from accelerate's
    AcceleratedOptimizer) and its last_timings (ZenFlowAdamW's), and, when `nudge_seed` is
    given, every parameter moved by a random -1/0/+1 ulp (what a correct but differently
    rounding kernel may do; for the tolerance derivation)."""

    def __init__(self, nudge_seed=None):
        self.optimizer = None
        self.partition = None  # ZenFlowAdamW's partition, at the last step
        self.timings = []
        self.gen = None if nudge_seed is None else torch.Generator().manual_seed(nudge_seed)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        if hasattr(self.optimizer, "last_timings"):
            self.timings.append(dict(self.optimizer.last_timings))
            self.partition = getattr(self.optimizer, "partition", None)
        if self.gen is not None:
            with torch.no_grad():
                for p in model.parameters():
                    s = torch.randint(-1, 2, p.shape, generator=self.gen)
                    up = torch.nextafter(p, torch.full_like(p, math.inf))
                    down = torch.nextafter(p, torch.full_like(p, -math.inf))
                    p.copy_(torch.where(s > 0, up, torch.where(s < 0, down, p)))


def training_args(out_dir, max_steps, save_steps=None, seed=0, per_device_batch=BATCH, **kw):
    return TrainingArguments(
        output_dir=out_dir, max_steps=max_steps, per_device_train_batch_size=per_device_batch,
        learning_rate=LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
        adam_epsilon=EPS, max_grad_norm=MAX_GRAD_NORM, lr_scheduler_type="cosine",
        warmup_steps=WARMUP, logging_steps=1, report_to=[], use_cpu=True,
        dataloader_num_workers=0, seed=seed, data_seed=seed, disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        save_only_model=False, **kw)


def history(log_history, key):
    """{step: value} of the per-step training logs."""
    return {e["step"]: e[key] for e in log_history if key in e and "train_runtime" not in e}


def train(kind, optimizer="adamw", config=None, *, max_steps, out_dir, save_steps=None,
          resume_from=None, seed=0, nudge_seed=None, lr=LR, eps=EPS, model_seed=0,
          dropout=None, per_device_batch=BATCH, cls_and_kwargs=False, optimizer_first=False,
          callbacks=(), **args_kw):
    """One Trainer run; returns {"losses": {step: loss}, "grad_norms": {step: norm}, "params":
    {name: tensor}, "timings": [last_timings per step this process ran], "hot": {name: hot
    columns at the end} (ZenFlowAdamW in zenflow mode), "optimizer": the optimizer's class
    name}. args_kw: more TrainingArguments. cls_and_kwargs: instead of optimizers=(optimizer,
    scheduler), Trainer(optimizer_cls_and_kwargs=(class, kwargs)): the Trainer builds the
    groups and the scheduler (from the arguments: the same cosine with warm-up).
    optimizer_first: model and optimizer before the TrainingArguments (under torchrun, before
    torch.distributed is initialised); "partition" in the result is the optimizer's.
    callbacks: more TrainerCallbacks."""
    torch.set_num_threads(1)
    # As in a user's script: the arguments first (under torchrun this initialises
    # torch.distributed, which ZenFlowAdamW sees when it is built), then model and optimizer;
    # or, optimizer_first, the other way round.
    if optimizer_first:
        assert not cls_and_kwargs
        model = make_model(kind, model_seed, dropout=dropout)
        early = OPTIMIZERS[optimizer](param_groups(model), lr=lr, eps=eps, **(config or {}))
    args = training_args(out_dir, max_steps, save_steps, seed, per_device_batch, **args_kw)
    if not optimizer_first:
        model = make_model(kind, model_seed, dropout=dropout)
    recorder = Recorder(nudge_seed)
    if cls_and_kwargs:
        from stallfree.torch import ZenFlowAdamW
        assert optimizer == "zenflow"
        kwargs = dict(config or {}, lr=lr, betas=BETAS, eps=eps)
        trainer = Trainer(model=model, args=args, train_dataset=ByteDataset(),
                          optimizer_cls_and_kwargs=(ZenFlowAdamW, kwargs),
                          callbacks=[recorder, *callbacks])
    else:
        opt = early if optimizer_first else \
            OPTIMIZERS[optimizer](param_groups(model), lr=lr, eps=eps, **(config or {}))
        trainer = Trainer(model=model, args=args, train_dataset=ByteDataset(),
                          optimizers=(opt, make_scheduler(opt, max_steps)),
                          callbacks=[recorder, *callbacks])
        recorder.optimizer = opt
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # quiet
    hot = {}
    try:
        trainer.train(resume_from_checkpoint=resume_from)
        if optimizer == "zenflow" and (config or {}).get("mode", "zenflow") == "zenflow":
            hot = {n: recorder.optimizer.hot_columns(p)
                   for n, p in model.named_parameters() if p.dim() == 2}
    finally:
        if hasattr(recorder.optimizer, "close"):
            recorder.optimizer.close()
    logs = trainer.state.log_history
    return {"losses": history(logs, "loss"), "grad_norms": history(logs, "grad_norm"),
            "params": snapshot(model), "timings": recorder.timings, "hot": hot,
            "optimizer": type(recorder.optimizer).__name__,
            "partition": recorder.partition}


def accelerate_train(kind, optimizer="adamw", config=None, *, max_steps, seed=0, save_at=None,
                     save_dir=None, resume_from=None, lr=LR, eps=EPS, model_seed=0, dropout=None):
    """The plain loop of accelerate's documentation: Accelerator(cpu=True).prepare(model,
    optimizer, dataloader, scheduler), backward through the accelerator, clipping to
    MAX_GRAD_NORM, optimizer.step(), scheduler.step(), zero_grad(). The dataloader shuffles
    (accelerate's seedable sampler, reshuffled per epoch by set_epoch). save_at: after that step
    accelerator.save_state(save_dir) (and the step in save_dir/step.json); resume_from: such a
    directory, loaded with accelerator.load_state, the epoch's first batches skipped. Returns
    what train() returns (losses and grad_norms of the steps this call ran)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    torch.set_num_threads(1)
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(seed)
    model = make_model(kind, model_seed, dropout=dropout)
    opt = OPTIMIZERS[optimizer](param_groups(model), lr=lr, eps=eps, **(config or {}))
    sched = make_scheduler(opt, max_steps)
    loader = torch.utils.data.DataLoader(ByteDataset(), batch_size=BATCH, shuffle=True)
    model, prepared_opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    step = 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        with open(os.path.join(resume_from, "step.json")) as f:
            step = json.load(f)["step"]
    losses, grad_norms, timings = {}, {}, []
    model.train()
    try:
        epoch, skip = divmod(step, len(loader))
        while step < max_steps:
            loader.set_epoch(epoch)
            batches = accelerator.skip_first_batches(loader, skip) if skip else loader
            skip = 0
            for batch in batches:
                out = model(**batch)
                accelerator.backward(out.loss)
                grad_norms[step + 1] = accelerator.clip_grad_norm_(model.parameters(),
                                                                   MAX_GRAD_NORM).item()
                prepared_opt.step()
                sched.step()
                prepared_opt.zero_grad()
                step += 1
                losses[step] = out.loss.item()
                if hasattr(opt, "last_timings"):
                    timings.append(dict(opt.last_timings))
                if step == save_at:
                    accelerator.save_state(save_dir)
                    if accelerator.is_main_process:
                        with open(os.path.join(save_dir, "step.json"), "w") as f:
                            json.dump({"step": step}, f)
                if step == max_steps:
                    break
            epoch += 1
    finally:
        if hasattr(opt, "close"):
            opt.close()
    return {"losses": losses, "grad_norms": grad_norms,
            "params": snapshot(accelerator.unwrap_model(model)), "timings": timings,
            "optimizer": type(opt).__name__, "partition": getattr(opt, "partition", None)}


# ZenFlowAdamW configurations that must track torch.optim.AdamW within the tolerances below:
# fp32 transfers, no staleness (zenflow: single-step rounds, awaited; warmup_steps=0 so that the
# hot columns are reselected every 4 steps from step 4 on).
EXACT_MODES = {
    "sync-offload": dict(FP32, mode="sync-offload"),
    "zenflow-S1": dict(FP32, mode="zenflow", update_interval=1, await_updates=True,
                       warmup_steps=0),
}

# The tolerances of every comparison with torch.optim.AdamW are models.py's (losses relative at
# every step, parameters absolute per element at the end); test_hf_trainer.py's docstring
# re-derives them for these models and its tests re-measure them.


def compare(run, ref):
    """(max relative loss difference over the steps, max |parameter difference|, worst name)."""
    diffs = max_abs_diff(run["params"], ref["params"])
    worst = max(diffs, key=diffs.get)
    return max_loss_rel_diff(run["losses"], ref["losses"]), diffs[worst], worst


def within_tolerance(run, ref):
    loss, param, _ = compare(run, ref)
    return loss <= LOSS_RTOL and param <= PARAM_ATOL


def max_loss_rel_diff(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(rel_diff(a[s], b[s]) for s in a)


if __name__ == "__main__":
    # A run in a fresh process: hf_models.py JSON_KWARGS OUT (torch.save of train()'s result;
    # of accelerate_train()'s with "loop": "accelerate" in the kwargs). With
    # "socket_daemon_state": DIR in the kwargs the optimizer talks to a private stallfreed (its
    # state in DIR) started here.
    kwargs = json.loads(sys.argv[1])
    run = accelerate_train if kwargs.pop("loop", "trainer") == "accelerate" else train
    if "socket_daemon_state" in kwargs:
        state_dir = kwargs.pop("socket_daemon_state")
        with stallfree.Daemon(state_dir=state_dir, threads=1) as d:
            kwargs.setdefault("config", {})["socket"] = d.socket
            result = run(**kwargs)
    else:
        result = run(**kwargs)
    torch.save(result, sys.argv[2])
