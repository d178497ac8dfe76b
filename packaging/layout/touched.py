#!/usr/bin/env python3
"""The functions on the code pages a running process has resident, for the layout list.

    touched.py PID BINARY

Reads the process's page map (/proc/PID/pagemap; root) for its executable mappings of
BINARY, and prints, one a line, every function of BINARY's symbol table (`nm`) that lies on
a resident page, by its mangled name less the hash rustc appends to legacy names
(`17h<16 hex digits>E`), each once, in address order. `profile` runs the binary from a file
system without read-ahead and with a cold cache, where a page is resident only if the
process executed code on it: these are then the functions on the pages it ran. A function
that is not run but shares a page with one that is is printed too (a page is the finest the
kernel tells); generic functions share a name across their instances, as in the list.
"""

import re
import struct
import subprocess
import sys

PAGE = 4096
HASH = re.compile(r"17h[0-9a-f]{16}E$")


def resident_pages(pid, binary):
    """The resident code pages of BINARY in process PID, as offsets from its load address."""
    maps = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == binary:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                maps.append((lo, hi, fields[1], int(fields[2], 16)))
    if not maps:
        sys.exit(f"touched.py: process {pid} does not map {binary}")
    # A position-independent executable's first segment is at address 0 and file offset 0.
    base = min(lo for lo, _, _, offset in maps if offset == 0)
    pages = set()
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for lo, hi, perms, _ in maps:
            if "x" not in perms:
                continue
            pagemap.seek(lo // PAGE * 8)
            entries = pagemap.read((hi - lo) // PAGE * 8)
            for i in range(len(entries) // 8):
                (entry,) = struct.unpack_from("<Q", entries, i * 8)
                if entry >> 63:  # bit 63: present
                    pages.add(lo - base + i * PAGE)
    return pages


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: touched.py PID BINARY")
    pid, binary = sys.argv[1], sys.argv[2]
    pages = resident_pages(pid, binary)
    symbols = subprocess.run(
        ["nm", "-n", "-S", "--defined-only", binary], capture_output=True, text=True, check=True
    ).stdout
    printed = set()
    for line in symbols.splitlines():
        fields = line.split()
        if len(fields) != 4 or fields[2] not in ("t", "T"):
            continue
        address, size = int(fields[0], 16), max(int(fields[1], 16), 1)
        first, last = address // PAGE * PAGE, (address + size - 1) // PAGE * PAGE
        if any(page in pages for page in range(first, last + 1, PAGE)):
            name = HASH.sub("", fields[3])
            if name not in printed:
                printed.add(name)
                print(name)
    print(f"touched.py: {len(pages)} code pages resident, {len(printed)} functions", file=sys.stderr)


if __name__ == "__main__":
    main()
