"""CPU kernels in C (csrc/cpu_ops.c), compiled on first use for the host CPU and called through
ctypes: paged decode attention (the 'cpu' attention backend) and the decoder's fused elementwise
steps. Everything falls back to the plain-torch path when no C compiler is available."""
