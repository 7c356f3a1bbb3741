#!/usr/bin/env python3
"""Per-kernel device time of one decode step, from an Nsight Compute CSV log.

scripts/gpu-kernel-times.sh runs `xinfer bench` under
    ncu --metrics gpu__time_duration.sum --csv --clock-control none --cache-control none
and hands the log here. Every engine step starts with the token embedding followed by layer 0's
rmsnorm, so the launches from one such pair to the next are one step (lm_head and token pick
included); the prefills are the steps with more than a quarter of the largest step's device time
(`xinfer bench` runs an untimed prefill first, then the timed one), and the last full step after
the last prefill (the most kernels among the later ones) is the decode step reported: time per
kernel (name, grid), calls, and the step's total.

Why ncu and not `xinfer bench --profile`: the trace's per-op device times are distances between
CUDA events, which add ~4 µs per op and so swamp kernels of 2-10 µs (session 4, docs/perf).

    scripts/kernel_times.py LOG [--top N] [--list] [--step I]      (LOG may be gzip-compressed)

--list prints every step's kernel count and device time; --step I reports step I of that list
instead of the decode step (e.g. a speculative verify step of `xinfer bench --speculative-config`).
"""
import argparse
import csv
import gzip
import io
import sys
from collections import defaultdict


def read_csv(path):
    """Every row of an ncu --csv log (plain or gzip-compressed)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    start = text.find('"ID"')  # ncu prints ==PROF== lines before the CSV header
    if start < 0:
        sys.exit(f"{path}: no ncu CSV header (\"ID\",...) found")
    return list(csv.DictReader(io.StringIO(text[start:])))


def read_rows(path):
    rows = [r for r in read_csv(path) if r.get("Metric Name") == "gpu__time_duration.sum"]
    if not rows:
        sys.exit(f"{path}: no gpu__time_duration.sum rows")
    return rows


def kernel_name(row):
    name = row["Kernel Name"].split("(")[0]
    for prefix in ("void ", "xcuda::<unnamed>::", "xcuda::"):
        name = name.replace(prefix, "")
    return name


def microseconds(row):
    value = float(row["Metric Value"].replace(",", ""))
    unit = row.get("Metric Unit", "ns")
    return value / 1000.0 if unit == "ns" else value * {"us": 1.0, "usecond": 1.0, "ms": 1000.0, "msecond": 1000.0}.get(unit, 1e-3)


def steps_of(rows):
    # A step starts with the token embedding, which layer 0's rmsnorm follows; the other embedding
    # launches gather the rows the lm_head scores and stay inside their step.
    names = [kernel_name(r) for r in rows]
    starts = [i for i in range(len(rows) - 1)
              if names[i].startswith("embedding_kernel") and names[i + 1].startswith("rmsnorm_kernel")]
    if len(starts) < 2:
        sys.exit("fewer than two embedding launches: no complete engine step in the log")
    return [rows[a:b] for a, b in zip(starts, starts[1:])]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=40, help="kernels to list (default 40)")
    parser.add_argument("--list", action="store_true", help="list every step (kernels, device time)")
    parser.add_argument("--step", type=int, help="report this step of --list instead of the decode step")
    args = parser.parse_args()

    steps = steps_of(read_rows(args.log))
    totals = [sum(microseconds(r) for r in s) for s in steps]
    if args.list:
        for i, s in enumerate(steps):
            print(f"step {i:3d}: {len(s):5d} kernels {totals[i]:12.1f} us")
    prefill = max(range(len(steps)), key=lambda i: totals[i])
    if args.step is not None:
        if not 0 <= args.step < len(steps):
            sys.exit(f"--step {args.step}: the log has steps 0..{len(steps) - 1}")
        decode = args.step
    else:
        last_prefill = max(i for i in range(len(steps)) if totals[i] > totals[prefill] / 4)
        later = list(range(last_prefill + 1, len(steps)))
        if not later:
            sys.exit("no step after the prefill: run at least two decode tokens")
        most = max(len(steps[i]) for i in later)
        decode = max(i for i in later if len(steps[i]) == most)

    per_kernel = defaultdict(lambda: [0.0, 0])
    for r in steps[decode]:
        entry = per_kernel[(kernel_name(r), r["Grid Size"])]
        entry[0] += microseconds(r)
        entry[1] += 1
    total = totals[decode]
    print(f"{'step ' + str(decode) if args.step is not None else 'decode step'}: {len(steps[decode])} kernels, {total:.1f} us of device time "
          f"(prefill step: {len(steps[prefill])} kernels, {totals[prefill] / 1000:.2f} ms)")
    print(f"{'total us':>10} {'share':>6} {'calls':>6} {'us/call':>9}  kernel (grid)")
    for (name, grid), (us, calls) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{us:10.1f} {100 * us / total:5.1f}% {calls:6d} {us / calls:9.2f}  {name} {grid}")


if __name__ == "__main__":
    main()
