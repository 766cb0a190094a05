"""CPU kernels in C (``quant_kernels.c``), built with the machine's compiler on first use."""
