#!/usr/bin/python3
"""Load an ampTrain checkpoint with h5py into PyTorch and evaluate it on the run's test split.

usage: scripts/ref/interop_torch.py CHECKPOINT.h5
Prints "accuracy A" and "loss L" for the test split (A a fraction, L the mean cross-entropy, as eval.jsonl),
computed in FP32 by PyTorch from the checkpoint's weights, reading the data and the model from the checkpoint's
embedded config. Covers the three reference model families and every layer kind they use:
  fashion_mlp  (idx)     flatten, linear, relu, dropout, cross_entropy
  fashion_cnn  (idx)     conv2d, batchnorm2d (running statistics), relu, gelu, maxpool2d, avgpool2d, flatten
  text_gpt     (text, tokens)  embedding, transformer_block (pre-LN, causal attention, GELU MLP), attention,
                         layernorm, linear (also tied to the embedding's wte, as GPT-2's lm_head)
Text data: the test split's windows of seq_len + 1 bytes (data.format text: the last floor(len * val_fraction)
bytes of the files; tokens: the first data.val_windows windows of val_bin), as lib/base/data_text.c and
lib/base/data_tokens.c cut them; the accuracy and loss are per token.
"""
import gzip
import math
import struct
import sys

import h5py
import numpy as np
import torch
import torch.nn.functional as F


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def scalar(text):
    text = text.split("#")[0].strip()
    if text.startswith("["):
        return [s.strip().strip('"') for s in text.strip("[]").split(",") if s.strip()]
    return text.strip('"')


def sections(yaml_text):
    """The top-level sections' scalar keys, and model.layers as a list of dicts (ampTrain's printed YAML)."""
    out, layers, section, inside = {}, [], None, False
    for line in yaml_text.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            section = line.split(":")[0].strip()
            out.setdefault(section, {})
            inside = False
            continue
        s = line.strip()
        if section == "model" and s == "layers:":
            inside = True
            continue
        if inside and s.startswith("- "):
            layers.append({})
            s = s[2:]
        if inside and line.startswith("      ") or (inside and line.startswith("    - ")):
            k, v = s.split(":", 1)
            layers[-1][k.strip()] = scalar(v)
        elif line.startswith("  ") and not line.startswith("   ") and ":" in s:
            k, v = s.split(":", 1)
            out[section][k.strip()] = scalar(v)
            inside = inside and section == "model" and False
    return out, layers


def test_data(cfg):
    d = cfg["data"]
    if d["format"] == "idx":
        images = read_idx(d["test_images"]).astype(np.float32)
        labels = torch.from_numpy(read_idx(d["test_labels"]).astype(np.int64))
        x = (images / np.float32(255) - np.float32(d["mean"])) / np.float32(d["std"])
        return torch.from_numpy(x.astype(np.float32)).unsqueeze(1), labels
    T = int(d["seq_len"])
    if d["format"] == "text":
        blob = b"".join(open(p, "rb").read() for p in d["files"])
        test = blob[len(blob) - int(math.floor(len(blob) * float(d["val_fraction"]))):]
        ids = torch.tensor(list(test), dtype=torch.long)
    elif d["format"] == "tokens":
        raw = open(d["val_bin"], "rb").read()
        if len(raw) >= 1024 and struct.unpack("<i", raw[:4])[0] == 20240520:
            raw = raw[1024:]
        ids = torch.from_numpy(np.frombuffer(raw, dtype=np.uint16).astype(np.int64))
    else:
        sys.exit("data.format %s is not supported by this script" % d["format"])
    n = (len(ids) - 1) // T
    if d.get("val_windows", "0") not in ("0", "") and d["format"] == "tokens":
        n = min(n, int(d["val_windows"]))
    w = torch.stack([ids[i * T:i * T + T + 1] for i in range(n)])
    return w[:, :-1], w[:, 1:]


