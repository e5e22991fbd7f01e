"""The CPU attention backend and the C kernels of the CPU worker (attention, fused
element-wise ops, float32 and bfloat16 matmuls), compiled with the system C compiler at first
use by `kernel_loader`."""
