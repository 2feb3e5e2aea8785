"""The MiniGPT of capstone in PyTorch eager, as a worker process for `python -m benchmarks.bench speed --vs-torch`.

Run by the Python of a separate venv that has torch (never capstone's venv); it imports nothing from
capstone. The bench starts it, and they talk over stdin/stdout, one JSON object a line; arrays
travel as raw files (ndarray.tofile / np.fromfile: no .npy, nothing that can unpickle) in a
directory the bench owns:

  {"cmd": "init", "cfg": {...}, "B": 8, "entries": [[name, shape, offset], ...], "dir": DIR, "opt": {...}}
      builds the model from DIR/params.f32 (capstone's flat buffer: the same initial values) and the
      batch from DIR/x.i64, DIR/y.i64 (B, T); AdamW with capstone's hyperparameters and decay groups
  {"cmd": "grads"}  forward+backward only; writes DIR/grads.f32 in capstone's flat layout, replies the loss;
                    {"cmd": "grads", "autocast": "bf16"}: under torch.autocast("cpu", torch.bfloat16)
  {"cmd": "step"}   one timed training step (zero_grad, forward, backward, clip, AdamW); replies ms and loss
  {"cmd": "params"} writes DIR/params_out.f32 in capstone's flat layout
  {"cmd": "profile", "n": N}  N training steps under torch.profiler; replies ms per step (self CPU
                    of every op) and mm_ms, the part in the linear layers' matmuls (aten::mm/addmm)
  {"cmd": "train", "B": B, "lr": lr}  one training step on DIR/train_x.i64, DIR/train_y.i64 (B, T) at
                    learning rate lr, loss scaled by 1/(B*T); replies the loss
  {"cmd": "eval", "n": N, "S": S}     mean loss per token over N*S rows of DIR/val_x.i64, DIR/val_y.i64,
                    forward only in batches of S rows; replies it

The model is the idiomatic eager one (what nanoGPT does on a CPU): nn.Linear-layout weights
(out, in) through F.linear, F.layer_norm, F.scaled_dot_product_attention(is_causal=True),
F.gelu(approximate="tanh"), F.cross_entropy(reduction="sum") times the same scale as capstone; the
biases the layout lacks (--no-bias, --no-head-bias) are None, and without lm_head.w (--tie-embeddings)
the head reads wte.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F


class TorchGPT:
    def __init__(self, cfg: dict, B: int, entries: list, flat: np.ndarray):
        self.V, self.T, self.C = cfg["vocab_size"], cfg["seq_len"], cfg["d_model"]
        self.H, self.L, self.B = cfg["n_heads"], cfg["n_layers"], B
        self.entries = [(n, tuple(s), o) for n, s, o in entries]
        self.n_flat = flat.size
        self.p = {}
        for name, shape, off in self.entries:
            a = flat[off:off + math.prod(shape)].reshape(shape)
            if self._transposed(name):
                a = a.T  # capstone stores (in, out); nn.Linear stores (out, in)
            self.p[name] = torch.nn.Parameter(torch.tensor(np.ascontiguousarray(a), dtype=torch.float32))

    @staticmethod
    def _transposed(name: str) -> bool:
        return name.endswith(".w") and not (".ln_" in name or name.startswith("ln_"))

    def loss(self, idx: torch.Tensor, tgt: torch.Tensor, scale: float) -> torch.Tensor:
        p, C, H = self.p, self.C, self.H
        B, T = idx.shape                                                        # any batch, T <= seq_len
        x = p["wte"][idx] + p["wpe"][:T]                                        # (B, T, C)
        for i in range(self.L):
            h = f"h{i}."
            a = F.layer_norm(x, (C,), p[h + "ln_1.w"], p.get(h + "ln_1.b"), 1e-5)
            q, k, v = F.linear(a, p[h + "attn.c_attn.w"], p.get(h + "attn.c_attn.b")).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
            x = x + F.linear(y, p[h + "attn.c_proj.w"], p.get(h + "attn.c_proj.b"))
            m = F.layer_norm(x, (C,), p[h + "ln_2.w"], p.get(h + "ln_2.b"), 1e-5)
            m = F.gelu(F.linear(m, p[h + "mlp.c_fc.w"], p.get(h + "mlp.c_fc.b")), approximate="tanh")
            x = x + F.linear(m, p[h + "mlp.c_proj.w"], p.get(h + "mlp.c_proj.b"))
        x = F.layer_norm(x, (C,), p["ln_f.w"], p.get("ln_f.b"), 1e-5)
        z = F.linear(x, p["lm_head.w"] if "lm_head.w" in p else p["wte"], p.get("lm_head.b"))   # tied: wte
        return F.cross_entropy(z.view(-1, self.V), tgt.view(-1), reduction="sum") * scale

    def flat(self, grads: bool) -> np.ndarray:
        out = np.zeros(self.n_flat, dtype=np.float32)
        for name, shape, off in self.entries:
            t = self.p[name].grad if grads else self.p[name]
            a = t.detach().numpy()
            out[off:off + math.prod(shape)] = (a.T if self._transposed(name) else a).reshape(-1)
        return out


def _tokens(d: str, name: str, rows: int, T: int) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(os.path.join(d, name), dtype=np.int64).reshape(rows, T))


def update(model: TorchGPT, opt, clip: float, idx: torch.Tensor, tgt: torch.Tensor) -> float:
    """One training step: zero_grad, forward, backward, clip, AdamW; returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss = model.loss(idx, tgt, 1.0 / idx.numel())
    loss.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(list(model.p.values()), clip)
    opt.step()
    return float(loss.detach())


