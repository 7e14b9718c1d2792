#!/usr/bin/env python3
"""Busy and idle GPU time of one iteration of a timeline written by cuda_timeline.cpp.

An iteration runs from one marker record to the next: by default the device-to-host copy of
1032 bytes with which each MoE layer forward fetches its E + 1 = 129 expert counts
(bench_moe_block's qwen3 shape); with --marker-kernel NAME, the first of each run of kernels whose
mangled name contains NAME (e.g. adamw_kernel: one training step to the next). The report is the iteration's span, the time some kernel or copy
ran (busy) and the rest (idle), the largest idle gaps with what followed each, and the busy time
per kernel (demangled by c++filt when it is installed) or copy.

Usage: timeline_gaps.py TIMELINE [--marker-bytes N | --marker-kernel NAME] [--iteration I] [--top N]
"""
import argparse
import collections
import re
import shutil
import subprocess
import sys


def read_records(path):
    records = []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 3)
            if len(parts) < 3:
                continue
            what = parts[3] if len(parts) > 3 else ""
            records.append((int(parts[1]), int(parts[2]), parts[0], what))
    records.sort()
    return records


def demangler(names):
    """A function from mangled kernel name to a short readable one."""
    table = {}
    if shutil.which("c++filt") and names:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        table = dict(zip(names, out.stdout.splitlines()))

    def short(name):
        text = table.get(name, name)
        text = re.sub(r"packmoe::|\(anonymous namespace\)::|^void ", "", text)
        text = re.sub(r"\(.*$", "", text)  # drop the argument list
        return text[:90]

    return short


def label(record, short):
    kind, what = record[2], record[3]
    if kind == "K":
        return short(what)
    if kind == "C":
        return "copy " + what
    return "memset " + what


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline")
    ap.add_argument("--marker-bytes", type=int, default=1032,
                    help="bytes of the device-to-host copy that starts each iteration")
    ap.add_argument("--marker-kernel", default=None,
                    help="instead: each run of kernels whose mangled name contains this starts one")
    ap.add_argument("--iteration", type=int, default=-2,
                    help="which iteration (Python index over the marker intervals; default: the "
                         "next to last complete one)")
    ap.add_argument("--top", type=int, default=12, help="gaps and kernels to list")
    a = ap.parse_args()

    records = read_records(a.timeline)
    if a.marker_kernel:
        marker = a.marker_kernel
        hit = [r[2] == "K" and marker in r[3] for r in records]
        marks = [i for i in range(len(records)) if hit[i] and (i == 0 or not hit[i - 1])]
    else:
        marker = "kind2 bytes%d" % a.marker_bytes
        marks = [i for i, r in enumerate(records) if r[2] == "C" and r[3] == marker]
    if len(marks) < 2:
        sys.exit("timeline_gaps: fewer than two '%s' markers in %s" % (marker, a.timeline))
    intervals = list(zip(marks, marks[1:]))
    first, last = intervals[a.iteration]
    segment = records[first:last]
    short = demangler(sorted({r[3] for r in segment if r[2] == "K"}))

    span = records[last][0] - records[first][0]
    busy, gaps, end = 0, [], segment[0][0]
    for r in segment:
        if r[0] > end:
            gaps.append((r[0] - end, label(r, short)))
        busy += max(0, r[1] - max(r[0], end))
        end = max(end, r[1])
    print("iteration %d of %d: span %.1f us, busy %.1f us, idle %.1f us, %d records"
          % (a.iteration, len(intervals), span / 1e3, busy / 1e3, (span - busy) / 1e3,
             len(segment)))
    print("largest idle gaps (before):")
    for gap, what in sorted(gaps, reverse=True)[:a.top]:
        print("  %9.1f us  %s" % (gap / 1e3, what))
    time, count = collections.Counter(), collections.Counter()
    for r in segment:
        time[label(r, short)] += r[1] - r[0]
        count[label(r, short)] += 1
    print("busy time per kernel / copy:")
    for what, t in time.most_common(a.top):
        print("  %9.1f us  x%-3d %s" % (t / 1e3, count[what], what))


if __name__ == "__main__":
    main()
