"""A reference ZenFlow optimizer in plain PyTorch, written from ARCHITECTURE.md's description
("The ZenFlow engine"), without stallfree: the independent check of the engine.

The algorithm, per parameter group, with t = 1, 2, ... the group's steps, S = update_interval,
W = warmup_steps, k = max(1, round_half_up(topk_ratio * cols)) for a weight of `cols` input
columns (its last dimension; rows = the product of the others):

- 1-D parameters, and weights with fewer than 4 cold columns (cols - k < 4), are plain AdamW
  every step, with their own step count.
- Every other weight is split by column. Selection at t = 1 before the step's updates, and
  after the step's updates at every t >= max(W, 1) with (t - W) % select_interval == 0 (a round
  boundary: the last warm-up step, then every select_interval steps): per-column score = sum
  over rows of grad^2 of step t's gradient; the k highest are hot (ties to the lower column)
  from step t + 1 on.
- Hot columns: AdamW every step with the step's gradient; each column has its own step count
  (bias correction) and its own m, v.
- Cold columns: their gradient is averaged over the round, acc += g / S; at the round's last
  step (a boundary: (t - W) % S == 0) AdamW runs on them once with the round's mean gradient and
  the boundary step's lr, each column with its own step count.
- Staleness: the model sees a cold column's value as of the previous round's update (the
  update of round R lands in the model at the boundary of round R+1), unless await_updates, in
  which case the update lands at once. A column that enters the hot set shows its current
  value (its master) at once; a column that leaves it keeps showing its current value.
- Reselection is exact: every column keeps its fp32 value, m, v and step count whether it is hot
  or cold, so here a reselection only changes which columns are hot.
- Warm-up (t <= W): S = 1 and awaited, no reselection after t = 1.
- cold_warmup (a variant the engine does not have; bench/zenflow_variants.py measures it):
  with S > 1 the r-th round's cold update runs at lr * min(1, r / cold_warmup) (0: off, the
  engine), or with "auto" at min(lr, the lr of step r).
- cold_lr_scale (a variant, measured by bench/zenflow_variants.py): with S > 1 the cold update
  runs at lr * cold_lr_scale.
- predict_cold (the engine's predict_cold, its default; here off unless asked): when a stale
  update of a round of one step lands (not awaited), the model is given the cold columns
  extrapolated one step ahead,
  2 * new - previous (the masters before that update: those landed before, or given exactly by
  an awaited update or while the column was hot), instead of the new masters; close() lands
  the prediction too.
- land_lag (a variant): with S > 1 and not awaited, round R's update lands in the model land_lag
  steps after its boundary (1 <= land_lag <= S; None: S, the engine: at the next boundary), so
  the model's cold columns are at most land_lag steps stale instead of S.
- cold_steps (a variant): "round" (the engine: a cold column's bias-correction count grows by
  one per round update) or "micro" (DeepSpeed's ZenFlowCPUAdam: the count is the step number,
  so it grows by S per round; while beta2^t is far from 0 this enlarges the cold step by about
  sqrt(S), since v holds t / S updates but is corrected as if it held t).
- delay_comp (a variant): lambda of a delay compensation in the manner of DC-ASGD on the cold
  gradient, g + lambda g^2 (master - shown value) / sqrt(v), while the model shows stale cold
  values (0: off, the engine).
- update_interval "auto" (the engine's default; 0 likewise): rounds of 1 until the engine
  chooses a length, at the end of a reselection step from the warm-up's last one on; the
  choice comes from timing, so the reference takes the lengths the engine chose: `resize`,
  per param group {step b: S}, the rounds after step b are S long, counted from b (the
  reselection period is 4 S from b, and the update issued at b lands after the new S, or
  min(land_lag, S), steps). With a fixed update_interval a resize works the same way.
- close() lands the pending update (the end of training).

AdamW is torch.optim.AdamW's (decoupled weight decay p *= 1 - lr*wd, then the Adam step with
bias corrections 1 - beta^t), written out here with a per-column t.

bf16 parameters (ARCHITECTURE.md, "Precision"): every parameter has an fp32 master (here: split
weights' `master`, dense parameters' state["master"]), AdamW runs on the masters with the fp32
widening of the bf16 gradient, and the model is given the masters rounded to bf16 (round to
nearest even, torch's cast): a bf16 value is always the rounding of its fp32 master, never
re-derived from itself. fp32 parameters are their own masters.
"""
import math

import torch


def _as(master, p):
    """fp32 masters as the model's values: rounded to bf16 (nearest even) for a bf16 model."""
    return master.to(p.dtype)


