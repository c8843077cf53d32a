"""Kernel tests: jax, numpy, pytest and hypothesis only (they also run under jax 0.11.2)."""

import os

# Interpreted kernels are single-threaded Python callbacks: keep XLA from oversubscribing
# the shared CPU.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
