#!/usr/bin/python3
"""PyTorch side of scripts/bench/bench_dist.sh: data-parallel training with DistributedDataParallel over gloo on the
CPU, NP processes of one thread each, on the model, optimizer and data of ampTrain's configs/MODEL.yaml.

  fashion_mlp: the config's MLP (784-512-512-10, ReLU; PyTorch's default init), Fashion-MNIST normalised as
               x' = (x/255 - mean) / std, AdamW(lr, betas, weight decay on the linear weights only).
  text_gpt:    the config's byte-level GPT: token + position embedding, pre-LN transformer blocks (causal
               multi-head attention as ampTrain computes it: scores, masked fp32 softmax, probs @ V; GELU-tanh
               MLP), final layernorm, lm head, cross entropy over every token; GPT-2 init; the bytes of the
               config's data.files (training split: all but the last val_fraction), windows of seq_len + 1
               bytes; AdamW with the config's warmup + cosine schedule and gradient clipping.

The per-rank micro-batch is the config's data.batch_size B, so the effective batch is B x NP. Each global
batch of B x NP samples is taken from a shuffled epoch order (drop_last, as ampTrain's sampler) and rank r
trains on its samples [r*B, (r+1)*B). DDP averages the gradients over the ranks. Only the training steps
after 5 warm-up steps are timed. MODE bf16 runs the forward under CPU autocast bf16 (fp32 master weights,
fp32 gradients and all-reduce). Prints one line, from rank 0:
  'torch-ddp MODEL MODE np NP: N samples in S s: X samples/s'   (N counts the samples of all ranks)

usage: bench_ddp_torch.py MODEL NP STEPS MODE     MODEL: fashion_mlp | text_gpt, MODE: fp32 | bf16
"""
import os

# one thread per process (torch's OpenMP and the OpenBLAS under its products), set before torch is imported,
# here and so in the spawned ranks
os.environ["OMP_NUM_THREADS"] = os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks on this machine: gloo over the loopback

import gzip
import math
import re
import shutil
import struct
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

WARMUP = 5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- configs/MODEL.yaml: the block-style YAML subset ampTrain's configs use (no YAML module needed) ----

def _scalar(v):
    v = v.strip()
    if v.startswith("[") and v.endswith("]"):
        return [_scalar(s) for s in v[1:-1].split(",") if s.strip()]
    if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
        return v[1:-1]
    if v in ("true", "false"):
        return v == "true"
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def parse_config(path):
    lines = []
    for raw in open(path).read().splitlines():
        s = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if s.strip():
            lines.append([len(s) - len(s.lstrip()), s.strip()])
    pos = 0

    def block(indent):
        nonlocal pos
        if lines[pos][1].startswith("- "):
            out = []
            while pos < len(lines) and lines[pos][0] == indent and lines[pos][1].startswith("- "):
                item = lines[pos][1][2:].strip()
                if re.match(r"^[A-Za-z_]\w*:(\s|$)", item):  # a mapping: its first key sits after the dash
                    lines[pos] = [indent + 2, item]
                    out.append(block(indent + 2))
                else:
                    out.append(_scalar(item))
                    pos += 1
            return out
        out = {}
        while pos < len(lines) and lines[pos][0] == indent and not lines[pos][1].startswith("- "):
            key, _, val = lines[pos][1].partition(":")
            pos += 1
            if val.strip():
                out[key.strip()] = _scalar(val)
            elif pos < len(lines) and lines[pos][0] > indent:
                out[key.strip()] = block(lines[pos][0])
            else:
                out[key.strip()] = None
        return out

    return block(0)


# ---- models ----

class Block(nn.Module):
    """ampTrain's transformer_block (docs/model.md): pre-LN, causal attention, GELU MLP, no dropout."""

    def __init__(self, c, heads, ratio, approximate, seq):
        super().__init__()
        self.h, self.approximate = heads, approximate
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.fc2 = nn.Linear(c, ratio * c), nn.Linear(ratio * c, c)
        self.mask = torch.ones(seq, seq, dtype=torch.bool).tril()  # not a buffer: nothing for DDP to sync

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        # the same composite as ampTrain (scores, masked softmax in fp32, probs @ V), as bench_gpu_torch.py
        s = (q @ k.transpose(-2, -1)) / (C // self.h) ** 0.5
        p = F.softmax(s.masked_fill(~self.mask[:T, :T], float("-inf")).float(), dim=-1).to(v.dtype)
        a = (p @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate=self.approximate))


