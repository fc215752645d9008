#!/usr/bin/python3
"""Unigram (byte) entropy in nats of the training part of a text run's corpus, read from the run's
resolved config.yaml (data.files, data.val_fraction), for comparison with the model's validation loss.
usage: unigram_entropy.py RUN_DIR/config.yaml"""
import json
import math
import re
import sys

text = open(sys.argv[1]).read()
files = json.loads(re.search(r"^  files: (\[.*\])$", text, re.M).group(1))
val = float(re.search(r"^  val_fraction: ([0-9.eE+-]+)$", text, re.M).group(1))
data = b"".join(open(f, "rb").read() for f in files)
train = data[: len(data) - int(len(data) * val)]
counts = [0] * 256
for b in train:
    counts[b] += 1
n = len(train)
print(f"{-sum(c / n * math.log(c / n) for c in counts if c):.6f}")
