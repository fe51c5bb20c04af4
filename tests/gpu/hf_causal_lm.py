"""make gpu-check: a Hugging Face `transformers` causal LM trained on the GPU with ZenFlowAdamW.

A small GPT-2 (built from a config, no download) learns the project's generated corpus as bytes
for STEPS steps, three times from the same weights and batches: torch.optim.AdamW, ZenFlowAdamW
in zenflow mode with zero staleness and fp32 transfers (which must track AdamW: the same
algorithm), and ZenFlowAdamW with the defaults (bf16, update_interval 4, asynchronous). Checks:
each run's loss falls; the zero-staleness run's losses stay within 1e-3 relative of AdamW's
(GPU kernels differ in rounding, and 40 steps of a 6M-parameter model amplify it less than
that); the defaults end within 15% of AdamW's final loss. Prints FIGURE lines (tokens/s and
optimizer-step time per mode) and exits non-zero on a failed check; SKIP without a GPU.
"""
import sys
import time

import torch

import stallfree
from stallfree.torch import ZenFlowAdamW

STEPS = 40
BATCH, SEQ = 16, 128


def main():
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    try:
        import transformers
    except ImportError:
        print("SKIP: transformers is not installed")
        return 0
    dev = torch.device("cuda")
    text = torch.tensor(list(stallfree.default_corpus_text(1 << 20)), dtype=torch.long)
    config = transformers.GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=256, n_layer=4,
                                     n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    init = transformers.GPT2LMHeadModel(config).state_dict()
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(text) - SEQ - 1, (STEPS, BATCH), generator=g)
    batches = [torch.stack([text[s:s + SEQ] for s in row]).to(dev) for row in starts]

    def run(name, make_opt):
        model = transformers.GPT2LMHeadModel(config).to(dev)
        model.load_state_dict(init)
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = make_opt([{"params": decay, "weight_decay": 0.1},
                        {"params": rest, "weight_decay": 0.0}])
        losses, opt_time = [], 0.0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x in batches:
            out = model(input_ids=x, labels=x)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.cuda.synchronize()
            s0 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            opt_time += time.perf_counter() - s0
            losses.append(out.loss.item())
        total = time.perf_counter() - t0
        if hasattr(opt, "close"):
            opt.close()
        print("%-22s loss %.4f -> %.4f  %.0f tokens/s  optimizer step %.2f ms"
              % (name, losses[0], losses[-1], STEPS * BATCH * SEQ / total,
                 1e3 * opt_time / STEPS))
        print("FIGURE hf_%s_tokens_per_s %.1f tokens/s" % (name, STEPS * BATCH * SEQ / total))
        print("FIGURE hf_%s_optimizer_step %.3f ms" % (name, 1e3 * opt_time / STEPS))
        return losses

    with stallfree.Daemon() as daemon:
        ref = run("torch_adamw", lambda g: torch.optim.AdamW(g, lr=1e-3))
        exact = run("zenflow_awaited_fp32", lambda g: ZenFlowAdamW(
            g, lr=1e-3, update_interval=1, await_updates=True, grad_dtype="fp32",
            param_dtype="fp32", socket=daemon.socket))
        default = run("zenflow_default", lambda g: ZenFlowAdamW(g, lr=1e-3,
                                                               socket=daemon.socket))
    failures = []
    for name, losses in (("torch_adamw", ref), ("zenflow_awaited_fp32", exact),
                         ("zenflow_default", default)):
        if not losses[-1] < losses[0] - 0.5:
            failures.append("%s: the loss did not fall (%.4f -> %.4f)"
                            % (name, losses[0], losses[-1]))
    worst = max(abs(a - b) / abs(b) for a, b in zip(exact, ref))
    print("FIGURE hf_zenflow_awaited_vs_adamw_max_loss_rel_diff %.2e x" % worst)
    if worst > 1e-3:
        failures.append("zero-staleness zenflow left AdamW's losses by %.2e relative" % worst)
    ratio = default[-1] / ref[-1]
    print("FIGURE hf_zenflow_default_vs_adamw_final_loss %.4f x" % ratio)
    if ratio > 1.15:
        failures.append("zenflow (defaults) ended at %.3fx AdamW's loss" % ratio)
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