class GPT(nn.Module):
    def __init__(self, layers, seq):
        super().__init__()
        emb = layers[0]
        if emb["kind"] != "embedding" or layers[-1]["kind"] != "cross_entropy":
            sys.exit("bench_ddp_torch: text model must be embedding, ..., cross_entropy")
        c, vocab = emb["dim"], emb["vocab"]
        self.wte, self.wpe = nn.Embedding(vocab, c), nn.Embedding(emb.get("max_len", seq), c)
        mods = []
        for l in layers[1:-1]:
            k = l["kind"]
            if k == "transformer_block":
                if l.get("dim", 0) not in (0, c):
                    sys.exit("bench_ddp_torch: transformer_block dim must equal the width")
                mods.append(Block(c, l["heads"], l.get("mlp_ratio", 4), l.get("approximate", "tanh"), seq))
            elif k == "layernorm":
                mods.append(nn.LayerNorm(c, eps=l.get("eps", 1e-5)))
            elif k == "linear":
                mods.append(nn.Linear(c, l["out"], bias=l.get("bias", True)))
                c = l["out"]
            elif k == "dropout":
                mods.append(nn.Dropout(l.get("p", 0.1)))
            else:
                sys.exit(f"bench_ddp_torch: layer kind {k} is not supported in a text model")
        self.body = nn.Sequential(*mods)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.body(x)


def mlp(layers, d_in):
    mods = []
    for l in layers:
        k = l["kind"]
        if k == "flatten":
            mods.append(nn.Flatten())
        elif k == "linear":
            mods.append(nn.Linear(d_in, l["out"], bias=l.get("bias", True)))
            d_in = l["out"]
        elif k == "relu":
            mods.append(nn.ReLU())
        elif k == "gelu":
            mods.append(nn.GELU(approximate=l.get("approximate", "tanh")))
        elif k == "dropout":
            mods.append(nn.Dropout(l.get("p", 0.1)))
        elif k == "cross_entropy":
            pass
        else:
            sys.exit(f"bench_ddp_torch: layer kind {k} is not supported in an image model")
    return nn.Sequential(*mods)


