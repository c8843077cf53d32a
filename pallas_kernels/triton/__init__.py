"""Paged attention for every CUDA GPU from sm_80 on, in the Triton language.

Leaf package (imports nothing from ``pagedjax``), next to the Hopper-only Mosaic GPU
kernels of ``pallas_kernels``. Modules, imported on demand so that importing this package
needs neither triton, torch nor jax-triton:

- ``kernels``: the two ``triton.jit`` kernels (attention, split merge);
- ``configs``: tile tables for sm_80 / sm_86 / sm_89 / sm_90 and the launch plan (pure Python);
- ``jax_binding``: ``triton_paged_attention`` for JAX arrays, through ``jax_triton.triton_call``
  (optional extra ``pagedjax[triton]``);
- ``torch_launch``: the same kernels on torch tensors (the interpreter tests on CPU);
- ``aot``: compiles the kernels for a GPU target on a machine without a GPU.

See docs/kernels.md ("Triton family").
"""