def _k_of(ratio, cols):
    return min(cols, max(1, int(math.floor(ratio * cols + 0.5))))


def _adamw_(p, g, m, v, steps, lr, beta1, beta2, eps, wd, bc=None):
    """In place, on 2-D [rows, n] slices with a step count per column (steps: [n] int64, already
    incremented), or on any shape with a scalar steps. bc: (bc1, bc2) given instead of
    1 - beta ** steps (the sqrt_rule variant's per-column products).

    torch.optim.AdamW's step, written as kernels/optimizer.h states it: the constants (beta,
    1 - beta, 1 - lr wd, eps, lr / (1 - beta1^t), sqrt(1 - beta2^t)) computed in double and
    rounded to fp32 once, then one fp32 operation at a time, each rounded (no fused multiply-
    add: torch's add with alpha and addcmul may fuse, so they are not used):
        p = p * decay;  m = b1 m + (1 - b1) g;  v = b2 v + ((1 - b2) g) g;
        p = p - step_size * (m / (sqrt(v) / bc2_sqrt + eps)).
    So a run equals the engine's kernels bit for bit, not merely to rounding."""
    f32 = torch.float32
    p.mul_(1 - lr * wd)  # a Python float: torch rounds it to the tensor's fp32 once
    m.mul_(beta1).add_(g * (1 - beta1))
    v.mul_(beta2).add_(g * (1 - beta2) * g)
    if bc is None:
        ts = steps.reshape(-1).tolist()  # C's pow, as the kernels' std::pow
        step_size = torch.tensor([lr / (1 - math.pow(beta1, t)) for t in ts], dtype=f32)
        bc2_sqrt = torch.tensor([math.sqrt(1 - math.pow(beta2, t)) for t in ts], dtype=f32)
    else:
        bc1, bc2 = bc
        step_size = (lr / bc1).to(f32)
        bc2_sqrt = bc2.sqrt().to(f32)
    # sqrt in double, rounded once: the correctly rounded fp32 sqrt (torch's fp32 sqrt on the
    # CPU is not: it differs in the last bit for about 0.6% of values).
    denom = (v.double().sqrt().to(f32) / bc2_sqrt).add_(eps)
    p.sub_(step_size * (m / denom))


class _Split:
    """One weight viewed as [rows, cols]: every column's fp32 master, m, v, step count; which
    are hot; the cold accumulator; the values the model sees of the cold columns."""

    def __init__(self, p, k):
        self.cols = p.shape[-1]
        self.k = k
        self.master = p.detach().reshape(-1, self.cols).float().clone()  # fp32 for bf16 too
        self.m = torch.zeros_like(self.master)
        self.v = torch.zeros_like(self.master)
        self.steps = torch.zeros(self.cols, dtype=torch.int64)
        self.prod1 = torch.ones(self.cols, dtype=torch.float64)  # sqrt_rule: prod of beta1s
        self.prod2 = torch.ones(self.cols, dtype=torch.float64)
        self.hot = torch.zeros(self.cols, dtype=torch.bool)
        self.acc = torch.zeros_like(self.master)
        self.pending = None  # the masters an update produced that the model does not see yet
        self.pending_predicted = False  # it lands predicted (predict_cold, rounds of one step)
        self.landed = self.master.clone()  # the masters the model was last given exactly


