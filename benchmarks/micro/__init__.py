"""Parts measured alone: attention kernels (`attention`), linears (`linears`), the scheduler
(`scheduler`), IPC (`ipc`), the CUDA kernels' static resources (`kernels_static`) and where a
decode step's time goes (`profile_step`); each `python -m benchmarks.micro.<module>`."""
