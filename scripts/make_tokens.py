#!/usr/bin/env python3
"""Write a token file for `data.format: tokens` from text files, with a byte-level tokenizer.

Each byte of the input is one token (ids 0..255, so data.vocab 256): no vocabulary to download. The files
are concatenated in order. Two layouts (docs/data.md):

  --format nanogpt   raw little-endian uint16 ids, what nanoGPT's data/*/prepare.py writes (np.uint16 tofile)
  --format llmc      llm.c's layout: a header of 256 little-endian int32 (magic 20240520, version 1, the
                     number of tokens, zeros), then the uint16 ids (dev/data/data_common.py, write_datafile)

With --val-fraction F (0 < F < 1) the last floor(F * tokens) tokens go to a second file, VAL (default: the
output's name with train replaced by val, or OUT.val.bin), as nanoGPT's prepare scripts split train.bin and
val.bin.

  scripts/make_tokens.py --format nanogpt --val-fraction 0.1 -o data/fortunes/train.bin \\
      /usr/share/games/fortunes/cookie /usr/share/games/fortunes/computers

Python 3 standard library only.
"""
import argparse
import array
import os
import struct
import sys

LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_INTS = 256


def write_tokens(path, data, layout):
    """Write `data` (bytes: one token per byte) as a uint16 token file, atomically (tmp + rename)."""
    ids = array.array("H", list(data))  # one uint16 per byte
    if sys.byteorder == "big":
        ids.byteswap()  # the files are little-endian
    ids = ids.tobytes()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        if layout == "llmc":
            header = [0] * LLMC_HEADER_INTS
            header[0], header[1], header[2] = LLMC_MAGIC, LLMC_VERSION, len(data)
            f.write(struct.pack("<%di" % LLMC_HEADER_INTS, *header))
        f.write(ids)
    os.replace(tmp, path)
    print("make_tokens: %s: %d tokens (%s layout, %d bytes)" % (path, len(data), layout, os.path.getsize(path)))


def val_name(out):
    base = os.path.basename(out)
    if "train" in base:
        return os.path.join(os.path.dirname(out), base.replace("train", "val"))
    return out + ".val.bin"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="text files, concatenated in order")
    ap.add_argument("-o", "--output", required=True, help="the token file to write (train.bin)")
    ap.add_argument("--format", choices=["nanogpt", "llmc"], default="nanogpt", help="file layout (default nanogpt)")
    ap.add_argument("--val-fraction", type=float, default=0.0,
                    help="put the last fraction of the tokens in a second file (default 0: none)")
    ap.add_argument("--val-output", help="the second file (default: OUTPUT with train -> val)")
    a = ap.parse_args()
    if not 0.0 <= a.val_fraction < 1.0:
        ap.error("--val-fraction must be in [0, 1)")
    data = bytearray()
    for p in a.inputs:
        try:
            with open(p, "rb") as f:
                data += f.read()
        except OSError as e:
            print("make_tokens: %s: %s" % (p, e.strerror), file=sys.stderr)
            return 3
    if not data:
        print("make_tokens: the inputs hold no bytes", file=sys.stderr)
        return 3
    nval = int(len(data) * a.val_fraction)
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    write_tokens(a.output, bytes(data[:len(data) - nval]), a.format)
    if nval:
        vout = a.val_output or val_name(a.output)
        if os.path.abspath(vout) == os.path.abspath(a.output):
            print("make_tokens: the validation file would overwrite %s: give --val-output" % a.output,
                  file=sys.stderr)
            return 2
        write_tokens(vout, bytes(data[len(data) - nval:]), a.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
