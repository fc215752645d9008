#!/usr/bin/env python3
"""PyTorch (CUDA, eager) side of scripts/gpu/gpu-check.sh: the reference models of configs/ with the same
shapes, batch, optimizer and AMP semantics as ampTrain, timed over the training steps only (after a
warm-up, with torch.cuda.synchronize around the timed region).

  fashion_mlp: 784-512-512-10 ReLU MLP, batch 128, AdamW(lr 1e-3, wd 0.01 on weights)
  fashion_cnn: conv3x3(32)-BN-ReLU-maxpool2 -> conv3x3(64)-BN-ReLU-maxpool2 -> fc 3136-128 ReLU dropout(0.2)
               -> fc 128-10, batch 128, AdamW(lr 1e-3, wd 0.01)
  text_gpt:    byte-level GPT (vocab 256), pre-LN blocks with GELU(tanh) MLP (ratio 4), context 64,
               batch 32, AdamW(lr 1e-3, betas 0.9/0.95, wd 0.01), clip 1.0; width/layers/heads settable
Modes: fp32 (TF32 off), fp16-dynamic (torch.autocast fp16 + GradScaler), bf16 (torch.autocast bf16).
Prints one line: 'torch MODEL MODE: X samples/s (Y tokens/s), peak Z MiB (device in use D MiB), final loss L'
(the device figure on CUDA only: Z counts tensors, D everything in use on the device, as ampTrain's figure).

usage: bench_gpu_torch.py MODEL MODE STEPS [--width W --layers L --heads H --seq S --batch B] [--device cpu]
(--device cpu: gpu-check.sh's DRY run, which checks the plumbing and measures nothing)
"""
import argparse
import contextlib
import gzip
import glob
import struct
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("model", choices=["fashion_mlp", "fashion_cnn", "text_gpt"])
ap.add_argument("mode", choices=["fp32", "fp16-dynamic", "bf16"])
ap.add_argument("steps", type=int)
ap.add_argument("--width", type=int, default=128)
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--heads", type=int, default=4)
ap.add_argument("--seq", type=int, default=64)
ap.add_argument("--batch", type=int, default=0)
ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
args = ap.parse_args()

torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, as ampTrain without precision.tf32
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(1234)
dev = torch.device(args.device)
sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)


def fashion():
    root = "/usr/share/datasets/fashion-mnist/"
    try:
        with gzip.open(root + "train-images-idx3-ubyte.gz") as f:
            n, h, w = struct.unpack(">III", f.read(16)[4:])
            x = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).reshape(n, h * w)
        with gzip.open(root + "train-labels-idx1-ubyte.gz") as f:
            y = torch.frombuffer(bytearray(f.read()[8:]), dtype=torch.uint8)
    except OSError:  # no dataset on this machine: random data of the same shape (throughput only)
        x = torch.randint(0, 256, (60000, 784), dtype=torch.uint8)
        y = torch.randint(0, 10, (60000,), dtype=torch.uint8)
    x = (x.float() / 255.0 - 0.2860) / 0.3530
    return x.to(dev), y.long().to(dev)


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        # the same composite as ampTrain (scores, masked softmax, probs @ V), not a fused kernel
        s = (q @ k.transpose(-2, -1)) / (C // self.h) ** 0.5
        mask = torch.ones(T, T, device=x.device, dtype=torch.bool).tril()
        p = F.softmax(s.masked_fill(~mask, float("-inf")).float(), dim=-1).to(v.dtype)
        a = (p @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, c, layers, heads, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, c), nn.Embedding(seq, c)
        self.blocks = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(c), nn.Linear(c, 256)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


if args.model == "fashion_mlp":
    x, y = fashion()
    batch = args.batch or 128
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt_kw = dict(lr=1e-3)
    tokens_per_sample = 0
elif args.model == "fashion_cnn":
    x, y = fashion()
    x = x.view(-1, 1, 28, 28)
    batch = args.batch or 128
    model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(3136, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    opt_kw = dict(lr=1e-3)
    tokens_per_sample = 0
else:
    data = b"".join(open(f, "rb").read() for f in sorted(glob.glob("/usr/share/games/fortunes/*"))
                    if not f.endswith(".dat") and not f.endswith(".u8"))
    if len(data) < 100000:
        data = bytes(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).tolist())
    text = torch.frombuffer(bytearray(data), dtype=torch.uint8).long().to(dev)
    batch = args.batch or 32
    model = GPT(args.width, args.layers, args.heads, args.seq)
    opt_kw = dict(lr=1e-3, betas=(0.9, 0.95))
    tokens_per_sample = args.seq
model = model.to(dev)
decay = [p for n_, p in model.named_parameters() if p.dim() >= 2]
no_decay = [p for n_, p in model.named_parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                        **opt_kw)
lowp = {"fp32": None, "fp16-dynamic": torch.float16, "bf16": torch.bfloat16}[args.mode]
try:  # torch >= 2.3
    scaler = torch.amp.GradScaler(args.device, enabled=(args.mode == "fp16-dynamic"))
except AttributeError:  # older: the CUDA scaler (a DRY run on the CPU goes without one)
    scaler = torch.cuda.amp.GradScaler(enabled=(args.mode == "fp16-dynamic" and args.device == "cuda"))
gen = torch.Generator(device=dev).manual_seed(1234)


def get_batch():
    if tokens_per_sample:
        start = torch.randint(0, text.numel() - args.seq - 1, (batch,), device=dev, generator=gen)
        off = start[:, None] + torch.arange(args.seq + 1, device=dev)[None, :]
        seqs = text[off]
        return seqs[:, :-1], seqs[:, 1:]
    idx = torch.randint(0, x.shape[0], (batch,), device=dev, generator=gen)
    return x[idx], y[idx]


def autocast():
    if lowp is None or (args.device == "cpu" and lowp is torch.float16):  # (old CPU autocast has no fp16)
        return contextlib.nullcontext()
    return torch.autocast(args.device, dtype=lowp)


def step():
    xb, yb = get_batch()
    with autocast():
        out = model(xb)
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), yb.reshape(-1))
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    if tokens_per_sample:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    return loss


for _ in range(10 if args.device == "cuda" else 1):  # warm-up: cuDNN / cuBLAS autotuning, allocator growth
    step()
sync()
if args.device == "cuda":
    torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
for _ in range(args.steps):
    loss = step()
sync()
dt = time.perf_counter() - t0
sps = args.steps * batch / dt
peak = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else 0.0
# the whole device's memory in use (context, cuBLAS and cuDNN, the caching allocator's reserve), as ampTrain's
# AMPTRAIN_CUDA_MEMLOG peak counts it (cudaMemGetInfo); max_memory_allocated counts the tensors alone
device = ""
if args.device == "cuda":
    free_b, total_b = torch.cuda.mem_get_info()
    device = f" (device in use {(total_b - free_b) / 2**20:.1f} MiB)"
tps = f" ({sps * tokens_per_sample:.0f} tokens/s)" if tokens_per_sample else ""
print(f"torch {args.model} {args.mode}: {sps:.1f} samples/s{tps}, peak {peak:.1f} MiB{device}, final loss {loss.item():.4f}")
