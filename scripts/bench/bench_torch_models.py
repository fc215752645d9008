#!/usr/bin/python3
"""PyTorch side of scripts/bench/bench_cpu.sh for the three reference models, each as its config builds it, trained
as ampTrain trains it, timed over the training steps only (5 warm-up steps first, not timed):

  mlp  configs/fashion_mlp.yaml  784-512-512-10 ReLU; AdamW lr 1e-3, weight decay 0.01 on weights only; batch 128
  cnn  configs/fashion_cnn.yaml  conv 3x3 32, batchnorm, ReLU, maxpool 2, conv 3x3 64, batchnorm, ReLU, maxpool 2,
                                 linear 3136-128, ReLU, dropout 0.2, linear 128-10; AdamW as mlp; batch 128
  gpt  configs/text_gpt.yaml     bytes (vocab 256), seq_len 64, dim 128, 2 pre-LN blocks of 4 heads (causal
                                 attention, GELU tanh MLP 4x), final layernorm, lm_head 128-256; AdamW lr 1e-3,
                                 betas (0.9, 0.95), weight decay 0.01 on linear weights; L2 clipping at 1.0; batch 32

Fashion-MNIST normalised as the configs say (mean 0.2860, std 0.3530); the GPT reads windows of the fortunes
files the config lists. Prints one line: 'torch MODEL MODE: N samples in S s: X samples/s, final loss L' (a
sample is an image, or a window of 64 tokens, as ampTrain counts them).

usage: bench_torch_models.py MODEL STEPS MODE [THREADS]     MODE: fp32 | bf16 (CPU autocast bf16)
With AMPTRAIN_TORCH_PROFILE=1 in the environment the timed steps run under torch.profiler and its table (self CPU time
by operator, over all the timed steps) follows the line: where PyTorch's step goes, beside AMPTRAIN_POOL_PROFILE's.
"""
import os
import gzip
import math
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

model_name, steps, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 1)  # bench_cpu.sh THREADS
torch.manual_seed(1234)


def fashion(flat):
    root = "/usr/share/datasets/fashion-mnist/"
    with gzip.open(root + "train-images-idx3-ubyte.gz") as f:
        n, h, w = struct.unpack(">III", f.read(16)[4:])
        x = np.frombuffer(f.read(), dtype=np.uint8).reshape((n, h * w) if flat else (n, 1, h, w))
    with gzip.open(root + "train-labels-idx1-ubyte.gz") as f:
        y = np.frombuffer(f.read()[8:], dtype=np.uint8)
    return torch.from_numpy((x.astype(np.float32) / 255.0 - 0.2860) / 0.3530), torch.from_numpy(y.astype(np.int64))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab=256, seq=64, dim=128, heads=4, blocks=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(blocks)])
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.lm_head(self.ln_f(self.blocks(x)))


clip = 0.0
if model_name == "mlp":
    x, y = fashion(flat=True)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    batch, betas = 128, (0.9, 0.999)
elif model_name == "cnn":
    x, y = fashion(flat=False)
    model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(3136, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    batch, betas = 128, (0.9, 0.999)
elif model_name == "gpt":
    names = ["cookie", "computers", "songs-poems", "definitions", "people", "science", "politics", "work"]
    text = b"".join(open("/usr/share/games/fortunes/" + n, "rb").read() for n in names)
    tokens = torch.from_numpy(np.frombuffer(text, dtype=np.uint8).astype(np.int64))
    windows = (len(tokens) - 1) // 65
    x = tokens[:windows * 65].view(windows, 65)
    y = None
    model = GPT()
    batch, betas, clip = 32, (0.9, 0.95), 1.0
else:
    sys.exit(f"bench_torch_models: unknown model {model_name} (mlp, cnn or gpt)")

# decay on linear and conv weights only, as ampTrain (embedding tables, biases and norms have none)
decay = [m.weight for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
decay_ids = {id(p) for p in decay}
no_decay = [p for p in model.parameters() if id(p) not in decay_ids]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=1e-3, betas=betas)
n = x.shape[0]
order = torch.randperm(n, generator=torch.Generator().manual_seed(1234))


def step(i):
    idx = order[(i * batch) % (n - batch):][:batch]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(mode == "bf16")):
        if y is None:
            w = x[idx]
            logits = model(w[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 256), w[:, 1:].reshape(-1))
        else:
            loss = F.cross_entropy(model(x[idx]).float(), y[idx])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss


model.train()
for i in range(5):  # warm-up, not timed
    step(i)
prof = None
if os.environ.get("AMPTRAIN_TORCH_PROFILE") == "1":
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    prof.__enter__()
t0 = time.perf_counter()
for i in range(steps):
    loss = step(i)
dt = time.perf_counter() - t0
if prof is not None:
    prof.__exit__(None, None, None)
print(f"torch {model_name} {mode}: {steps * batch} samples in {dt:.2f} s: {steps * batch / dt:.1f} samples/s, "
      f"final loss {loss.item():.4f}")
if prof is not None:
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
