#!/usr/bin/python3
"""A GPT-2 in torch.nn (nanoGPT's layout, Hugging Face's GPT2LMHeadModel key names), to hold ampTrain's GPT-2
against PyTorch (tests/test_interop_torch.c; docs/checkpoint.md, "Proved against PyTorch").

    gpt2_torch.py logits FILE.safetensors --heads H --tokens 1,2,3 [--compare LOGITS.f32] [--rtol 1e-5]
        load FILE (an `ampTrain export --names hf-gpt2`, or any file with those keys and layouts) into the model,
        with lm_head tied to transformer.wte, and compute the fp32 logits of the tokens (one sequence). With
        --compare, read ampTrain's logits of the same tokens (raw little-endian float32, T x vocab) and compare:
        pass when max|torch - ampTrain| <= rtol * max|ampTrain|; prints "logits max_abs_diff D max_abs A rel R".
    gpt2_torch.py init OUT.safetensors --layers L --heads H --embd C --vocab V --block B [--seed S]
        a freshly initialised model (nanoGPT's _init_weights: N(0, 0.02), c_proj N(0, 0.02/sqrt(2L)), zero biases,
        layernorms 1 and 0; torch.manual_seed(S)) saved with hf-gpt2 keys, lm_head.weight left out (tied).
    gpt2_torch.py loss FILE.safetensors --heads H --tokens-file TRAIN.bin --batch N --seq T
        the mean cross-entropy of the first N windows of T + 1 tokens of a nanoGPT uint16 token file, window i at
        token i * T: the first batch `data.sampling: sequential` trains on. Prints "loss L" (17 digits).

Conv1D weights are stored (in, out): the model multiplies x @ W as transformers' Conv1D does. Standard library and
torch only (no safetensors or transformers package): the format is read and written here.
"""
import argparse
import json
import math
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2)}


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    data = blob[8 + n:]
    out = {}
    for name, e in header.items():
        dt, size = DTYPES[e["dtype"]]
        b, end = e["data_offsets"]
        t = torch.frombuffer(bytearray(data[b:end]), dtype=dt) if end > b else torch.empty(0, dtype=dt)
        out[name] = t.reshape(e["shape"]).float()
    return out


def write_safetensors(path, tensors):
    header, offset, chunks = {}, 0, []
    for name in sorted(tensors):
        raw = tensors[name].detach().contiguous().float().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        chunks.append(raw)
    header["__metadata__"] = {"format": "pt", "producer": "scripts/ref/gpt2_torch.py"}
    text = json.dumps(header).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


class Conv1D(nn.Module):
    """transformers' Conv1D: weight (in, out), y = x @ W + b."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Attention(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.c_attn, self.c_proj, self.heads = Conv1D(c, 3 * c), Conv1D(c, c), heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(B, T, self.heads, C // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).tril().logical_not(), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(c, 4 * c), Conv1D(4 * c, c)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(c), Attention(c, heads), nn.LayerNorm(c), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, layers, heads, embd, vocab, block):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, embd), wpe=nn.Embedding(block, embd),
            h=nn.ModuleList([Block(embd, heads) for _ in range(layers)]), ln_f=nn.LayerNorm(embd)))
        self.lm_head = nn.Linear(embd, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as GPT-2
        self.layers = layers

    def init_weights(self):  # nanoGPT's _init_weights and its c_proj rule
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * self.layers))
            elif name.endswith(".weight") and ("ln_" in name):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
        for b in t.h:
            x = b(x)
        return self.lm_head(t.ln_f(x))


def load(path, heads):
    sd = read_safetensors(path)
    vocab, embd = sd["transformer.wte.weight"].shape
    layers = len({k.split(".")[2] for k in sd if k.startswith("transformer.h.")})
    m = GPT2(layers, heads, embd, vocab, sd["transformer.wpe.weight"].shape[0])
    missing, unexpected = m.load_state_dict(sd, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        sys.exit("gpt2_torch: %s: missing %s, unexpected %s" % (path, missing, unexpected))
    return m.eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["logits", "init", "loss"])
    ap.add_argument("file")
    for k in ("heads", "layers", "embd", "vocab", "block", "batch", "seq"):
        ap.add_argument("--" + k, type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens")
    ap.add_argument("--tokens-file")
    ap.add_argument("--compare")
    ap.add_argument("--rtol", type=float, default=1e-5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.cmd == "init":
        torch.manual_seed(a.seed)
        m = GPT2(a.layers, a.heads, a.embd, a.vocab, a.block)
        m.init_weights()
        write_safetensors(a.file, {k: v for k, v in m.state_dict().items() if k != "lm_head.weight"})
        print("init: %d tensors to %s" % (len(m.state_dict()) - 1, a.file))
        return
    m = load(a.file, a.heads)
    with torch.no_grad():
        if a.cmd == "logits":
            idx = torch.tensor([[int(x) for x in a.tokens.split(",")]])
            logits = m(idx)[0]
            if a.compare:
                with open(a.compare, "rb") as f:
                    ref = torch.frombuffer(bytearray(f.read()), dtype=torch.float32).reshape(logits.shape)
                diff, top = (logits - ref).abs().max().item(), ref.abs().max().item()
                print("logits max_abs_diff %.3g max_abs %.6g rel %.3g" % (diff, top, diff / top))
                sys.exit(0 if diff <= a.rtol * top else 1)
            print("logits", logits.shape, logits.abs().max().item())
        else:
            with open(a.tokens_file, "rb") as f:
                ids = torch.frombuffer(bytearray(f.read()), dtype=torch.int16).long() & 0xFFFF
            T = a.seq
            w = torch.stack([ids[i * T:i * T + T + 1] for i in range(a.batch)])
            logits = m(w[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
            print("loss %.17g" % loss.item())


if __name__ == "__main__":
    main()
