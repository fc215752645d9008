#!/usr/bin/env python3
"""Check a run directory's TensorBoard event files against its scale_log.csv and eval.jsonl, reading them with the
`tensorboard` package (scripts/install-deps.sh --test) as TensorBoard itself does.

    /usr/bin/python3 scripts/ref/tb_check.py RUN_DIR [--killed] [--files N]
        Every scalar at every step must equal the run's own log: train/<column> the scale_log.csv row of that
        step, eval/<metric> the eval.jsonl record of that step. TensorBoard stores a scalar as a float32, so a
        value must equal the CSV's or JSON's number rounded to float32 (NaN equals NaN; a JSON null, which
        ampTrain writes for a non-finite value, equals any non-finite value). Where a step appears twice in a
        log (a resume after a kill trains some steps again), the last row counts, as TensorBoard keeps the
        last writer's events (an evaluation at a step that a later resume trained again without evaluating
        it is one TensorBoard drops, so it may be missing). Without --killed, every step of the logs must
        also be in the event files, and every tag must be one ampTrain writes. --killed (a run killed with
        kill -9): the logs may hold steps the event files lack (their last rows were not yet flushed) and end
        in a partial line, but every event read must still equal its row; it says how many steps of the CSV
        the event files lack. --files N: the directory must hold
        exactly N event files. eval.jsonl must hold only the run's own evaluations: the records `ampTrain eval`
        appends are not in the event files.
        Exit 0 when all match (prints a summary), 1 naming the first difference, 2 on bad usage.

    /usr/bin/python3 scripts/ref/tb_check.py --text DIR TAG
        Print the text summaries of TAG in DIR's event files as JSON, [[step, "text"], ...] (tests of the writer).
"""
import csv
import io
import json
import math
import os
import sys

import numpy as np
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.util import tensor_util

# scale_log.csv column -> scalar tag; the columns not here (step, overflow_layer) are not numbers
COLUMNS = {
    "epoch": "train/epoch",
    "loss": "train/loss",
    "scale": "train/loss_scale",
    "found_inf": "train/found_inf",
    "skipped": "train/skipped",
    "skips_total": "train/skips_total",
    "grad_norm": "train/grad_norm",
    "clip_coef": "train/clip_coef",
    "lr": "train/lr",
    "grad_zero_frac": "train/grad_zero_frac",
    "samples_per_s": "train/samples_per_s",
}
TOKENS_TAG = "train/tokens_per_s"
EVAL_TAGS = {"loss": "eval/loss", "accuracy": "eval/accuracy", "perplexity": "eval/perplexity"}


class Mismatch(Exception):
    pass


def whole_lines(path, killed):
    """The file's lines; with `killed`, a last line without its newline (cut by the kill) is left out."""
    with open(path, newline="") as f:
        text = f.read()
    if killed and text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    return text


def read_csv(run_dir, killed):
    rows = {}
    for row in csv.DictReader(io.StringIO(whole_lines(os.path.join(run_dir, "scale_log.csv"), killed))):
        rows[int(row["step"])] = row  # the last row of a step counts
    return rows


def read_evals(run_dir, killed):
    path = os.path.join(run_dir, "eval.jsonl")
    evals = {}
    if os.path.exists(path):
        for line in whole_lines(path, killed).splitlines():
            rec = json.loads(line)
            evals[rec["step"]] = rec
    return evals


def tokens_per_sample(run_dir):
    """data.seq_len for token models (data.format text or tokens), else 0: config.yaml as the run wrote it."""
    import yaml

    with open(os.path.join(run_dir, "config.yaml")) as f:
        data = yaml.safe_load(f)["data"]
    return int(data["seq_len"]) if data["format"] in ("text", "tokens") else 0


def same(expected, got):
    """Whether the event's float32 `got` is `expected` (a float, or None for a JSON null) as float32."""
    if expected is None:
        return not math.isfinite(got)
    want = np.float32(expected)
    return (np.isnan(want) and math.isnan(got)) or float(want) == got


def restart_steps(run_dir, names):
    """The SessionLog START steps of every event file but the first (in name order, TensorBoard's): a resume's first
    step. TensorBoard drops the earlier files' events at or past it."""
    starts = []
    for name in sorted(names)[1:]:
        for event in event_file_loader.EventFileLoader(os.path.join(run_dir, name)).Load():
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                starts.append(event.step)
    return starts


