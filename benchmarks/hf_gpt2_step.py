"""The PyTorch side of benchmarks/gpt2_finetune.py: transformers' GPT-2 fine-tuning steps in one process.

    TORCH_PYTHON benchmarks/hf_gpt2_step.py STEPS THREADS [N_LAYER N_EMBD N_HEAD SEQ]

GPT2LMHeadModel of GPT2Config() (GPT-2 small, 124M parameters, tied head; another size by the
optional arguments), random weights, dropout off; `torch.set_num_threads(THREADS)`; batch 1 of SEQ
random tokens, AdamW; STEPS timed steps after one warm-up step. Prints JSON: the median step
seconds, tokens/s and the peak RSS (VmHWM). Needs torch and transformers; offline.
"""

import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def main(steps: int, threads: int, n_layer=12, n_embd=768, n_head=12, seq=1024) -> None:
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=seq, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5)
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    print(json.dumps({"step_s": step, "tokens_per_s": seq / step, "threads": threads, "peak_rss_mib": peak_rss_mib(),
                      "parameters": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
                      "transformers": transformers.__version__}))


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
