#!/usr/bin/env python3
"""PyTorch's side of scripts/gpu/bench_gpt2.sh: train a GPT-2 from an `ampTrain export --names hf-gpt2` file (or
`gpt2_torch.py init`) on the same token windows ampTrain's `data.sampling: sequential` reads, as nanoGPT trains it
on a GPU: F.scaled_dot_product_attention (flash attention), fused AdamW, bf16 autocast, torch.compile.

    bench_gpt2.py INIT.safetensors --tokens-file TRAIN.bin --heads H --batch B --seq T --steps N
                  [--warmup W] [--device cuda|cpu] [--compile] [--dtype bf16|fp32] [--lr ...]

The optimizer is configs/gpt2_124m.yaml's: AdamW (betas 0.9, 0.95, eps 1e-8), weight decay 0.1 on the linear maps'
weights only (ampTrain decays no bias, norm or embedding table, the tied head included: docs/model.md), lr 6e-4 with
a linear warmup of --warmup-steps and a cosine to 6e-5 over --total-steps, clipping at norm 1. Step s reads the
windows s*B .. s*B+B-1 of T + 1 tokens (window i at token i*T), wrapping to 0 when a batch would pass the last
window, as ampTrain's sequential sampler does.

Prints one line per step ("step S loss L ms M") and at the end
    "bench_gpt2: torch X.Y, B x T, N steps: TOK tokens/s (steps W+1..N), peak P MiB (device in use D MiB)"
Timing starts after W steps (torch.compile's first steps compile). torch.compile compiles at the first call and
fails there where the machine lacks what it needs (Triton, a C compiler): the step then runs eager, from there on,
and the last line says "eager (torch.compile failed)" instead of "compiled", so the loss comparison still has its
steps. Python standard library and torch only.
"""
import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ref"))
import gpt2_torch  # noqa: E402  (the model in nanoGPT's layout with Hugging Face's key names, and its file reader)


class FlashAttention(gpt2_torch.Attention):
    """The same parameters, the attention core as one fused call."""

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(B, T, self.heads, C // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def build(path, heads, device):
    m = gpt2_torch.load(path, heads)
    if hasattr(F, "scaled_dot_product_attention"):  # PyTorch 2 (an older CPU PyTorch keeps the plain formula)
        for b in m.transformer.h:
            b.attn.__class__ = FlashAttention
    m.forward = lambda idx, m=m: forward(m, idx)
    return m.to(device).train()


def forward(m, idx):
    t = m.transformer
    x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))
    for b in t.h:
        x = b(x)
    return m.lm_head(t.ln_f(x))


def lr_at(step, a):
    """configs/gpt2_124m.yaml's schedule (lib/base/step_rule.h schedule_lr): warmup then cosine to min_lr."""
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    span = a.total_steps - a.warmup_steps
    frac = min(1.0, (step - a.warmup_steps) / span) if span > 0 else 1.0
    return a.min_lr + (a.lr - a.min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))


def first_line(e):
    """An exception's first line, or its type where it has no message."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("init")
    ap.add_argument("--tokens-file", required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=10, help="steps before the timing starts")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr", type=float, default=6e-5)
    ap.add_argument("--warmup-steps", type=int, default=200)
    ap.add_argument("--total-steps", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    m = build(a.init, a.heads, dev)
    decay = [p for n, p in m.named_parameters() if p.dim() == 2 and ".h." in n]  # the blocks' linear weights
    other = [p for n, p in m.named_parameters() if not (p.dim() == 2 and ".h." in n)]
    fused = {"fused": True} if dev.type == "cuda" else {}  # (an older CPU PyTorch has no `fused` argument)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, **fused)
    step_fn, compiled = m, False
    if a.compile:
        try:
            step_fn, compiled = torch.compile(m), True
        except Exception as e:  # a PyTorch without torch.compile
            print("bench_gpt2: torch.compile unavailable (%s): eager" % first_line(e), flush=True)
    with open(a.tokens_file, "rb") as f:
        ids = torch.frombuffer(bytearray(f.read()), dtype=torch.int16).long() & 0xFFFF
    T, B = a.seq, a.batch
    windows = (ids.numel() - 1) // T
    per_epoch = windows // B
    if per_epoch < 1:
        sys.exit("bench_gpt2: %s holds %d windows of %d tokens, fewer than one batch of %d" % (
            a.tokens_file, windows, T, B))
    starts = torch.arange(T + 1)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_timed, n_timed = None, 0
    for s in range(a.steps):
        first = (s % per_epoch) * B
        w = torch.stack([ids[(first + i) * T + starts] for i in range(B)]).to(dev, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(s, a)
        if s == a.warmup:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_timed = time.perf_counter()
        t0 = time.perf_counter()
        with amp:
            try:
                logits = step_fn(w[:, :-1])
            except Exception as e:
                if not compiled:
                    raise
                print("bench_gpt2: torch.compile failed at step %d (%s): eager from here" % (s + 1, first_line(e)),
                      flush=True)
                step_fn, compiled = m, False
                logits = step_fn(w[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # a synchronisation a step, as ampTrain's log and nanoGPT's print make
        print("step %d loss %.9g ms %.2f" % (s + 1, value, 1000 * (time.perf_counter() - t0)), flush=True)
        if s >= a.warmup:
            n_timed += 1
    if dev.type == "cuda":
        torch.cuda.synchronize()
    rate = n_timed * B * T / (time.perf_counter() - t_timed) if n_timed else 0.0
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else 0.0
    used = 0.0
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        used = (total - free) / 2**20
    how = " compiled" if compiled else " eager (torch.compile failed)" if a.compile else ""
    print("bench_gpt2: torch %s%s, %d x %d, %d steps: %.0f tokens/s (steps %d..%d), peak %.0f MiB (device in use "
          "%.0f MiB)" % (torch.__version__, how, B, T, a.steps, rate, a.warmup + 1,
                         a.steps, peak, used))


if __name__ == "__main__":
    main()
