#!/usr/bin/env python3
"""Reads the TensorBoard event files of `packmoe train --tensorboard DIR` and prints each tag's
number of points and last value.

With the `tensorboard` package installed (pip install tensorboard) the files are read by
TensorBoard's own EventAccumulator, so a pass means TensorBoard reads them. Without it a small
reader here decodes the TFRecord frames (checking both masked CRC-32Cs of every record) and the
Event / Summary / Value protobuf fields packmoe writes (src/train/tensorboard.h).

    python3 scripts/tensorboard_check.py DIR [--expect train/loss eval/loss ...]

Exit status 1 when no event file is found, a record is damaged or an --expect tag is missing.
"""
import argparse
import glob
import os
import struct
import sys


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def masked(crc):
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def fields(msg):
    i = 0
    while i < len(msg):
        key, i = varint(msg, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            val, i = varint(msg, i)
        elif wire == 1:
            val, i = msg[i:i + 8], i + 8
        elif wire == 5:
            val, i = msg[i:i + 4], i + 4
        elif wire == 2:
            n, i = varint(msg, i)
            val, i = msg[i:i + n], i + n
        else:
            raise ValueError("wire type %d" % wire)
        yield num, wire, val


def varint(msg, i):
    v, shift = 0, 0
    while True:
        b = msg[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, i


def read_own(path):
    """{tag: [(step, value)]} of one file, every CRC checked."""
    out = {}
    data = open(path, "rb").read()
    at = 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        (lcrc,) = struct.unpack("<I", data[at + 8:at + 12])
        if lcrc != masked(crc32c(header)):
            raise ValueError("%s: length CRC mismatch at byte %d" % (path, at))
        body = data[at + 12:at + 12 + length]
        (dcrc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        if dcrc != masked(crc32c(body)):
            raise ValueError("%s: data CRC mismatch at byte %d" % (path, at))
        at += 16 + length
        step = 0
        for num, wire, val in fields(body):
            if num == 2 and wire == 0:
                step = val
            elif num == 5 and wire == 2:
                for _, _, value in fields(val):
                    tag, x = None, None
                    for n, w, v in fields(value):
                        if n == 1:
                            tag = v.decode()
                        elif n == 2 and w == 5:
                            (x,) = struct.unpack("<f", v)
                    out.setdefault(tag, []).append((step, x))
    return out


def read_tensorboard(directory):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(directory, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags().get("scalars", []):
        out[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir")
    p.add_argument("--expect", nargs="*", default=["train/loss", "train/lr", "train/grad_norm"])
    a = p.parse_args()
    files = sorted(glob.glob(os.path.join(a.dir, "events.out.tfevents.*")))
    if not files:
        print("tensorboard_check: no events.out.tfevents.* in %s" % a.dir)
        return 1
    try:
        scalars = read_tensorboard(a.dir)
        reader = "tensorboard's EventAccumulator"
    except ImportError:
        scalars = {}
        for f in files:
            for tag, points in read_own(f).items():
                scalars.setdefault(tag, []).extend(points)
        reader = "the built-in reader (tensorboard not installed)"
    print("%d event file(s), read with %s" % (len(files), reader))
    for tag in sorted(scalars):
        points = scalars[tag]
        print("  %-28s %6d points, last step %d: %g" % (tag, len(points), points[-1][0], points[-1][1]))
    missing = [t for t in a.expect if t not in scalars]
    if missing:
        print("tensorboard_check: missing tags: %s" % " ".join(missing))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
