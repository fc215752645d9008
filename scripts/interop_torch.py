#!/usr/bin/python3
"""Load an ampTrain fashion_mlp checkpoint with h5py into PyTorch and print its test accuracy.

usage: scripts/interop_torch.py CHECKPOINT.h5
Prints "accuracy A" (a fraction, as eval.jsonl) for the test split, computed in FP32 by PyTorch from the
checkpoint's weights, reading the data paths and normalisation from the checkpoint's embedded config.
Supports the layer kinds of the MLP reference model (flatten, linear, relu, dropout, cross_entropy).
"""
import gzip
import struct
import sys

import h5py
import numpy as np
import torch


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def config_value(yaml_text, section, key):
    """The scalar `key` of top-level `section` in ampTrain's printed YAML (no YAML module needed)."""
    inside = False
    for line in yaml_text.splitlines():
        if not line.startswith(" "):
            inside = line.rstrip() == section + ":"
            continue
        if inside and line.strip().startswith(key + ":"):
            return line.split(":", 1)[1].split("#")[0].strip().strip('"')
    raise KeyError(f"{section}.{key}")


def layer_kinds(yaml_text):
    kinds, names, inside = [], [], False
    for line in yaml_text.splitlines():
        if line.strip() == "layers:":
            inside = True
            continue
        if inside:
            s = line.strip()
            if s.startswith("- kind:"):
                kinds.append(s.split(":", 1)[1].strip().strip('"'))
                names.append(None)
            elif s.startswith("name:") and names:
                names[-1] = s.split(":", 1)[1].strip().strip('"')
            elif not line.startswith("    ") and s:
                inside = False
    return list(zip(kinds, names))


def main():
    path = sys.argv[1]
    with h5py.File(path, "r") as f:
        if f.attrs["format"] != b"ampTrain-checkpoint":
            sys.exit(f"{path}: not an ampTrain checkpoint")
        cfg = f["config"][()].decode()
        params = {f"{l}/{p}": torch.from_numpy(np.asarray(f["model"][l][p])) for l in f["model"] for p in f["model"][l]}
    images = read_idx(config_value(cfg, "data", "test_images")).astype(np.float32)
    labels = torch.from_numpy(read_idx(config_value(cfg, "data", "test_labels")).astype(np.int64))
    mean, std = float(config_value(cfg, "data", "mean")), float(config_value(cfg, "data", "std"))
    x = torch.from_numpy(((images / np.float32(255) - np.float32(mean)) / np.float32(std)).astype(np.float32))
    x = x.reshape(x.shape[0], -1)
    with torch.no_grad():
        for kind, name in layer_kinds(cfg):
            if kind == "linear":
                x = torch.nn.functional.linear(x, params[f"{name}/weight"], params.get(f"{name}/bias"))
            elif kind == "relu":
                x = torch.relu(x)
            elif kind in ("flatten", "dropout", "cross_entropy"):
                pass
            else:
                sys.exit(f"layer kind {kind} is not supported by this script")
        acc = (x.argmax(dim=1) == labels).double().mean().item()
    print(f"accuracy {acc:.6f}")


if __name__ == "__main__":
    main()
