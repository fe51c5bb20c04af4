"""A small deterministic language model and training loop for the stallfree tests.

TinyLM: nn.Embedding(64, 32) -> nn.LayerNorm(32) -> nn.Linear(32, 48) (bias) -> tanh ->
nn.Linear(48, 64) (no bias) -> next-token logits, trained with cross-entropy. Its 2-D weights
are the embedding [64, 32] (32 columns), up [48, 32] (32 columns) and down [64, 48] (48
columns); its 1-D parameters are up.bias and the LayerNorm's weight and bias.

Batches come from a fixed random "grammar" (the next token is perm[token] with probability
0.75, else uniform), so the loss falls as the model learns; a batch is a function of
(seed, step) only, so a resumed run in another process sees the same data.
"""
import collections
import io
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64
D_MODEL = 32
HIDDEN = 48
BATCH = 8  # rows of the global batch
SEQ = 16  # predicted tokens per row

DECAY_LR = 1e-2
NO_DECAY_LR = 5e-3
DECAY_WD = 0.1
ETA_MIN = 1e-4

TWO_D = ("emb.weight", "up.weight", "down.weight")

# Where the model lives: cpu here; make gpu-check runs the same tests with
# STALLFREE_TEST_DEVICE=cuda (a --config=cuda build of the package).
DEVICE = torch.device(os.environ.get("STALLFREE_TEST_DEVICE", "cpu"))


class TinyLM(nn.Module):
    """odd=True adds parameters of the shapes a partition over ranks must get right: a 3-D
    weight [2, 3, d] (6 rows: blocks of unequal size over 4 ranks), a 2-row weight [2, d] (fewer
    rows than 4 ranks: every rank holds it whole) and a scalar, all in the forward pass."""

    def __init__(self, vocab=VOCAB, d=D_MODEL, hidden=HIDDEN, sparse_embedding=False, odd=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, sparse=sparse_embedding)
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden, bias=True)
        self.down = nn.Linear(hidden, vocab, bias=False)
        self.odd = odd
        if odd:
            self.cube = nn.Parameter(0.1 * torch.randn(2, 3, d))
            self.pair = nn.Parameter(0.1 * torch.randn(2, d))
            self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, tokens):
        x = self.norm(self.emb(tokens))
        if self.odd:
            x = self.scale * x + self.cube.sum((0, 1)) + self.pair.mean(0)
        return self.down(torch.tanh(self.up(x)))


def make_model(seed=0, **kwargs):
    """The same initial weights for the same seed, in any process."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(1000 + seed)
    try:
        model = TinyLM(**kwargs)
        # LayerNorm starts at weight 1, bias 0; perturb them so the norm's parameters are not
        # special (and differ between elements).
        with torch.no_grad():
            model.norm.weight.add_(0.1 * torch.randn(model.norm.weight.shape))
            model.norm.bias.add_(0.1 * torch.randn(model.norm.bias.shape))
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(DEVICE)


class LlamaLM(nn.Module):
    """A tiny transformers LlamaForCausalLM (hf_models.make_model("llama"): 2 decoder layers,
    grouped-query attention, RMSNorm, untied embeddings) as loss_fn takes a model: token ids in,
    logits out. `layers` are its fully_shard units."""

    def __init__(self, seed=0):
        super().__init__()
        import hf_models
        self.llama = hf_models.make_model("llama", seed)

    @property
    def layers(self):
        return list(self.llama.model.layers)

    def forward(self, tokens):
        return self.llama(input_ids=tokens).logits


def batch(seed, step, rows=BATCH, seq=SEQ, vocab=VOCAB):
    """Token rows [rows, seq + 1] for training step `step` (1-based) of the run `seed`."""
    g = torch.Generator().manual_seed(7919 * seed + 17)
    perm = torch.randperm(vocab, generator=g)
    g = torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)
    tokens = torch.empty(rows, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (rows,), generator=g)
    follow = torch.rand(rows, seq, generator=g) < 0.75
    noise = torch.randint(vocab, (rows, seq), generator=g)
    for i in range(seq):
        tokens[:, i + 1] = torch.where(follow[:, i], perm[tokens[:, i]], noise[:, i])
    return tokens


def loss_fn(model, tokens):
    tokens = tokens.to(next(model.parameters()).device)
    logits = model(tokens[:, :-1]).float()  # a bf16 model's loss in fp32 (fp32: unchanged)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def param_groups(model, named=False, decay_lr=DECAY_LR, no_decay_lr=NO_DECAY_LR):
    """Two groups: "decay" (the 2-D weights, weight_decay 0.1) and "no_decay" (biases and the
    norm's parameters, weight_decay 0), each with its own lr. With named=True the params are
    (name, tensor) pairs, as model.named_parameters() yields them."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        item = (name, p) if named else p
        (decay if p.dim() >= 2 else no_decay).append(item)
    return [
        {"params": decay, "lr": decay_lr, "weight_decay": DECAY_WD, "name": "decay"},
        {"params": no_decay, "lr": no_decay_lr, "weight_decay": 0.0, "name": "no_decay"},
    ]


def make_scheduler(opt, total_steps):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps, eta_min=ETA_MIN)


