"""make gpu-check: the device memory of a bf16 Hugging Face model step, ZenFlowAdamW against
torch.optim.AdamW, both with fp32 masters (issue 22: the figure users choose an offload system by).

A GPT-2 of about 100M parameters (built from a config, no download) in torch.bfloat16 takes
three steps of one batch with each optimizer in turn, in a fresh copy of the same weights, and
torch.cuda.max_memory_allocated() is read over those steps (reset before each run):

- torch.optim.AdamW over fp32 master copies of the bf16 parameters (the usual mixed-precision
  recipe: the bf16 gradients widened into the masters' .grad, the masters rounded back into the
  model after each step): 2 + 2 + 4 + 8 = 16 bytes a parameter plus the masters' fp32 gradients;
- ZenFlowAdamW zenflow with buffered transfers (CUDA's default), direct transfers, and direct
  with stream_gradients.

The engine allocates its device memory with cudaMalloc, outside torch's caching allocator, so
torch.cuda.max_memory_allocated() does not see it (the first GPU run of this check printed the
same peak for all three ZenFlowAdamW runs, whose engines hold 4.8, 1.2 and 1.4 bytes a parameter).
A run's peak is therefore torch's peak plus what the driver shows in use outside torch's
allocator at the end of the steps, against before the optimizer was built ((total - free) -
torch.cuda.memory_reserved(), from torch.cuda.mem_get_info()), plus the engine's largest
transient buffer (DeviceFootprint transient_peak, freed within a call).

Prints FIGURE gpu_max_memory_<run> <MiB> MiB, FIGURE gpu_outside_torch_<run> <MiB> MiB, the
engine's own accounting (ZenFlowAdamW.device_bytes, bytes per parameter) and each run's ratio to
AdamW's; activations are the same in every run. SKIP without a GPU. Exit status 1 if a run
fails, or if the driver's view of the engine's memory falls short of the engine's accounting.
"""
import sys

import torch

import stallfree
from stallfree.torch import ZenFlowAdamW

STEPS = 3
BATCH, SEQ = 8, 256


class MasterAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over fp32 masters of a bf16 model's parameters."""

    def __init__(self, params, lr):
        self.model_params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.model_params]
        super().__init__(self.masters, lr=lr)

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in zip(self.model_params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        super().step()
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)


def run(name, make_opt, init, config, tokens):
    import transformers
    torch.cuda.empty_cache()
    model = transformers.GPT2LMHeadModel(config).to("cuda", torch.bfloat16)
    model.load_state_dict(init)
    torch.cuda.synchronize()
    outside_before = outside_torch()
    opt = make_opt(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        for _ in range(STEPS):
            loss = model(tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch_peak = torch.cuda.max_memory_allocated()
        outside = outside_torch() - outside_before
        engine = getattr(opt, "device_bytes", None)
    finally:
        if hasattr(opt, "close"):
            opt.close()
    n = sum(p.numel() for p in model.parameters())
    transient = engine["transient_peak"] if engine else 0
    peak = torch_peak + max(outside, 0) + transient
    print("FIGURE gpu_max_memory_%s %.1f MiB (torch's peak %.1f + outside torch's allocator %.1f "
          "+ engine transient %.1f; model and optimizer built: %.1f MiB in torch; %d parameters; "
          "loss %.4f)" % (name, peak / 2**20, torch_peak / 2**20, outside / 2**20,
                          transient / 2**20, base / 2**20, n, loss.item()), flush=True)
    print("FIGURE gpu_outside_torch_%s %.1f MiB" % (name, outside / 2**20), flush=True)
    if engine:
        print("  %s engine accounting, bytes per parameter: %s" % (
            name, {k: round(v / n, 3) for k, v in sorted(engine.items())}), flush=True)
        # The driver must see at least what the engine says it holds (less 1%: the accounting
        # counts exact bytes, the driver pages of 2 MiB, so it may only show more).
        own = engine["engine"]
        if outside < 0.99 * own:
            raise RuntimeError("the driver shows %.1f MiB outside torch's allocator, the engine "
                               "accounts for %.1f MiB" % (outside / 2**20, own / 2**20))
    return peak


def outside_torch():
    """Device bytes in use that torch's caching allocator does not hold (cudaMalloc by others,
    the CUDA context's growth), as the driver reports them."""
    free, total = torch.cuda.mem_get_info()
    return (total - free) - torch.cuda.memory_reserved()


def main():
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    try:
        import transformers
    except ImportError:
        print("SKIP: transformers is not installed")
        return 0
    config = transformers.GPT2Config(vocab_size=8192, n_positions=SEQ, n_embd=768, n_layer=12,
                                     n_head=12, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    init = transformers.GPT2LMHeadModel(config).to(torch.bfloat16).state_dict()
    tokens = torch.randint(0, config.vocab_size, (BATCH, SEQ), device="cuda")
    with stallfree.Daemon() as daemon:
        runs = {
            "adamw_fp32_masters": lambda m: MasterAdamW(m.parameters(), lr=1e-4),
            "zenflow_buffered": lambda m: ZenFlowAdamW(
                m.parameters(), lr=1e-4, transfers="buffered", socket=daemon.socket),
            "zenflow_direct": lambda m: ZenFlowAdamW(
                m.parameters(), lr=1e-4, transfers="direct", socket=daemon.socket),
            "zenflow_direct_streamed": lambda m: ZenFlowAdamW(
                m.parameters(), lr=1e-4, transfers="direct", stream_gradients=True,
                socket=daemon.socket),
        }
        peaks = {}
        for name, make in runs.items():
            try:
                peaks[name] = run(name, make, init, config, tokens)
            except Exception as e:  # report every run, then fail
                print("FAIL %s: %s: %s" % (name, type(e).__name__, e), flush=True)
    base = peaks.get("adamw_fp32_masters")
    for name, peak in peaks.items():
        if base and name != "adamw_fp32_masters":
            print("FIGURE gpu_max_memory_%s_over_adamw %.3f x" % (name, peak / base))
    return 0 if len(peaks) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
