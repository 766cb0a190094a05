"""A static estimate of the q4_1 micro-kernels' throughput on a CPU this machine may not have.

    python -m bench.engine.kernel_model [--march sapphirerapids] [--mcpu icelake-server]

Compiles the AVX-512 tiles and the VNNI kernel (``engine/cpu/quant_kernels.c``, ``q4_1_tiled_kernels.c``) for
``--march`` (GCC, as the engine builds them), takes each micro-kernel's
inner loop (one block) from the assembly and asks ``llvm-mca`` how many cycles an iteration costs
on ``--mcpu``'s scheduling model. Prints JSON: multiply-adds per cycle for each micro-kernel.

A model, not a measurement: memory, frequency and the model's own errors are left out. It says
whether a kernel written on a machine without the instructions is worth measuring on one that has
them (docs/engine.md, "The VNNI q4_1 kernel"); only a timed run there decides.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from engine.cpu import kernels

# name -> (the call the wrapper makes, multiply-adds in one iteration of its block loop)
KERNELS = {
    "tiles_4_rows_2_columns": ("tile(w, dw, x, 0, 0, N, out, 4, 2, 1)", 4 * 2 * kernels.BLOCK),
    "tiles_1_row_2_columns": ("tile(w, dw, x, 0, 0, N, out, 1, 2, 1)", 1 * 2 * kernels.BLOCK),
    "vnni_8_rows_16_columns": ("tiled_q4_1(w, 0, x, 0, N, out, 8)", 8 * kernels.TILE_N * kernels.BLOCK),
    "vnni_1_row_16_columns": ("tiled_q4_1(w, 0, x, 0, N, out, 1)", 1 * kernels.TILE_N * kernels.BLOCK),
}
DOT = re.compile(r"\bvp(dpwssd|maddwd)\b")


def wrappers() -> str:
    by_name = {source.name: source for source in kernels.SOURCES}
    sources = (by_name["quant_kernels.c"], by_name["q4_1_tiled_kernels.c"])
    calls = "".join(
        f"void {name}(const Weights *w, const float *dw, const QuantizedRows *x, int64_t N, float *out)"
        f" {{ (void)dw; {call}; }}\n"
        for name, (call, _) in KERNELS.items()
    )
    return "".join(f'#include "{source}"\n' for source in sources) + calls


def block_loop(assembly: list[str], name: str) -> list[str]:
    """The innermost backward-branching loop of function ``name`` that holds the dot products."""
    start = assembly.index(f"{name}:")
    end = next(i for i in range(start, len(assembly)) if assembly[i].startswith(f"\t.size\t{name},"))
    body = assembly[start:end]
    labels = {line[:-1]: i for i, line in enumerate(body) if re.fullmatch(r"\.L\d+:", line)}
    loops = []
    for i, line in enumerate(body):
        jump = re.fullmatch(r"\tj\w+\t(\.L\d+)", line)
        if jump and labels.get(jump.group(1), i) < i:
            instructions = [
                x
                for x in body[labels[jump.group(1)] + 1 : i + 1]
                if x.startswith("\t") and not x.startswith("\t.")
            ]
            if any(DOT.search(x) for x in instructions):
                loops.append(instructions)
    if not loops:
        raise RuntimeError(f"no dot-product loop in {name}")
    return min(loops, key=len)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--march", default="sapphirerapids", help="GCC's target (default: sapphirerapids)")
    parser.add_argument("--mcpu", default="icelake-server", help="llvm-mca's model (default: icelake-server)")
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args(argv)
    compiler, mca = shutil.which("gcc"), shutil.which("llvm-mca")
    if compiler is None or mca is None:
        print(json.dumps({"error": "needs gcc and llvm-mca"}))
        return 1
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        c_file, asm = Path(tmp, "model.c"), Path(tmp, "model.s")
        c_file.write_text(wrappers())
        flags = ["-O3", f"-march={args.march}", "-fopenmp", "-std=c11", "-S"]
        subprocess.run([compiler, *flags, str(c_file), "-o", str(asm)], check=True, capture_output=True)
        assembly = asm.read_text().splitlines()
        for name, (_, macs) in KERNELS.items():
            loop = Path(tmp, f"{name}.s")
            loop.write_text("\n".join(block_loop(assembly, name)) + "\n")
            report = subprocess.run(
                [mca, f"-mcpu={args.mcpu}", f"-iterations={args.iterations}", str(loop)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            cycles = int(re.search(r"Total Cycles:\s+(\d+)", report).group(1)) / args.iterations
            results[name] = {"cycles_per_block": round(cycles, 2), "macs_per_cycle": round(macs / cycles, 1)}
    print(
        json.dumps({"benchmark": "kernel_model", "march": args.march, "mcpu": args.mcpu, "kernels": results})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