def train(model: TorchGPT, opt, clip: float, d: str, B: int, lr: float) -> float:
    """One AdamW step on the batch in d at learning rate lr (capstone's schedule, computed by the caller)."""
    for group in opt.param_groups:
        group["lr"] = lr
    return update(model, opt, clip, _tokens(d, "train_x.i64", B, model.T), _tokens(d, "train_y.i64", B, model.T))


def evaluate(model: TorchGPT, d: str, n: int, S: int) -> float:
    """Mean loss per token over n batches of S rows (capstone's HeldOut on one rank)."""
    idx, tgt = _tokens(d, "val_x.i64", n * S, model.T), _tokens(d, "val_y.i64", n * S, model.T)
    with torch.no_grad():
        total = sum(float(model.loss(idx[k * S:(k + 1) * S], tgt[k * S:(k + 1) * S], 1.0)) for k in range(n))
    return total / idx.numel()


def profile(model: TorchGPT, opt, clip: float, idx: torch.Tensor, tgt: torch.Tensor, n: int) -> dict:
    """n training steps under torch.profiler: per step, the self CPU ms of all ops and of the linear
    layers' matmuls (aten::mm, aten::addmm: forward and both backward products)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            update(model, opt, clip, idx, tgt)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / n
    mm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm")) / 1e3 / n
    return {"ms": total, "mm_ms": mm}


def main() -> None:
    model = opt = None
    for line in sys.stdin:
        msg = json.loads(line)
        cmd, reply = msg["cmd"], {}
        if cmd == "init":
            torch.set_num_threads(int(msg.get("threads", 1)))
            d = msg["dir"]
            B, T = msg["B"], msg["cfg"]["seq_len"]
            model = TorchGPT(msg["cfg"], B, msg["entries"], np.fromfile(os.path.join(d, "params.f32"), dtype=np.float32))
            idx = torch.from_numpy(np.fromfile(os.path.join(d, "x.i64"), dtype=np.int64).reshape(B, T))
            tgt = torch.from_numpy(np.fromfile(os.path.join(d, "y.i64"), dtype=np.int64).reshape(B, T))
            o = msg["opt"]
            decay = [t for t in model.p.values() if t.dim() >= 2]
            no_decay = [t for t in model.p.values() if t.dim() < 2]
            opt = torch.optim.AdamW([{"params": decay, "weight_decay": o["weight_decay"]},
                                     {"params": no_decay, "weight_decay": 0.0}],
                                    lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"])
            clip = o["clip"]
            reply = {"torch": torch.__version__, "threads": torch.get_num_threads()}
        elif cmd == "grads":
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=msg.get("autocast") == "bf16"):
                loss = model.loss(idx, tgt, 1.0 / idx.numel())
            loss.backward()
            model.flat(grads=True).tofile(os.path.join(d, "grads.f32"))
            reply = {"loss": float(loss.detach())}
        elif cmd == "step":
            t, c = time.perf_counter(), time.process_time()
            loss = update(model, opt, clip, idx, tgt)
            reply = {"ms": 1e3 * (time.perf_counter() - t), "cpu_ms": 1e3 * (time.process_time() - c), "loss": loss}
        elif cmd == "profile":
            reply = profile(model, opt, clip, idx, tgt, int(msg["n"]))
        elif cmd == "train":
            reply = {"loss": train(model, opt, clip, d, msg["B"], msg["lr"])}
        elif cmd == "eval":
            reply = {"loss": evaluate(model, d, msg["n"], msg["S"])}
        elif cmd == "params":
            model.flat(grads=False).tofile(os.path.join(d, "params_out.f32"))
        elif cmd == "quit":
            break
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
