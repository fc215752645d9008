#!/usr/bin/env python3
"""Train a small GPT-2-style byte-level BPE on the fortunes and write what ampTrain's tokenizer must reproduce.

Hugging Face's `tokenizers` (the test set: scripts/install-deps.sh --test) trains a byte-level BPE (ByteLevel
pre-tokenizer without a prefix space, ByteLevel decoder, the full byte alphabet, `<|endoftext|>` as a special
token) on every fortune of the given files, and writes into OUTDIR:

  tokenizer.json             the one-file form (merges as ["a", "b"] pairs, the library's newer layout)
  tokenizer_strings.json     the same with merges as "a b" strings (older versions' layout)
  vocab.json, merges.txt     GPT-2's two-file form
  cases.txt                  one case per fortune, then the extra cases below:
                               "<text bytes> <ids> <decoded bytes>\\n", the text's bytes, "\\n",
                               the library's ids separated by spaces, "\\n", the library's decode of them, "\\n"

Fortunes are the files' texts split at lines holding a lone '%'. tests/test_tokenizer.c runs this with
/usr/bin/python3 and requires ampTrain's encode and decode to give the same on every case.

  /usr/bin/python3 scripts/ref/bpe_reference.py --vocab 1500 OUTDIR /usr/share/games/fortunes/cookie ...
"""
import argparse
import json
import os
import sys

EXTRA = [
    "",
    " ",
    "   leading and trailing   ",
    "tabs\tand\nnewlines\n\n\nend\n",
    "It's we'll they're I've he'd you'll 'tis",
    "numbers 12345 and 3.14159 and x2y",
    "<|endoftext|>",
    "one<|endoftext|>two <|endoftext|> three<|endoftext|><|endoftext|>",
    "<|endoftext|",
    "Grüße, café, naïve: ÆØÅ æøå",
    "Ελληνικά και русский текст",
    "日本語のテキスト、中文文本。",
    "emoji 😀🎉 and symbols ©®™ ½ ² Ⅻ",
    "spaces\u3000ideographic\u00a0nbsp\u2028line",
    "punctuation!!! ??? ... --- ((()))",
    "a  b   c    d",
    " \n \n",
    "'''s 's 'S 'LL",
]


def fortunes(paths):
    out = []
    for p in paths:
        with open(p, "rb") as f:
            text = f.read().decode("utf-8")
        for piece in text.split("\n%\n"):
            if piece.strip("%\n"):
                out.append(piece)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("inputs", nargs="+", help="fortune files")
    ap.add_argument("--vocab", type=int, default=1500, help="vocabulary size (default 1500)")
    a = ap.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = fortunes(a.inputs)
    if not texts:
        print("bpe_reference: no fortunes in %s" % " ".join(a.inputs), file=sys.stderr)
        return 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(a.outdir, exist_ok=True)
    tok.save(os.path.join(a.outdir, "tokenizer.json"))
    tok.model.save(a.outdir)  # vocab.json, merges.txt
    with open(os.path.join(a.outdir, "tokenizer.json"), encoding="utf-8") as f:
        doc = json.load(f)
    doc["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    with open(os.path.join(a.outdir, "tokenizer_strings.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
    cases = texts + EXTRA
    encs = tok.encode_batch(cases)
    with open(os.path.join(a.outdir, "cases.txt"), "wb") as f:
        for text, enc in zip(cases, encs):
            raw = text.encode("utf-8")
            dec = tok.decode(enc.ids, skip_special_tokens=False).encode("utf-8")
            f.write(b"%d %d %d\n" % (len(raw), len(enc.ids), len(dec)))
            f.write(raw + b"\n" + " ".join(map(str, enc.ids)).encode() + b"\n" + dec + b"\n")
    print("bpe_reference: %d cases, vocab %d, in %s" % (len(cases), tok.get_vocab_size(), a.outdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