class ReferenceZenFlow(torch.optim.Optimizer):
    """ZenFlow as described above; no daemon, no C++. Same constructor arguments as
    stallfree.torch.ZenFlowAdamW's (the transfer dtypes do not apply: everything is fp32)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                 topk_ratio=0.1, update_interval=4, select_interval=None, warmup_steps=20,
                 await_updates=False, cold_warmup=0, cold_lr_scale=1.0, predict_cold=False,
                 lr_scale=1.0, cold_scale=1.0, sqrt_rule=False, migrate_v=False,
                 select_by="grad", land_lag=None, cold_steps="round", delay_comp=0.0,
                 resize=None):
        # lr_scale, cold_scale: deliberate errors (every lr scaled; the cold accumulation scaled),
        # for showing that a test's tolerance catches a slightly wrong reference.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.ratio = topk_ratio
        if update_interval in ("auto", 0):
            update_interval = 1  # until a resize
            if select_interval:
                raise ValueError("select_interval: 4 rounds with update_interval auto")
        # Per group: the round length now, and the step it counts from.
        self.Sg = [update_interval] * len(self.param_groups)
        self.base = [warmup_steps] * len(self.param_groups)
        self.resize = resize or {}
        self.select_fixed = select_interval
        self.W = warmup_steps
        self.await_updates = await_updates
        self.t = [0] * len(self.param_groups)
        self.cold_warmup = cold_warmup
        self.cold_lr_scale = cold_lr_scale
        self.predict_cold = predict_cold
        self.cold_rounds = [0] * len(self.param_groups)
        self.lr_history = [[] for _ in self.param_groups]
        self.reselections = 0
        self.lr_scale, self.cold_scale = lr_scale, cold_scale
        self.sqrt_rule, self.migrate_v, self.select_by = sqrt_rule, migrate_v, select_by
        self.land_lag = land_lag or None  # None: the round's length
        if land_lag and not 1 <= land_lag <= max(update_interval, max(
                [S for r in self.resize.values() for S in r.values()], default=1)):
            raise ValueError("land_lag must be in [1, update_interval]")
        if cold_steps not in ("round", "micro"):
            raise ValueError("cold_steps: 'round' or 'micro'")
        self.cold_steps = cold_steps
        self.delay_comp = delay_comp

    def _split(self, p):
        st = self.state[p]
        if "split" not in st and "dense" not in st:
            k = _k_of(self.ratio, p.shape[-1])
            if p.dim() >= 2 and p.shape[-1] - k >= 4:
                st["split"] = _Split(p, k)
            else:
                st["dense"] = True
                st["master"] = p.detach().float().clone() if p.dtype != torch.float32 else None
                st["m"] = torch.zeros_like(p, dtype=torch.float32)
                st["v"] = torch.zeros_like(p, dtype=torch.float32)
                st["step"] = torch.zeros((), dtype=torch.int64)
        return st.get("split")

    def hot_columns(self, p):
        sp = self.state[p].get("split")
        if sp is None:
            return list(range(p.shape[-1]))
        return torch.nonzero(sp.hot).flatten().tolist()

    @torch.no_grad()
    def close(self):
        """The end of training: the model takes the newest update's cold values (predicted, with
        predict_cold; gradients of an unfinished round stay unapplied), as ZenFlowAdamW.close()
        does."""
        for group in self.param_groups:
            for p in group["params"]:
                sp = self.state[p].get("split") if p in self.state else None
                if sp is not None and sp.pending is not None:
                    self._land(sp, p.data.view(-1, sp.cols), ~sp.hot, p)

    def _land(self, sp, view, cold, p):
        """The pending update's cold columns into the model (one step ahead when it was
        predicted: predict_cold with a round of one step)."""
        if sp.pending_predicted:
            view[:, cold] = _as((2 * sp.pending - sp.landed)[:, cold], p)
        else:
            view[:, cold] = _as(sp.pending[:, cold], p)
        # The base of the next prediction: these masters where they landed (the hot columns'
        # are their current ones: a column handed over goes out as it is, its change zero).
        sp.landed[:, cold] = sp.pending[:, cold]
        sp.pending = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self.t[gi] += 1
            t = self.t[gi]
            warm = t <= self.W
            S_now, base = self.Sg[gi], self.base[gi]
            S = 1 if warm else S_now
            await_ = self.await_updates or warm
            boundary = warm or (t - base) % S_now == 0
            select = t == 1
            period = self.select_fixed or 4 * S_now
            reselect = t >= max(self.W, 1) and boundary and (t - base) % period == 0
            # A new length chosen at the end of this step: the rounds after it, and where this
            # step's update lands.
            S_next = self.resize.get(gi, {}).get(t, S_now)
            if t in self.resize.get(gi, {}):
                self.Sg[gi], self.base[gi] = S_next, t
            lag = S_next if self.land_lag is None else min(self.land_lag, S_next)
            lr, (b1, b2), eps, wd = (group["lr"] * self.lr_scale, group["betas"], group["eps"],
                                     group["weight_decay"])
            cold_lr = lr * (self.cold_lr_scale if S > 1 else 1.0)
            self.lr_history[gi].append(lr)
            if boundary and S > 1:
                self.cold_rounds[gi] += 1
                r = self.cold_rounds[gi]
                if self.cold_warmup == "auto":
                    cold_lr = min(cold_lr, self.lr_history[gi][r - 1])
                elif self.cold_warmup > 0:
                    cold_lr = cold_lr * min(1.0, r / self.cold_warmup)
            for p in group["params"]:
                if p.grad is None:
                    continue
                sp = self._split(p)
                if sp is None:  # wholly on the device: AdamW
                    st = self.state[p]
                    st["step"] += 1
                    master = p.data if st["master"] is None else st["master"]
                    _adamw_(master, p.grad.float(), st["m"], st["v"], st["step"], lr, b1, b2, eps,
                            wd)
                    if st["master"] is not None:
                        p.data.copy_(master)  # the rounding of the master
                    continue
                g = p.grad.float().reshape(-1, sp.cols)
                view = p.data.view(-1, sp.cols)
                def choose():
                    if self.select_by == "snr" and t > 1:
                        scores = (sp.m * sp.m / (sp.v + 1e-30)).sum(0)
                    elif self.select_by == "update" and t > 1:
                        scores = (sp.m * sp.m / (sp.v.sqrt() + eps) ** 2).sum(0)
                    else:
                        scores = (g * g).sum(0)
                    was_hot = sp.hot.clone()
                    order = sorted(range(sp.cols), key=lambda c: (-scores[c].item(), c))
                    sp.hot.zero_()
                    sp.hot[order[:sp.k]] = True
                    # Exact migration: every column keeps its master, m, v and step; the model
                    # shows the masters of the hot columns.
                    view[:, sp.hot] = _as(sp.master[:, sp.hot], p)
                    if self.migrate_v and t > 1 and S > 1:
                        sp.v[:, sp.hot & ~was_hot] *= S
                        sp.v[:, was_hot & ~sp.hot] /= S

                if select:
                    choose()
                hot, cold = sp.hot, ~sp.hot
                # Hot columns: AdamW now.
                sp.steps[hot] += 1
                bc = None
                if self.sqrt_rule:
                    sp.prod1[hot] *= b1
                    sp.prod2[hot] *= b2
                    bc = (1 - sp.prod1[hot]), (1 - sp.prod2[hot])
                mh, mm, mv = sp.master[:, hot], sp.m[:, hot], sp.v[:, hot]
                _adamw_(mh, g[:, hot], mm, mv, sp.steps[hot], lr, b1, b2, eps, wd, bc)
                sp.master[:, hot], sp.m[:, hot], sp.v[:, hot] = mh, mm, mv
                view[:, hot] = _as(mh, p)
                if self.predict_cold:  # shown exactly: a column that turns cold predicts from it
                    sp.landed[:, hot] = mh
                # Cold columns: the round's mean gradient, applied at the boundary.
                # scale 1/S rounded to fp32 once, as the daemon's accumulation takes it
                gc = g[:, cold]
                if self.delay_comp and not await_:
                    # DC-ASGD's correction, with Adam's v as its curvature scale: the gradient
                    # taken at the stale values the model shows, moved to the masters the
                    # daemon holds, g + lambda g^2 (master - shown) / sqrt(v).
                    shown = view[:, cold].float()
                    gc = gc + self.delay_comp * gc * gc * (sp.master[:, cold] - shown) / (
                        sp.v[:, cold].sqrt() + eps)
                sp.acc[:, cold] += gc * (torch.tensor(1.0 / S) * self.cold_scale).float()
                if boundary:
                    sp.steps[cold] += S if self.cold_steps == "micro" else 1
                    cb1, cb2, ceps, clr, cwd = b1, b2, eps, cold_lr, wd
                    if self.sqrt_rule and S > 1:  # Adam's SDE scaling rule for a batch S x
                        cb1 = max(0.0, 1 - S * (1 - b1))
                        cb2 = max(0.0, 1 - S * (1 - b2))
                        ceps = eps / math.sqrt(S)
                        clr = cold_lr * math.sqrt(S)
                        cwd = wd * math.sqrt(S)  # the decay, a drift, scales with S
                    bc = None
                    if self.sqrt_rule:
                        sp.prod1[cold] *= cb1
                        sp.prod2[cold] *= cb2
                        bc = (1 - sp.prod1[cold]), (1 - sp.prod2[cold])
                    mc, mmc, mvc = sp.master[:, cold], sp.m[:, cold], sp.v[:, cold]
                    _adamw_(mc, sp.acc[:, cold], mmc, mvc, sp.steps[cold], clr, cb1, cb2, ceps,
                            cwd, bc)
                    sp.master[:, cold], sp.m[:, cold], sp.v[:, cold] = mc, mmc, mvc
                    sp.acc.zero_()
                    if await_:
                        view[:, cold] = _as(mc, p)
                        sp.landed = sp.master.clone()  # given exactly: the next prediction's base
                    else:
                        if sp.pending is not None:  # land_lag = S: the previous round's, now
                            self._land(sp, view, cold, p)
                        sp.pending = sp.master.clone()
                        sp.pending_predicted = self.predict_cold and S == 1
                        sp.land_at = t + lag
                elif sp.pending is not None and t == getattr(sp, "land_at", None):
                    self._land(sp, view, cold, p)
                if reselect:
                    choose()
                    self.reselections += 1
        return loss
