#!/usr/bin/python3
"""The reference for ampTrain's generation (lib/engine/sample.h; tests/test_sample.c, `reference` suite): a GPT-2 in torch.nn
(scripts/ref/gpt2_torch.py) loaded from an `ampTrain export --names hf-gpt2`, generating with the same sampling rule and
the same draws, and no key/value cache: every step runs the full forward over the sequence so far.

    sample_ref.py FILE.safetensors --heads H --prompt 1,2,3 --tokens N [--temperature T] [--top-k K] [--top-p P]
                  [--seed S] [--context T] [--compare LOGITS.f32] [--rtol R]
        prints "tokens a,b,c,..." (the prompt, then the generated tokens; generation stops at the context T, ampTrain's
        data.seq_len; default wpe's rows). With --compare, ampTrain's logits of every generated token (raw little-endian float32, one row
        of vocab per generated token, as sample_result.logits) are held against these: each row must be within
        R * max|row| (default 1e-5, some 80 fp32 roundings of the largest logit: the products of two blocks sum
        in another order in torch) of torch's; prints "logits max_rel_diff D" and exits 1 beyond it.

The rule (lib/engine/sample.h): temperature 0 is the argmax (the first of equal maxima); else, in double,
w_i = exp((l_i - max l) / T), tokens ranked by w descending (ties: lower token first), top_k then top_p keep a
prefix, and with u = rng_uniform(seed, SAMPLE_STREAM, k) the first kept token whose running sum of w exceeds
u * (the kept sum). rng_uniform is lib/base/rng.h's counter-based generator, computed here with Python integers.
"""
import argparse
import math
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_torch  # noqa: E402  load: the GPT-2 from an hf-gpt2 export

MASK = (1 << 64) - 1
SAMPLE_STREAM = 0x73616D706C65  # "sample" (lib/engine/sample.h)


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def rng_uniform(seed, stream, counter):
    k = mix64((seed + 0x9E3779B97F4A7C15) & MASK)
    k = mix64(k ^ ((stream * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & MASK))
    bits = mix64(k ^ ((counter * 0x9E3779B97F4A7C15 + 0x2545F4914F6CDD1D) & MASK))
    return (bits >> 40) / 16777216.0  # 24 bits, exact in a float as in C


def pick(logits, a, u):
    """logits: a list of Python floats (the fp32 values)."""
    V = len(logits)
    best = max(range(V), key=lambda i: (logits[i], -i))
    if a.temperature == 0.0:
        return best
    mx = logits[best]
    w = [math.exp((l - mx) / a.temperature) for l in logits]
    order = sorted(range(V), key=lambda i: (-w[i], i))
    kept = a.top_k if 0 < a.top_k < V else V
    total = 0.0
    for i in range(kept):
        total += w[order[i]]
    if a.top_p < 1.0:
        cum, n = 0.0, 0
        while n < kept and (n == 0 or cum < a.top_p * total):
            cum += w[order[n]]
            n += 1
        kept, total = n, cum
    r, cum = u * total, 0.0
    for i in range(kept):
        cum += w[order[i]]
        if cum > r:
            return order[i]
    return order[kept - 1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--compare")
    ap.add_argument("--rtol", type=float, default=1e-5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    m = gpt2_torch.load(a.file, a.heads)
    context = a.context or m.transformer.wpe.weight.shape[0]
    seq = [int(x) for x in a.prompt.split(",")]
    rows = []
    with torch.no_grad():
        for k in range(a.tokens):
            if len(seq) >= context:
                break
            logits = m(torch.tensor([seq]))[0, -1].float()
            rows.append(logits)
            seq.append(pick([float(x) for x in logits], a, rng_uniform(a.seed, SAMPLE_STREAM, k)))
    print("tokens " + ",".join(str(t) for t in seq))
    if a.compare:
        with open(a.compare, "rb") as f:
            blob = f.read()
        V = rows[0].numel() if rows else 0
        got = torch.frombuffer(bytearray(blob), dtype=torch.float32).reshape(-1, V) if V else None
        if got is None or got.shape[0] != len(rows):
            print("logits: %s has %d rows, the reference %d" % (a.compare, 0 if got is None else got.shape[0],
                                                               len(rows)))
            sys.exit(1)
        worst = max(((got[i] - rows[i]).abs().max() / rows[i].abs().max()).item() for i in range(len(rows)))
        print("logits max_rel_diff %.3g" % worst)
        sys.exit(0 if worst <= a.rtol else 1)


if __name__ == "__main__":
    main()
