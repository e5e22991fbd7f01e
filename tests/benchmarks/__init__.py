"""The benchmarks cannot rot: their parts in process, each benchmark's --quick run in a
subprocess, the GPU kit's dry run. All of them are marked `slow`."""
