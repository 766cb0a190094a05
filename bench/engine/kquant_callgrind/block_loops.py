"""Instructions a multiply-add of each innermost loop of a C kernel file built for this CPU, read from
its machine code (``objdump -d``): for what callgrind cannot run (valgrind has no AVX-512), a static count.

    python bench/engine/kquant_callgrind/block_loops.py engine/cpu/q8_0_tiled_kernels.c [more.c ...]

Each innermost loop (a backward jump's body with no loop inside) that multiplies is one micro-kernel's
block loop; its multiply-adds are its dot instructions' products (``vpdpbusd`` 4 a 32-bit lane,
``vpmaddwd`` and ``vpdpwssd`` 2, ``vpmaddubsw`` 2 a 16-bit lane; zmm, ymm or xmm), so the figure needs
no knowledge of which micro-kernel it is: the loop's instructions over its products, executed once a
block. Printed one JSON line a loop, in code order.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LANES = {"zmm": 16, "ymm": 8, "xmm": 4}
PRODUCTS = {"vpdpbusd": 4, "vpmaddwd": 2, "vpdpwssd": 2, "vpmaddubsw": 2}
"""Products a 32-bit lane (vpmaddubsw: a 16-bit lane's 2, twice as many lanes)."""


def instructions(source: Path, out: Path) -> list[tuple[int, str, str]]:
    obj = out / (source.stem + ".o")
    flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c11", "-c", str(source), "-o", str(obj)]
    subprocess.run(["cc", *flags], check=True)
    disassembly = ["objdump", "-d", "--no-show-raw-insn", str(obj)]
    text = subprocess.run(disassembly, capture_output=True, text=True, check=True).stdout
    found = []
    for line in text.splitlines():
        match = re.match(r"\s*([0-9a-f]+):\s+(\S+)\s*(.*)", line)
        if match:
            found.append((int(match.group(1), 16), match.group(2), match.group(3)))
    return found


def products(op: str, args: str) -> int:
    base = op.removesuffix("{vex}")
    if base not in PRODUCTS:
        return 0
    register = re.findall(r"%([xyz]mm)", args)
    lanes = LANES[register[-1]] if register else 0
    return lanes * PRODUCTS[base] * (2 if base == "vpmaddubsw" else 1)


def loops(code: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    index = {address: i for i, (address, _, _) in enumerate(code)}
    found = []
    for i, (address, op, args) in enumerate(code):
        target = re.match(r"([0-9a-f]+)", args)
        if op.startswith("j") and target and int(target.group(1), 16) < address:
            start = index.get(int(target.group(1), 16))
            if start is not None:
                found.append((start, i))

    def innermost(s: int, e: int) -> bool:
        return not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in found)

    return [(s, e) for s, e in found if innermost(s, e)]


def main(sources: list[str]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        for source in sources:
            code = instructions(Path(source), Path(folder))
            for start, end in loops(code):
                body = code[start : end + 1]
                macs = sum(products(op, args) for _, op, args in body)
                if macs:
                    row = {"file": Path(source).name, "instructions": len(body), "macs": macs}
                    print(json.dumps(row | {"per_mac": round(len(body) / macs, 4)}))


if __name__ == "__main__":
    main(sys.argv[1:])
