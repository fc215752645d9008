#!/usr/bin/env python3
"""Name and sum up an AMPTRAIN_POOL_PROFILE file (lib/base/pool_profile.h): per pool, each (chunk function, caller) with its
wall time, the caller's wait for the other threads, and the serial time on the caller before it (since the pool's
previous job), in microseconds per step when STEPS is given (else in total), most time first.
  AMPTRAIN_POOL_PROFILE=/tmp/prof ampTrain run CONFIG run.steps=1000 ...; scripts/dev/pool_profile.py /tmp/prof 1000
Names come from addr2line (binutils) on the object files the profile names; build with symbols to see them."""
import subprocess
import sys


def names(obj, offsets):
    """Function names of offsets into obj, by addr2line; '?' where it cannot say."""
    if obj == "?" or not offsets:
        return ["?"] * len(offsets)
    try:
        out = subprocess.run(["addr2line", "-f", "-s", "-e", obj] + [hex(o) for o in offsets],
                             capture_output=True, text=True, check=True).stdout.split("\n")
        return [out[2 * i] if 2 * i < len(out) and out[2 * i] else "?" for i in range(len(offsets))]
    except (OSError, subprocess.CalledProcessError):
        return ["?"] * len(offsets)


def report(header, rows, steps, top):
    per = float(steps) if steps else 1.0
    unit = "us a step" if steps else "us in all"
    wanted = {}
    for r in rows:  # (fn_obj, fn_off, caller_obj, caller_off - 1: the call instruction, not the one after)
        wanted.setdefault(r[0], set()).add(r[1])
        wanted.setdefault(r[2], set()).add(max(r[3] - 1, 0))
    named = {}
    for obj, offs in wanted.items():
        offs = sorted(offs)
        for o, n in zip(offs, names(obj, offs)):
            named[(obj, o)] = n
    total = sum(r[7] for r in rows) / 1e3 / per
    wait = sum(r[8] for r in rows) / 1e3 / per
    gap = sum(r[9] for r in rows) / 1e3 / per
    print(header)
    print("%.1f %s in parallel_for (the caller waiting for other threads %.1f), %.1f serial between jobs"
          % (total, unit, wait, gap))
    print("%10s %10s %10s %8s %8s %8s  %s"
          % ("time", "wait", "serial", "calls", "inline", "chunks", "function <- caller"))
    for r in sorted(rows, key=lambda r: -(r[7] + r[9]))[:top]:
        print("%10.1f %10.1f %10.1f %8.1f %8.1f %8.1f  %s <- %s"
              % (r[7] / 1e3 / per, r[8] / 1e3 / per, r[9] / 1e3 / per, r[4] / per, r[5] / per, r[6] / max(r[4], 1),
                 named[(r[0], r[1])], named[(r[2], max(r[3] - 1, 0))]))


def main():
    if len(sys.argv) < 2 or len(sys.argv) > 4:
        sys.exit("usage: scripts/dev/pool_profile.py PROFILE [STEPS] [TOP=30]")
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    header, rows = None, []
    with open(sys.argv[1]) as f:
        for line in f:
            if line.startswith("#"):
                if header is not None:
                    report(header, rows, steps, top)
                header, rows = line.strip(), []
                continue
            w = line.split()
            if len(w) != 10:
                continue
            fn_obj, fn_off = w[0], int(w[1], 16)
            ca_obj, ca_off = w[2], int(w[3], 16)
            rows.append((fn_obj, fn_off, ca_obj, ca_off) + tuple(int(x) for x in w[4:]))
    if header is not None:
        report(header, rows, steps, top)


if __name__ == "__main__":
    main()