def check_tag(events, tag, want, killed, where, orphaned=lambda step: False):
    """`want`: step -> expected value (None: a JSON null). The events must be one a step, each equal to want's.
    A step of `want` that the events lack is an error unless `killed` or orphaned(step)."""
    seen = set()
    for e in events:
        if e.step in seen:
            raise Mismatch(f"{tag}: step {e.step} appears twice in the event files")
        seen.add(e.step)
        if e.step not in want:
            raise Mismatch(f"{tag}: step {e.step} is in the event files but not in {where}")
        if not same(want[e.step], e.value):
            raise Mismatch(f"{tag} at step {e.step}: event file {e.value!r} != {where} {want[e.step]!r} "
                           f"(as float32 {float(np.float32(want[e.step] if want[e.step] is not None else 'nan'))!r})")
    missing = sorted(s for s in set(want) - seen if not orphaned(s))
    if missing and not killed:
        raise Mismatch(f"{tag}: step {missing[0]} of {where} is not in the event files ({len(missing)} steps missing)")
    return len(seen)


def number(text):
    return float(text) if text != "" else None


def check(run_dir, killed, files):
    names = [n for n in os.listdir(run_dir) if "tfevents" in n]
    if not names:
        raise Mismatch("no events.out.tfevents.* file")
    if files is not None and len(names) != files:
        raise Mismatch(f"{len(names)} event files, expected {files}: {sorted(names)}")
    acc = ea.EventAccumulator(run_dir, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    rows = read_csv(run_dir, killed)
    evals = read_evals(run_dir, killed)
    tokens = tokens_per_sample(run_dir)
    starts = restart_steps(run_dir, names)
    # an evaluation a resume from an earlier checkpoint did not make again: TensorBoard dropped it with the
    # steps the resume trained again, while eval.jsonl keeps it
    orphaned = lambda step: any(step >= s for s in starts)
    expected_tags = set(COLUMNS.values()) | ({TOKENS_TAG} if tokens else set())
    counted = 0
    for column, tag in COLUMNS.items():
        want = {s: number(r[column]) for s, r in rows.items() if r[column] != ""}
        if not want and tag not in tags:
            continue  # a column empty on every row (grad_zero_frac in fp32)
        counted += check_tag(acc.Scalars(tag) if tag in tags else [], tag, want, killed, "scale_log.csv")
    if tokens:
        want = {s: float(r["samples_per_s"]) * tokens for s, r in rows.items()}
        counted += check_tag(acc.Scalars(TOKENS_TAG) if TOKENS_TAG in tags else [], TOKENS_TAG, want, killed,
                             f"scale_log.csv samples_per_s x data.seq_len {tokens}")
    for metric, tag in EVAL_TAGS.items():
        want = {s: rec.get(metric) for s, rec in evals.items() if metric in rec and
                not (metric == "accuracy" and rec[metric] is None)}
        if want or tag in tags:
            expected_tags.add(tag)
            counted += check_tag(acc.Scalars(tag) if tag in tags else [], tag, want, killed, "eval.jsonl", orphaned)
    unknown = sorted(tags - expected_tags)
    if unknown:
        raise Mismatch(f"tag {unknown[0]} is not one ampTrain writes for this run")
    loss_steps = {e.step for e in acc.Scalars("train/loss")} if "train/loss" in tags else set()
    return len(names), counted, len(set(rows) - loss_steps)


def dump_text(run_dir, tag):
    acc = ea.EventAccumulator(run_dir, size_guidance={ea.TENSORS: 0})
    acc.Reload()
    out = []
    for e in acc.Tensors(tag):
        value = tensor_util.make_ndarray(e.tensor_proto)
        out.append([e.step, value.item().decode("utf-8")])
    print(json.dumps(out, ensure_ascii=False))


def main(argv):
    if len(argv) == 4 and argv[1] == "--text":
        dump_text(argv[2], argv[3])
        return 0
    args = argv[1:]
    killed = "--killed" in args
    files = None
    if "--files" in args:
        i = args.index("--files")
        files = int(args[i + 1])
        del args[i : i + 2]
    args = [a for a in args if a != "--killed"]
    if len(args) != 1 or args[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        nfiles, counted, unflushed = check(args[0], killed, files)
    except Mismatch as e:
        print(f"tb_check: {args[0]}: {e}", file=sys.stderr)
        return 1
    print(f"tb_check: {args[0]}: {counted} scalars in {nfiles} event file(s) equal the run's logs" +
          (f"; {unflushed} steps of scale_log.csv are not in them" if killed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
