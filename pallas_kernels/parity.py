"""Whether a GPU parity run of the Pallas kernels against the XLA reference is committed.

Set H200_PARITY_VERIFIED to True only in the commit that adds the bench report of a run on
an H200 where every kernel matched the reference (``python -m pallas_kernels.bench``),
and name that report in H200_PARITY_REPORT. Until then "auto" dispatch picks the reference.
"""

H200_PARITY_VERIFIED: bool = False
H200_PARITY_REPORT: str | None = None  # e.g. "docs/kernel_bench_2026-12-01.md"

# The Triton kernels (pallas_kernels/triton) are never picked by "auto"; choosing them
# explicitly logs a warning unless the GPU model (jax's device_kind, e.g.
# "NVIDIA A100-SXM4-80GB") has a committed gpu_check report here, added by a person after
# reading that report.
TRITON_PARITY_REPORTS: dict[str, str] = {}
