"""Prints the history rows of a W&B offline run, read from its .wandb file
with W&B's own record protobuf (the file is W&B's LevelDB-log framing:
a 7-byte header ':W&B' + magic + version, then 32 KiB blocks of records,
each a 7-byte header (CRC, length, type FULL/FIRST/MIDDLE/LAST) and a
chunk of a `wandb_internal_pb2.Record`).

usage: read_wandb_offline.py RUN.wandb  → one JSON line per history row:
{"_step": N, "name": value, ...}
"""
import json
import struct
import sys

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7


def records(data):
    assert data[:4] == b":W&B", "not a W&B run file"
    pos = HEADER
    buf = b""
    while pos + HEADER <= len(data):
        left = BLOCK - (pos % BLOCK)
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk
            buf = b""


def main():
    data = open(sys.argv[1], "rb").read()
    for raw in records(data):
        r = pb.Record()
        r.ParseFromString(raw)
        if r.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in r.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        print(json.dumps(row, sort_keys=True))


if __name__ == "__main__":
    main()
