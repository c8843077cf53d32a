"""Whether a GPU parity run of the Pallas kernels against the XLA reference is committed.

H200_PARITY_VERIFIED is True only with H200_PARITY_REPORT naming the committed report of a
run on an H200 where every kernel matched the reference (``python -m pagedjax.gpu_check``):
then "auto" dispatch picks the Mosaic GPU kernels on Hopper (and the XLA reference for
inputs outside their contract); without one it picks the reference.
"""

# 2026-12-04, one H200: every parity row passed (Mosaic GPU 7/7, Triton 20/20, XLA
# reference 7/7), and the Mosaic backend ran a 7B-shaped engine end to end.
H200_PARITY_VERIFIED: bool = True
H200_PARITY_REPORT: str | None = "docs/gpu_check_2026-12-04.md"

# Draft-tree masks (tree_mask, issue 36) in the Mosaic GPU kernel: interpreted and
# cross-lowered only. Until a GPU check with its tree rows passing is committed, "auto"
# runs steps that carry a tree mask on the XLA reference (the causal kernel stays).
H200_TREE_PARITY_VERIFIED: bool = False

# The Triton kernels (pallas_kernels/triton) are never picked by "auto"; choosing them
# explicitly logs a warning unless the GPU model (jax's device_kind, e.g.
# "NVIDIA A100-SXM4-80GB") has a committed gpu_check report here, added by a person after
# reading that report.
TRITON_PARITY_REPORTS: dict[str, str] = {"NVIDIA H200": "docs/gpu_check_2026-12-04.md"}
