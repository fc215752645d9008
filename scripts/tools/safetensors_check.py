#!/usr/bin/env python3
"""Validate a .safetensors file and list its tensors, with the Python standard library only (no torch).

    scripts/tools/safetensors_check.py FILE.safetensors            validate; one line per tensor:
                                                            NAME DTYPE [SHAPE] sum=S (S for F32 only, in double)
    scripts/tools/safetensors_check.py --torch FILE.safetensors    also load every tensor with torch.frombuffer (torch
                                                            only, no safetensors package) and print, per tensor,
                                                            NAME first=HEX last=HEX: the fp32 bits of its first and
                                                            last element after .float()
    scripts/tools/safetensors_check.py --torch-load FILE           build the equivalent torch.nn model from a pytorch-named
                                                            export (4-d weight: Conv2d, 2-d weight: Linear, running
                                                            stats: BatchNorm2d, other 1-d weight: LayerNorm, any other
                                                            name such as emb.wte: an nn.Parameter of its module) and
                                                            load the file with load_state_dict(strict=True)

Checks, as the reference implementation makes them (huggingface/safetensors): the 8-byte little-endian header
length within the file, a JSON object header starting with '{', each entry with exactly dtype / shape /
data_offsets, a known dtype, bytes = prod(shape) * dtype size, offsets that tile the data section from 0 to its
end without gaps or overlaps, unique names, __metadata__ of strings; it also reports whether the data section
starts on an 8-byte boundary (ampTrain pads its headers so that it does). Exit 0 when valid, 1 with a message
otherwise.
"""
import json
import struct
import sys

SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
         "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER = 100 << 20


def fail(msg):
    print("safetensors_check: %s" % msg, file=sys.stderr)
    sys.exit(1)


def no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            fail("duplicate key %r in the header" % k)
        seen[k] = v
    return seen


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        fail("%s: %d bytes, shorter than the 8-byte header length" % (path, len(blob)))
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        fail("%s: header length %d exceeds the %d bytes after it" % (path, n, len(blob) - 8))
    if n > MAX_HEADER:
        fail("%s: header length %d beyond 100 MB" % (path, n))
    raw = blob[8:8 + n]
    if not raw.startswith(b"{"):
        fail("%s: the header does not start with '{'" % path)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        fail("%s: malformed JSON header: %s" % (path, e))
    if not isinstance(header, dict):
        fail("%s: the header is not an object" % path)
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        fail("%s: __metadata__ must map strings to strings" % path)
    data = blob[8 + n:]
    entries = []
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            fail("%s: tensor %r: an entry has exactly dtype, shape and data_offsets" % (path, name))
        dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dt not in SIZES:
            fail("%s: tensor %r: unknown dtype %r" % (path, name, dt))
        ints = lambda xs: isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)
        if not ints(shape) or not ints(offs) or len(offs) != 2 or offs[0] > offs[1]:
            fail("%s: tensor %r: bad shape %r or data_offsets %r" % (path, name, shape, offs))
        numel = 1
        for d in shape:
            numel *= d
        if numel * SIZES[dt] != offs[1] - offs[0]:
            fail("%s: tensor %r: shape %r of %s is %d bytes, data_offsets %r hold %d"
                 % (path, name, shape, dt, numel * SIZES[dt], offs, offs[1] - offs[0]))
        entries.append((offs[0], offs[1], name, dt, shape))
    pos = 0
    for begin, end, name, _, _ in sorted(entries):
        if begin != pos:
            fail("%s: tensor %r begins at %d, the previous tensor ends at %d (%s)"
                 % (path, name, begin, pos, "overlap" if begin < pos else "gap"))
        pos = end
    if pos != len(data):
        fail("%s: the tensors cover %d bytes, the data section holds %d" % (path, pos, len(data)))
    return n, meta, entries, data


def build_torch_model(torch, tensors):
    """The torch.nn model whose state_dict keys are the file's names (docs/checkpoint.md, "export")."""
    nn = torch.nn
    root = nn.Module()

    def module_at(path):
        m = root
        for part in path.split(".") if path else []:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        return m

    prefixes = {}
    for name in tensors:
        prefix, _, leaf = name.rpartition(".")
        prefixes.setdefault(prefix, set()).add(leaf)
    for prefix, leaves in sorted(prefixes.items()):
        parent, _, last = prefix.rpartition(".")
        w = tensors.get(prefix + ".weight")
        if "running_mean" in leaves:
            layer = nn.BatchNorm2d(w.shape[0])
        elif w is not None and w.dim() == 4:
            layer = nn.Conv2d(w.shape[1], w.shape[0], (w.shape[2], w.shape[3]), bias="bias" in leaves)
        elif w is not None and w.dim() == 2:
            layer = nn.Linear(w.shape[1], w.shape[0], bias="bias" in leaves)
        elif w is not None and w.dim() == 1:
            layer = nn.LayerNorm(w.shape[0])
        else:
            layer = None
        if layer is not None:
            module_at(parent).add_module(last, layer.to(w.dtype))
        else:  # e.g. emb.wte, emb.wpe: parameters held by their module directly
            m = module_at(prefix)
            for leaf in leaves:
                t = tensors[prefix + "." + leaf]
                m.register_parameter(leaf, nn.Parameter(torch.zeros(t.shape, dtype=t.dtype)))
    return root


def f32_sum(buf):
    return sum(struct.unpack("<%df" % (len(buf) // 4), buf))


def main(argv):
    mode = None
    if argv and argv[0] in ("--torch", "--torch-load"):
        mode = argv.pop(0)
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = argv[0]
    n, meta, entries, data = read(path)
    print("header %d bytes, data starts at byte %d (%s), %d tensors, metadata %s"
          % (n, 8 + n, "8-byte aligned" if (8 + n) % 8 == 0 else "NOT 8-byte aligned", len(entries),
             json.dumps(meta, sort_keys=True)))
    for begin, end, name, dt, shape in entries:
        extra = " sum=%.17g" % f32_sum(data[begin:end]) if dt == "F32" else ""
        print("%s %s %s%s" % (name, dt, shape, extra))
    if mode is None:
        return 0
    import torch  # only for the --torch modes
    tdt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    tensors = {}
    for begin, end, name, dt, shape in entries:
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=tdt[dt]).reshape(shape) if end > begin \
            else torch.zeros(shape, dtype=tdt[dt])
        tensors[name] = t
    if mode == "--torch":
        for name, t in tensors.items():
            flat = t.float().reshape(-1)
            bits = lambda x: struct.unpack("<I", struct.pack("<f", float(x)))[0]
            print("torch %s first=%08x last=%08x" % (name, bits(flat[0]), bits(flat[-1])))
        return 0
    model = build_torch_model(torch, tensors)
    model.load_state_dict(tensors, strict=True)
    kinds = sorted("%s=%s" % (n, type(m).__name__) for n, m in model.named_modules() if n and not list(m.children()))
    print("torch-load strict: %d tensors into %s" % (len(tensors), " ".join(kinds)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
