#!/usr/bin/env python3
"""Per-kernel Nsight Compute section metrics (throughput, scheduler, warp state, occupancy), from
the CSV log scripts/gpu-kernel-stalls.sh writes: for each (kernel, grid, block) the mean of every
numeric metric over its launches. Answers "is this kernel issue-bound or waiting on memory?"
(issue slots busy, eligible warps per scheduler, warp cycles per issued instruction, DRAM
throughput) before it is changed.

    scripts/kernel_stalls.py LOG [--metric REGEX]      (LOG may be gzip-compressed)
"""
import argparse
import re
import sys
from collections import defaultdict

from kernel_times import kernel_name, read_csv  # same directory: the ncu CSV reading is shared


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def short_name(metric):
    """Stall-reason metrics by their reason: smsp__average_warps_issue_stalled_X_per_issue_active.ratio -> stall X."""
    m = re.fullmatch(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio", metric)
    return f"stall {m.group(1)}" if m else metric


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--metric", default="", help="only metrics whose name matches this regex")
    args = parser.parse_args()
    wanted = re.compile(args.metric)

    # (kernel, grid, block) -> (section, metric, unit) -> [sum, count]; launches counted by ID.
    metrics = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    launches = defaultdict(set)
    for row in read_csv(args.log):
        value = number(row.get("Metric Value", ""))
        if value is None or not wanted.search(row.get("Metric Name", "")):
            continue
        key = (kernel_name(row), row.get("Grid Size", ""), row.get("Block Size", ""))
        launches[key].add(row.get("ID"))
        entry = metrics[key][(row.get("Section Name", ""), row["Metric Name"], row.get("Metric Unit", ""))]
        entry[0] += value
        entry[1] += 1
    if not metrics:
        sys.exit(f"{args.log}: no numeric metrics" + (f" matching {args.metric!r}" if args.metric else ""))
    for key in sorted(metrics, key=lambda k: (k[0], k[1])):
        name, grid, block = key
        print(f"\n{name} grid {grid} block {block}: {len(launches[key])} launches")
        for (section, metric, unit), (total, count) in metrics[key].items():
            print(f"  {section[:28]:28s} {short_name(metric)[:44]:44s} {total / count:14.2f} {unit}")


if __name__ == "__main__":
    main()