def adamw_factory(lr_scale=1.0):
    """torch.optim.AdamW over the same groups (the reference); lr_scale scales every group's lr."""

    def factory(groups):
        groups = [dict(g) for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * lr_scale
        return torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-8)

    return factory


TrainResult = collections.namedtuple("TrainResult", "losses params extra")


def snapshot(model):
    """The parameters' values, whole (an FSDP2 DTensor all-gathered: a collective)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for n, p in model.named_parameters()}


def changed(model, before):
    """The names of the parameters whose values differ from snapshot `before` (compared on the
    CPU, where snapshots live, whatever device the model is on)."""
    return [n for n, p in model.named_parameters() if not torch.equal(p.detach().cpu(), before[n])]


def train(opt_factory, steps, seed=0, *, model=None, rows=None, total_steps=None, start=1,
          setup=None, before_step=None, after_step=None, close=True):
    """Trains steps start..steps of TinyLM(seed) with opt_factory(param_groups(model)) and a
    cosine schedule over total_steps (default steps).

    setup(model, opt, sched) runs before the first step (e.g. to load state dicts);
    before_step(step, model, opt) after backward, before opt.step() (e.g. to drop a .grad);
    after_step(step, model, opt, extra) after opt.step() and the scheduler's step; `extra` is a
    dict the callbacks may fill (extra["sched"] is the scheduler). rows: a slice of the batch
    rows (default all). The optimizer is closed at the end (if it has close()) unless
    close=False. Returns TrainResult(losses [float per step], params {name: tensor}, extra)."""
    torch.set_num_threads(1)
    if model is None:
        model = make_model(seed)
    opt = opt_factory(param_groups(model))
    sched = make_scheduler(opt, total_steps or steps)
    losses, extra = [], {"sched": sched}
    try:
        if setup is not None:
            setup(model, opt, sched)
        for step in range(start, steps + 1):
            tokens = batch(seed, step)
            if rows is not None:
                tokens = tokens[rows]
            tokens = tokens.to(DEVICE)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, tokens)
            loss.backward()
            if before_step is not None:
                before_step(step, model, opt)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if after_step is not None:
                after_step(step, model, opt, extra)
    finally:
        if close and hasattr(opt, "close"):
            opt.close()
    return TrainResult(losses, snapshot(model), extra)


def record_hot(step, model, opt, extra):
    """An after_step of train(): every 2-D weight's hot columns after each step, in
    extra["hot"]."""
    extra.setdefault("hot", []).append(
        {n: opt.hot_columns(p) for n, p in model.named_parameters() if p.dim() == 2})


def save_at(step_to_save, into):
    """An after_step of train() that keeps, after step `step_to_save`, the model's weights, the
    optimizer's state_dict() as torch.save bytes (into["opt_bytes"]) and the scheduler's."""
    def after_step(step, model, opt, extra):
        if step == step_to_save:
            into["model"] = {k: v.clone() for k, v in model.state_dict().items()}
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            into["opt_bytes"] = buf.getvalue()
            into["sched"] = extra["sched"].state_dict()
    return after_step


def resume_from(saved, load):
    """A setup of train() that loads what save_at kept: the weights, load(model, opt), the
    scheduler."""
    def setup(model, opt, sched):
        model.load_state_dict(saved["model"])
        load(model, opt)
        sched.load_state_dict(saved["sched"])
    return setup


def plain_steps(model, opt, steps, seed=0):
    """Steps 1..steps of the run `seed` with an existing optimizer, no scheduler; the losses."""
    losses = []
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch(seed, step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def max_abs_diff(a, b):
    """{name: max |a - b|} over two parameter dicts with the same names."""
    assert a.keys() == b.keys()
    return {n: (a[n] - b[n]).abs().max().item() for n in a}


def rel_diff(x, y):
    return abs(x - y) / max(abs(y), 1e-30)


def is_finite(params):
    return all(torch.isfinite(p).all() for p in params.values())


def cosine_lr_sum(base_lr, steps, eta_min=ETA_MIN):
    """sum over the steps of the learning rate CosineAnnealingLR(T_max=steps) applies."""
    return sum(eta_min + (base_lr - eta_min) * (1 + math.cos(math.pi * t / steps)) / 2
               for t in range(steps))


# ZenFlowAdamW's transfers in fp32 both ways: the configurations compared with torch's AdamW.
FP32 = dict(grad_dtype="fp32", param_dtype="fp32")

# Tolerances of the comparisons against torch.optim.AdamW (derived and measured in
# test_adamw_equivalence.py's docstring): losses relative, parameters absolute per element.
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
