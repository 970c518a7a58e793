"""Cut a CUDA extension's fatbins down to what one GPU architecture loads.

    python3 tools/gpu/fatbin_sm90.py IN.so OUT.so [--arch 90]

vLLM's CUDA wheel carries every kernel for sm_80 ... sm_120 in each fatbin container
of the ``.nv_fatbin`` section; an H200 loads only the sm_90 ELF images (or PTX where a
container has none). This keeps those entries, moves them to the front of their
container, shrinks the container's size field and zero-fills the rest: container
start addresses (what ``.nvFatBinSegment`` points at) and the ELF layout are
unchanged, so the loader and the driver see a valid file, and the zeros compress to
nothing (vLLM's ``_C_stable_libtorch``: 51.9 MiB -> 15.9 MiB compressed). Used by
tools/gpu/make_vllm_engine_bundle.sh only; the bundle never enters the repository.
"""

import argparse
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


def section(data: bytes, wanted: str):
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    strings = header(shstrndx)[4]
    for i in range(shnum):
        h = header(i)
        name = data[strings + h[0] : data.index(b"\0", strings + h[0])].decode()
        if name == wanted:
            return h[4], h[5]
    return None


def compact(data: bytearray, arch: int):
    found = section(data, ".nv_fatbin")
    if found is None:
        raise SystemExit("fatbin_sm90: no .nv_fatbin section in this file")
    start, size = found
    end, pos = start + size, start
    containers = kept = dropped = 0
    while pos + 16 <= end:
        magic, _version, header_size, body_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned; padding between them
            continue
        containers += 1
        entry, body_end, entries = pos + header_size, pos + header_size + body_size, []
        while entry < body_end:
            kind, _ever, entry_header, padded = struct.unpack_from("<HHII", data, entry)
            (entry_arch,) = struct.unpack_from("<I", data, entry + 28)
            entries.append((kind, entry_arch, bytes(data[entry : entry + entry_header + padded])))
            entry += entry_header + padded
        has_elf = any(k == KIND_ELF and a == arch for k, a, _ in entries)
        keep = [
            b
            for k, a, b in entries
            if (k == KIND_ELF and a == arch) or (k == KIND_PTX and not has_elf)
        ]
        if not keep:  # nothing this GPU loads: keep the smallest entry, the container stays valid
            keep = [min((b for _, _, b in entries), key=len)]
        body = b"".join(keep)
        kept += len(body)
        dropped += body_size - len(body)
        data[pos + header_size : body_end] = body + bytes(body_size - len(body))
        struct.pack_into("<Q", data, pos + 8, len(body))
        pos = body_end
    return containers, kept, dropped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    with open(args.src, "rb") as f:
        data = bytearray(f.read())
    containers, kept, dropped = compact(data, args.arch)
    with open(args.dst, "wb") as f:
        f.write(data)
    print(
        f"{args.src}: {containers} fatbin containers, kept {kept / 2**20:.1f} MiB "
        f"(sm_{args.arch}), zeroed {dropped / 2**20:.1f} MiB",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
