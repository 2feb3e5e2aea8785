"""A PyTorch eager twin of capstone's model in another venv's Python (benchmarks/torch_model.py).

It starts from capstone's flat parameter buffer (the same initial values) and talks over a pipe,
one JSON object a line; arrays travel as raw files in a directory this object owns (no .npy,
nothing that can unpickle). Used by `capstone.bench speed --vs-torch` and `benchmarks.torch_reference`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import numpy as np


class TorchWorker:
    """The torch process: built from (cfg, layout, params) with the batch (x, y) and AdamW settings `opt`
    (lr, betas, eps, weight_decay, clip)."""

    def __init__(self, python: str, cfg, layout, params: np.ndarray, batch: tuple, opt: dict):
        x, y = batch
        self.dir = tempfile.mkdtemp(prefix="capstone-torch-")
        params.tofile(os.path.join(self.dir, "params.f32"))
        self.write("x.i64", x)
        self.write("y.i64", y)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        self.proc = subprocess.Popen([python, os.path.join(os.path.dirname(__file__), "torch_model.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self.ask(cmd="init", cfg=cfg.__dict__, B=len(x), entries=layout.entries, dir=self.dir,
                             opt=opt, threads=1)

    def write(self, name: str, tokens) -> None:
        """Token ids for the worker to read as int64 (B, T)."""
        np.ascontiguousarray(tokens, dtype=np.int64).tofile(os.path.join(self.dir, name))

    def ask(self, **msg) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the torch worker exited ({self.proc.wait()})")
        return json.loads(line)

    def grads(self, autocast: str | None = None) -> tuple[float, np.ndarray]:
        """(loss, flat gradient) at the batch; `autocast` "bf16": under torch's CPU bfloat16 autocast."""
        loss = self.ask(cmd="grads", autocast=autocast)["loss"]
        return loss, np.fromfile(os.path.join(self.dir, "grads.f32"), dtype=np.float32)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
