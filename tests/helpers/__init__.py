"""What several test subjects share: factories of core objects, engines in process, model
files, the core-serve process, the CPU kernels' builds and the CUDA emulator."""
