"""CPU kernels in C (csrc/cpu_ops.c), compiled on first use for the host CPU and called through
ctypes: paged decode attention (the 'cpu' attention backend), rotary embedding, RMSNorm and the
KV-cache write. Everything falls back to the plain-torch path when no C compiler is available.
threads.py fits torch's intra-op threads to a container's CPU quota; heap.py keeps the memory a
step frees for the next step (glibc)."""
