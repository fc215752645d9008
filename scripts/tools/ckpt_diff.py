#!/usr/bin/env python3
"""The largest difference between two ampTrain checkpoints' weights, as tests/disttest.h's max_rel_diff measures it:
per tensor under /model, max |a - b| divided by max |a|, and the worst tensor.
    scripts/tools/ckpt_diff.py A.h5 B.h5      (needs h5py and numpy: scripts/install-deps.sh --test)"""
import sys

import h5py
import numpy as np


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: scripts/tools/ckpt_diff.py A.h5 B.h5")
    worst = (-1.0, "")
    with h5py.File(sys.argv[1], "r") as a, h5py.File(sys.argv[2], "r") as b:
        def visit(name, obj):
            nonlocal worst
            if not isinstance(obj, h5py.Dataset) or not name.startswith("model/"):
                return
            if name not in b:
                sys.exit(f"ckpt_diff: {name} is missing in {sys.argv[2]}")
            x = obj[()].astype(np.float64)
            y = b[name][()].astype(np.float64)
            top = np.max(np.abs(x)) if x.size else 0.0
            rel = np.max(np.abs(x - y)) / top if top > 0 else np.max(np.abs(x - y), initial=0.0)
            if rel > worst[0]:
                worst = (rel, name)
        a.visititems(visit)
    if worst[0] < 0:
        sys.exit("ckpt_diff: no tensors under /model")
    print(f"max |a - b| / max |a| over /model: {worst[0]:.3g} (/{worst[1]})")


if __name__ == "__main__":
    main()