def attention(x, P, pre, heads):
    B, T, C = x.shape
    qkv = F.linear(x, P[pre + "qkv/weight"], P[pre + "qkv/bias"])
    q, k, v = (z.reshape(B, T, heads, C // heads).transpose(1, 2) for z in qkv.split(C, dim=2))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(C // heads)
    att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).tril().logical_not(), float("-inf"))
    y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
    return F.linear(y, P[pre + "proj/weight"], P[pre + "proj/bias"])


def forward(layers, P, x):
    for L in layers:
        kind, name = L["kind"], L.get("name")
        p = lambda k: P.get("%s/%s" % (name, k))
        if kind == "linear":
            w = P[L["tie"]] if L.get("tie") else p("weight")
            x = F.linear(x, w, p("bias"))
        elif kind == "conv2d":
            x = F.conv2d(x, p("weight"), p("bias"), stride=int(L["stride"]), padding=int(L["padding"]))
        elif kind == "batchnorm2d":
            x = F.batch_norm(x, p("running_mean"), p("running_var"), p("weight"), p("bias"), False, 0.0, float(L["eps"]))
        elif kind == "layernorm":
            x = F.layer_norm(x, x.shape[-1:], p("weight"), p("bias"), float(L["eps"]))
        elif kind in ("maxpool2d", "avgpool2d"):
            pool = F.max_pool2d if kind == "maxpool2d" else F.avg_pool2d
            x = pool(x, int(L["kernel"]), int(L["stride"]), int(L["padding"]))
        elif kind == "relu":
            x = torch.relu(x)
        elif kind == "gelu":
            x = F.gelu(x, approximate="tanh" if L.get("approximate") == "tanh" else "none")
        elif kind == "flatten":
            x = x.reshape(x.shape[0], -1)
        elif kind == "embedding":
            x = p("wte")[x] + p("wpe")[: x.shape[1]]
        elif kind == "attention":
            x = attention(x, P, name + "/", int(L["heads"]))
        elif kind == "transformer_block":
            C = x.shape[-1]
            h = F.layer_norm(x, (C,), p("ln1/weight"), p("ln1/bias"), 1e-5)
            x = x + attention(h, P, name + "/attn/", int(L["heads"]))
            h = F.layer_norm(x, (C,), p("ln2/weight"), p("ln2/bias"), 1e-5)
            h = F.linear(h, p("mlp/fc/weight"), p("mlp/fc/bias"))
            h = F.gelu(h, approximate="tanh" if L.get("approximate", "tanh") == "tanh" else "none")
            x = x + F.linear(h, p("mlp/proj/weight"), p("mlp/proj/bias"))
        elif kind in ("dropout", "cross_entropy"):
            pass
        else:
            sys.exit("layer kind %s is not supported by this script" % kind)
    return x


def main():
    path = sys.argv[1]
    with h5py.File(path, "r") as f:
        if f.attrs["format"] != b"ampTrain-checkpoint":
            sys.exit(f"{path}: not an ampTrain checkpoint")
        cfg_text = f["config"][()].decode()
        P = {}
        f["model"].visititems(lambda n, o: P.__setitem__(n, torch.from_numpy(np.asarray(o))) if isinstance(o, h5py.Dataset) else None)
    cfg, layers = sections(cfg_text)
    x, labels = test_data(cfg)
    torch.set_num_threads(1)
    correct, loss_sum, rows = 0, 0.0, 0
    with torch.no_grad():
        for i in range(0, x.shape[0], 256):
            logits = forward(layers, P, x[i:i + 256])
            y = labels[i:i + 256]
            logits = logits.reshape(-1, logits.shape[-1])
            y = y.reshape(-1)
            correct += (logits.argmax(dim=1) == y).sum().item()
            loss_sum += F.cross_entropy(logits.double(), y, reduction="sum").item()
            rows += y.numel()
    print(f"accuracy {correct / rows:.6f}")
    print(f"loss {loss_sum / rows:.9f}")


if __name__ == "__main__":
    main()