def gpt2_init(model):
    """docs/model.md, model.init gpt2: N(0, 0.02) weights and embeddings, residual projections
    N(0, 0.02 / sqrt(2 n_blocks)), zero biases, layernorms 1 / 0."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    resid = {id(b.proj.weight) for b in blocks} | {id(b.fc2.weight) for b in blocks}
    std_resid = 0.02 / math.sqrt(2 * max(1, len(blocks)))
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std_resid if id(m.weight) in resid else 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


# ---- data ----

def load_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_data(cfg):
    """(x, y) for the training split: x fp32 (n, D) images or int64 (n, T) tokens, y int64 (n) or (n, T)."""
    d = cfg["data"]
    if d.get("format") == "idx":
        x = load_idx(d["train_images"])
        x = x.reshape(x.shape[0], -1).astype(np.float64)
        x = ((x / 255.0 - d.get("mean", 0.0)) / d.get("std", 1.0)).astype(np.float32)  # double, rounded once
        y = load_idx(d["train_labels"]).astype(np.int64)
        return torch.from_numpy(x), torch.from_numpy(y)
    if d.get("format") == "text":
        data = b"".join(open(f, "rb").read() for f in d["files"])
        train = data[:len(data) - int(len(data) * d.get("val_fraction", 0.1))]
        T = d["seq_len"]
        n = (len(train) - 1) // T
        b = torch.frombuffer(bytearray(train), dtype=torch.uint8)
        win = b.as_strided((n, T + 1), (T, 1)).long()  # sample i: bytes [i*T, i*T + T]
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()
    sys.exit(f"bench_ddp_torch: data.format {d.get('format')} is not supported")


# ---- one rank ----

def worker(rank, model_name, np_, steps, mode, init):
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=np_)
    cfg = parse_config(os.path.join(ROOT, "configs", model_name + ".yaml"))
    seed = cfg["run"].get("seed", 1234)
    torch.manual_seed(seed)
    x, y = load_data(cfg)
    n, B = x.shape[0], cfg["data"]["batch_size"]
    layers = cfg["model"]["layers"]
    if cfg["data"]["format"] == "text":
        model = GPT(layers, cfg["data"]["seq_len"])
    else:
        model = mlp(layers, x.shape[1])
    if cfg["model"].get("init", "pytorch") == "gpt2":
        gpt2_init(model)
    # weight decay on the weights of the linear maps only (docs/model.md), as bench_torch_models.py
    decay = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    ids = {id(p) for p in decay}
    no_decay = [p for p in model.parameters() if id(p) not in ids]
    o = cfg.get("optim", {})
    if o.get("kind", "adamw") != "adamw":
        sys.exit("bench_ddp_torch: only optim.kind adamw is supported")
    lr = float(o.get("lr", 1e-3))
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": float(o.get("weight_decay", 0.01))},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=tuple(float(b) for b in o.get("betas", [0.9, 0.999])),
                            eps=float(o.get("eps", 1e-8)))
    sch = o.get("schedule") or {}
    total = WARMUP + steps

    def lr_at(t):  # lib/base/step_rule.h's schedule_lr, as a factor of lr
        w = int(sch.get("warmup_steps", 0))
        if t < w:
            return (t + 1) / w
        if sch.get("kind") == "step":
            return float(sch.get("gamma", 0.1)) ** ((t - w) // int(sch.get("step_size", 1000)))
        if sch.get("kind") == "cosine":
            lo = float(sch.get("min_lr", 0.0))
            frac = min(1.0, (t - w) / (total - w)) if total > w else 1.0
            return (lo + (lr - lo) * 0.5 * (1.0 + math.cos(math.pi * frac))) / lr
        return 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    clip = cfg.get("clip") or {}
    max_norm = float(clip.get("max_norm", 0) or 0)
    norm_type = float(clip.get("norm_type", 2))
    if cfg.get("accum_steps", 1) != 1:
        sys.exit("bench_ddp_torch: accum_steps must be 1")
    ddp = DDP(model, broadcast_buffers=False)  # rank 0's initial parameters go to every rank

    gb = B * np_  # the global batch; drop_last epochs of a shuffled order, the same on every rank
    per_epoch = n // gb
    if per_epoch < 1:
        sys.exit(f"bench_ddp_torch: {n} samples, fewer than one global batch of {gb}")
    orders = {}

    def batch(k):
        e, j = divmod(k, per_epoch)
        if e not in orders:
            orders.clear()
            orders[e] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000003 + e))
        idx = orders[e][j * gb + rank * B:j * gb + (rank + 1) * B]
        return x[idx], y[idx]

    def step(k):
        xb, yb = batch(k)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(mode == "bf16")):
            out = ddp(xb)
            loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), yb.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm, norm_type)
        opt.step()
        sched.step()
        return loss

    for k in range(WARMUP):  # warm-up, not timed
        step(k)
    dist.barrier()
    t0 = time.perf_counter()
    for k in range(WARMUP, WARMUP + steps):
        loss = step(k)
    dist.barrier()
    dt = time.perf_counter() - t0
    if not math.isfinite(loss.item()):
        sys.exit(f"bench_ddp_torch: rank {rank}: non-finite loss {loss.item()}")
    if rank == 0:
        samples = steps * gb
        print(f"torch-ddp {model_name} {mode} np {np_}: {samples} samples in {dt:.2f} s: {samples / dt:.1f} samples/s",
              flush=True)
    dist.destroy_process_group()


def main():
    if len(sys.argv) != 5 or sys.argv[1] not in ("fashion_mlp", "text_gpt") or sys.argv[4] not in ("fp32", "bf16"):
        sys.stderr.write("usage: bench_ddp_torch.py fashion_mlp|text_gpt NP STEPS fp32|bf16\n")
        sys.exit(2)
    model_name, np_, steps, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if np_ < 1 or steps < 1:
        sys.stderr.write("bench_ddp_torch: NP and STEPS must be >= 1\n")
        sys.exit(2)
    tmp = tempfile.mkdtemp(prefix="bench_ddp_torch.")
    try:  # file:// rendezvous: no port to pick or to race for
        mp.spawn(worker, args=(model_name, np_, steps, mode, "file://" + os.path.join(tmp, "rendezvous")),
                 nprocs=np_, join=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
