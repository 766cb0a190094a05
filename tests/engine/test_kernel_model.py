"""``bench.engine.kernel_model`` finds each micro-kernel's inner loop in GCC's assembly."""

import pytest

from bench.engine.kernel_model import block_loop, wrappers

ASSEMBLY = """\
other:
.L1:
\tvpmaddwd\t%zmm0, %zmm1, %zmm2
\tjne\t.L1
\t.size\tother, .-other
kernel:
\tmovq\t%rdi, %rax
.L5:
\tvpmovzxbw\t(%rbx), %zmm0
.L6:
\tvpdpwssd\t%zmm1, %zmm0, %zmm27
\t.p2align 4
\taddq\t$8, %rax
\tjne\t.L6
\tvcvtdq2ps\t%zmm27, %zmm27
\tjne\t.L5
\tjmp\t.L9
.L9:
\tret
\t.size\tkernel, .-kernel
""".splitlines()


def test_block_loop_is_the_innermost_loop_with_the_dot_products_of_that_function() -> None:
    assert block_loop(ASSEMBLY, "kernel") == [
        "\tvpdpwssd\t%zmm1, %zmm0, %zmm27",
        "\taddq\t$8, %rax",
        "\tjne\t.L6",
    ]


def test_a_function_without_dot_products_is_refused() -> None:
    with pytest.raises(RuntimeError, match="no dot-product loop"):
        block_loop([line.replace("vpdpwssd", "vpaddd") for line in ASSEMBLY], "kernel")


def test_the_wrappers_call_each_micro_kernel_of_the_c_source() -> None:
    source = wrappers()
    assert source.startswith('#include "') and "quant_kernels.c" in source.splitlines()[0]
    assert "tiled_q4_1(w, 0, x, 0, N, out, 8);" in source
    assert "tile(w, dw, x, 0, 0, N, out, 4, 2, 1);" in source
