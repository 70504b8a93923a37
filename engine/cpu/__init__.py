"""CPU kernels in C (csrc/cpu_ops.c), compiled on first use for the host CPU and called through
ctypes: paged decode attention (the 'cpu' attention backend), rotary embedding and the KV-cache
write. Everything falls back to the plain-torch path when no C compiler is available."""
