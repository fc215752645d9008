#!/usr/bin/env python3
"""Write a token file for `data.format: tokens` from text files, with a byte-level tokenizer or a BPE.

By default each byte of the input is one token (ids 0..255, so data.vocab 256): no vocabulary to download.
With --tokenizer FILE (a Hugging Face byte-level BPE: tokenizer.json, or vocab.json with merges.txt beside it,
or their directory; docs/data.md, "Tokenizers") the text is encoded by ampTrain's own tokenizer, `ampTrain
tokenize` (the binary: --amptrain, default build/ampTrain), and the script prints the data.vocab to set.
The files are concatenated in order and encoded as one text. Two layouts (docs/data.md):

  --format nanogpt   raw little-endian uint16 ids, what nanoGPT's data/*/prepare.py writes (np.uint16 tofile)
  --format llmc      llm.c's layout: a header of 256 little-endian int32 (magic 20240520, version 1, the
                     number of tokens, zeros), then the uint16 ids (dev/data/data_common.py, write_datafile)

With --val-fraction F (0 < F < 1) the last floor(F * tokens) tokens go to a second file, VAL (default: the
output's name with train replaced by val, or OUT.val.bin), as nanoGPT's prepare scripts split train.bin and
val.bin.

  scripts/tools/make_tokens.py --format nanogpt --val-fraction 0.1 -o data/fortunes/train.bin \\
      /usr/share/games/fortunes/cookie /usr/share/games/fortunes/computers
  scripts/tools/make_tokens.py --tokenizer gpt2/tokenizer.json -o data/fortunes/train.bin /usr/share/games/fortunes/cookie

Python 3 standard library only.
"""
import argparse
import array
import os
import re
import struct
import subprocess
import sys

LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_INTS = 256


def write_tokens(path, data, layout):
    """Write `data` (token ids: bytes, or a list of ints below 65536) as a uint16 token file, atomically."""
    ids = array.array("H", list(data))  # one uint16 per token
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


def encode_bpe(data, tokenizer, binary):
    """The ids of `data` (bytes) with `ampTrain tokenize --tokenizer TOKENIZER`, and the tokenizer's vocab size;
    or (None, exit code) after saying what went wrong."""
    if not os.access(binary, os.X_OK):
        print("make_tokens: no ampTrain binary at %s: build it (scripts/build.sh) or give --amptrain" % binary,
              file=sys.stderr)
        return None, 2
    p = subprocess.run([binary, "tokenize", "--tokenizer", tokenizer], input=bytes(data), capture_output=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr.decode("utf-8", "replace"))
        return None, p.returncode
    m = re.search(rb"\(vocab (\d+)\)", p.stderr)
    vocab = int(m.group(1)) if m else 0
    ids = [int(x) for x in p.stdout.split()]
    if vocab > 65536 or (ids and max(ids) > 65535):
        print("make_tokens: %s has %d ids; the token files hold uint16 ids (at most 65536)" % (tokenizer, vocab),
              file=sys.stderr)
        return None, 3
    return ids, vocab


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
    ap.add_argument("--tokenizer", help="a Hugging Face byte-level BPE (tokenizer.json, vocab.json, or their "
                    "directory) to encode with instead of bytes")
    ap.add_argument("--amptrain", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "build",
                                                       "ampTrain"),
                    help="the ampTrain binary that encodes for --tokenizer (default build/ampTrain)")
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
    vocab = 256
    if a.tokenizer:
        data, vocab = encode_bpe(data, a.tokenizer, a.amptrain)
        if data is None:
            return vocab
    nval = int(len(data) * a.val_fraction)
    os.makedirs(os.path.dirname(os.path.abspath(a.output)), exist_ok=True)
    write_tokens(a.output, data[:len(data) - nval], a.format)
    if nval:
        vout = a.val_output or val_name(a.output)
        if os.path.abspath(vout) == os.path.abspath(a.output):
            print("make_tokens: the validation file would overwrite %s: give --val-output" % a.output,
                  file=sys.stderr)
            return 2
        write_tokens(vout, data[len(data) - nval:], a.format)
    print("make_tokens: set data.vocab: %d%s" % (vocab, " and data.tokenizer: %s" % a.tokenizer if a.tokenizer else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
