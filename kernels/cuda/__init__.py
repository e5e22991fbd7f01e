"""The CUDA attention backend: `.cu` kernels compiled by NVRTC (`module_loader`), launched
through CuPy (`backend`) with shapes and splits from `launch_config` and `occupancy`, and
warmed up before serving (`warmup`)."""
