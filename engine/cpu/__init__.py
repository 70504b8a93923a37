"""CPU kernels in C (csrc/cpu_ops.c, csrc/linear.c), compiled on first use for the host CPU and
called through ctypes: paged attention (the 'cpu' attention backend), rotary embedding, RMSNorm,
the KV-cache write and the linear layers' matmul. Everything falls back to the plain-torch path
(oneDNN for the linears) when no C compiler is available. threads.py fits torch's intra-op threads
to a container's CPU quota; heap.py keeps the memory a step frees for the next step (glibc)."""
