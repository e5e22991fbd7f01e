"""Tests of `kernels/`: the CPU C kernels on every CPU they are built for, the CUDA kernels
(compiled here, run under the CPU emulator, and on a GPU when there is one), the torch
reference."""
