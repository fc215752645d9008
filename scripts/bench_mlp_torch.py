#!/usr/bin/python3
"""PyTorch side of scripts/bench_cpu.sh: the fashion_mlp model (784-512-512-10, ReLU), AdamW(lr 1e-3,
weight decay 0.01 on weights only, as ampTrain applies it), batch 128, the same normalisation, timed over
the training steps only. Prints one line: 'torch MODE: N samples in S s: X samples/s, final loss L'.

usage: bench_mlp_torch.py STEPS MODE     MODE: fp32 | bf16 (CPU autocast bf16)
"""
import gzip
import struct
import sys
import time

import numpy as np
import torch

steps, mode = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)  # bench_cpu.sh THREADS
torch.manual_seed(1234)

root = "/usr/share/datasets/fashion-mnist/"
with gzip.open(root + "train-images-idx3-ubyte.gz") as f:
    n, h, w = struct.unpack(">III", f.read(16)[4:])
    x = np.frombuffer(f.read(), dtype=np.uint8).reshape(n, h * w)
with gzip.open(root + "train-labels-idx1-ubyte.gz") as f:
    y = np.frombuffer(f.read()[8:], dtype=np.uint8)
x = torch.from_numpy((x.astype(np.float32) / 255.0 - 0.2860) / 0.3530)
y = torch.from_numpy(y.astype(np.int64))

model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 10))
decay = [p for n_, p in model.named_parameters() if n_.endswith("weight")]
no_decay = [p for n_, p in model.named_parameters() if n_.endswith("bias")]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                        lr=1e-3)
loss_fn = torch.nn.CrossEntropyLoss()
batch = 128
g = torch.Generator().manual_seed(1234)
order = torch.randperm(n, generator=g)

def step(i):
    idx = order[(i * batch) % (n - batch):][:batch]
    xb, yb = x[idx], y[idx]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(mode == "bf16")):
        loss = loss_fn(model(xb).float(), yb)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss

for i in range(5):  # warm-up, not timed
    step(i)
t0 = time.perf_counter()
for i in range(steps):
    loss = step(i)
dt = time.perf_counter() - t0
print(f"torch {mode}: {steps * batch} samples in {dt:.2f} s: {steps * batch / dt:.1f} samples/s, final loss {loss.item():.4f}")
