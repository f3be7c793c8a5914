"""Zero the device code of other GPU architectures in a shared library's fatbinary, so that it
compresses to what one architecture needs (scripts/gpu_te_wheels.sh: Transformer Engine's 343-463 MB
core library carried to an offline H100 machine that takes 64 MiB a call).

    python scripts/fatbin_prune.py LIB.so OUT.so --keep 90     (OUT.so: same size, same layout)
    python scripts/fatbin_prune.py LIB.so                      (lists the entries by kind and sm)

The .nv_fatbin section is a run of containers (magic 0xBA55ED50, u16 version, u16 header size,
u64 size of the entries), each entry a header (u16 kind: 1 PTX / 2 ELF, u16 version, u32 header
size, u64 padded payload size, ..., u32 sm at byte 28) and its payload. Only payloads are zeroed:
every offset the host code holds into the section stays valid, and the CUDA runtime picks the
entry of the running GPU's architecture, which is kept.
"""
import argparse
import collections
import struct

FATBIN_MAGIC = 0xBA55ED50


def section(data: bytes, wanted: str):
    """(offset, size) of an ELF64 section by name."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    names = header(shstrndx)[4]
    for i in range(shnum):
        h = header(i)
        name = data[names + h[0]: data.index(0, names + h[0])].decode()
        if name == wanted:
            return h[4], h[5]
    raise SystemExit(f"fatbin_prune.py: no {wanted} section")


def entries(data: bytes):
    """(payload offset, payload size, kind, sm) of every fatbin entry."""
    start, size = section(data, ".nv_fatbin")
    p, end = start, start + size
    while p < end:
        magic, _, header_size, body = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:  # alignment padding between containers
            p += 8
            continue
        q, stop = p + header_size, p + header_size + body
        while q < stop:
            kind, _, entry_header, padded = struct.unpack_from("<HHIQ", data, q)
            sm, = struct.unpack_from("<I", data, q + 28)
            yield q + entry_header, padded, "ptx" if kind == 1 else "elf", sm
            q += entry_header + padded
        p = stop


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lib")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--keep", type=lambda s: {int(x) for x in s.split(",")}, default={90},
                    help="sm numbers whose code stays (default 90)")
    args = ap.parse_args()
    data = bytearray(open(args.lib, "rb").read())
    sizes, zeroed = collections.Counter(), 0
    for off, size, kind, sm in list(entries(data)):
        sizes[kind, sm] += size
        if args.out and sm not in args.keep:
            data[off: off + size] = bytes(size)
            zeroed += size
    for (kind, sm), size in sorted(sizes.items()):
        print(f"{kind} sm_{sm}: {size / 2**20:.1f} MiB")
    if args.out:
        if not any(sm in args.keep for _, sm in sizes):
            raise SystemExit(f"fatbin_prune.py: no entry for sm {sorted(args.keep)}: nothing would run")
        open(args.out, "wb").write(data)
        print(f"zeroed {zeroed / 2**20:.1f} MiB -> {args.out}")


if __name__ == "__main__":
    main()
