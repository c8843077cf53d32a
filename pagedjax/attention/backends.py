"""Backend switch: the XLA reference, the native CPU kernel or the Pallas Mosaic GPU kernels.

Why here and not in ``pallas_kernels/``: choosing among pagedjax's implementations is
pagedjax's decision, and ``pallas_kernels`` is the leaf package that imports nothing from
``pagedjax`` (it only states its own facts, e.g. ``pallas_kernels.parity``). Imports run
one way: ``pagedjax.attention`` may call the kernels, never the reverse.

``select_attention_backend("auto")`` picks the Pallas kernels only on a Hopper GPU *and*
once an H200 parity run is committed (``pallas_kernels.parity``): untested kernels must
never be chosen silently (likewise a step carrying a draft-tree mask stays on the
reference until ``parity.H200_TREE_PARITY_VERIFIED``). On the CPU it picks the native kernel
(``pagedjax.attention.native_cpu``, tested against the reference) when it builds. The
reference is ``pagedjax.attention.reference``; a caller may pass its own.

Adding a backend is one more name in ``BACKEND_NAMES`` and one more branch below that
returns an ``AttentionBackend`` with the same calling convention (the stacked pool plus a
layer index, see docs/layer_loop.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import Any, Literal

import jax

from pagedjax.attention.kv_quant import QuantizedPages
from pallas_kernels import parity

BackendName = Literal["reference", "pallas", "native_cpu", "triton", "auto"]
BACKEND_NAMES: tuple[str, ...] = ("reference", "pallas", "native_cpu", "triton", "auto")
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """The chosen attention callable and why it was chosen."""

    name: Literal["reference", "pallas", "native_cpu", "triton"]
    ragged_paged_attention: Callable[..., jax.Array]
    reason: str


def is_hopper(device: Any | None = None) -> bool:
    """True for an NVIDIA GPU of compute capability 9.x (H100, H200)."""
    device = device if device is not None else jax.devices()[0]
    if device.platform != "gpu":
        return False
    return str(getattr(device, "compute_capability", "")).startswith("9")


def select_attention_backend(
    name: BackendName = "auto",
    *,
    reference: Callable[..., jax.Array] | None = None,
    device: Any | None = None,
) -> AttentionBackend:
    """Returns the attention backend for ``name`` ("reference", "pallas", "native_cpu",
    "triton" or "auto").

    ``reference``: the ragged reference callable to use instead of
    ``pagedjax.attention.reference``. "pallas" is returned even off-GPU (for interpret-mode
    runs); "auto" returns it only on Hopper with ``parity.H200_PARITY_VERIFIED``, and
    "native_cpu" on a CPU where that kernel builds. "native_cpu" itself runs the XLA
    reference for inputs it does not take (not fp32, not on the CPU, no compiler).
    "triton" (the Triton-language kernels through jax-triton, any CUDA GPU from sm_80) is
    only ever chosen explicitly: it needs a CUDA GPU and jax-triton, and logs a warning
    unless a parity run on that GPU model is committed (``parity.TRITON_PARITY_REPORTS``).
    Raises ValueError for any other name.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(
            "backend must be 'reference', 'pallas', 'native_cpu', 'triton' or 'auto',"
            f" got {name!r}"
        )
    device = device if device is not None else jax.devices()[0]
    if name == "triton":
        return _triton_backend(device)
    if name == "auto":
        if device.platform == "cpu" and reference is None:
            # Imported here: building the native kernel's wrapper is only needed on a CPU.
            from pagedjax.attention import native_cpu

            ok, why = native_cpu.available()
            name = "native_cpu" if ok else "reference"
            reason = f"auto: CPU, native kernel {why}" if ok else f"auto: CPU, {why}"
        elif not parity.H200_PARITY_VERIFIED:
            name, reason = "reference", "auto: no committed H200 parity run yet"
        elif not is_hopper(device):
            name, reason = "reference", "auto: not a Hopper GPU"
        else:
            name, reason = "pallas", f"auto: Hopper, parity in {parity.H200_PARITY_REPORT}"
    else:
        reason = "requested"
    if name == "native_cpu":
        from pagedjax.attention import native_cpu

        return AttentionBackend("native_cpu", native_cpu.ragged_paged_attention, reason)
    if name == "pallas":
        from pallas_kernels import paged_attention

        kernel = with_8bit_pages(paged_attention.ragged_paged_attention)
        if reason.startswith("auto"):  # chosen for the user: never an input it refuses
            kernel = _kernel_else_reference(
                kernel, paged_attention.unsupported, parity.H200_TREE_PARITY_VERIFIED
            )
        return AttentionBackend("pallas", kernel, reason)
    from pagedjax.attention import reference as xla_reference

    ragged = reference if reference is not None else xla_reference.ragged_paged_attention
    return AttentionBackend("reference", ragged, reason)


def _triton_backend(device: Any) -> AttentionBackend:
    # CUDA devices report a compute capability; the CPU and other backends do not.
    if device.platform != "gpu" or getattr(device, "compute_capability", None) is None:
        raise ValueError(
            f"attention_backend='triton' needs a CUDA GPU; this device is {device.platform}"
        )
    if importlib.util.find_spec("jax_triton") is None:
        raise ImportError(
            "attention_backend='triton' needs jax-triton: pip install 'pagedjax[triton]'"
        )
    from pallas_kernels.triton import jax_binding

    kind = getattr(device, "device_kind", "?")
    report = parity.TRITON_PARITY_REPORTS.get(kind)
    if report is None:
        reason = f"requested; no parity run of the Triton kernels on {kind} is committed"
        log.warning(
            "attention backend 'triton' on %s: no committed parity run for this GPU"
            " (python -m pagedjax.gpu_check; docs/kernels.md)", kind,
        )  # fmt: skip
    else:
        reason = f"requested; parity on {kind} in {report}"
    # 8-bit pools reach the kernel as the Pallas kernels' kv_format / k_scale / v_scale.
    ragged = with_8bit_pages(jax_binding.ragged_paged_attention)
    return AttentionBackend("triton", ragged, reason)


# kv_quant format name -> the kernels' kv_format (pallas_kernels.paged_attention.KV_FORMATS,
# pallas_kernels.triton.configs.KV_FORMATS: the same names)
PALLAS_KV_FORMATS = {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "int8_per_token_head": "int8"}


def _kernel_else_reference(
    kernel: Callable[..., jax.Array],
    unsupported: Callable[..., str | None],
    trees_verified: bool = True,
) -> Callable[..., jax.Array]:
    """``kernel`` where it takes the inputs, the XLA reference where ``unsupported`` (the
    kernel's own contract: q dtype, page dtype, 8-bit pages, head_dim, block_size, query
    heads per KV head) says it does not, or where a ``tree_mask`` is passed and the
    kernel's tree path is not ``trees_verified`` on a GPU. Decided at trace time from
    shapes, dtypes and whether a mask is passed, so each compiled program runs one of the
    two: "auto" on an H200 serves an fp32 model, or one with head_dim 96, instead of
    failing in the kernel's checks."""
    from pagedjax.attention import reference as xla_reference

    @functools.wraps(kernel)
    def attend(q: jax.Array, k_pages: Any, v_pages: Any, *args: Any, **kwargs: Any) -> jax.Array:
        eight_bit = isinstance(k_pages, QuantizedPages)
        pages = k_pages.values if eight_bit else k_pages
        _, num_q_heads, head_dim = q.shape
        num_kv_heads, block_size = pages.shape[-3], pages.shape[-2]
        why = unsupported(
            q.dtype, pages.dtype, eight_bit, head_dim, block_size, num_q_heads // num_kv_heads
        )
        if kwargs.get("tree_mask") is not None and not trees_verified:
            why = "tree masks not yet verified on a GPU"
        fn = xla_reference.ragged_paged_attention if why is not None else kernel
        return fn(q, k_pages, v_pages, *args, **kwargs)

    return attend


def with_8bit_pages(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """A kernel (Pallas or Triton) taking the pool as ``QuantizedPages`` too: the values,
    the scales and the format go to the kernel's ``kv_format`` / ``k_scale`` / ``v_scale``
    (the leaf package knows nothing of pagedjax's pytree)."""

    @functools.wraps(fn)
    def wrapped(q: jax.Array, k_pages: Any, v_pages: Any, *args: Any, **kwargs: Any) -> jax.Array:
        if not isinstance(k_pages, QuantizedPages):
            return fn(q, k_pages, v_pages, *args, **kwargs)
        return fn(
            q, k_pages.values, v_pages.values, *args,
            kv_format=PALLAS_KV_FORMATS[k_pages.fmt.name],
            k_scale=k_pages.scale_array(), v_scale=v_pages.scale_array(), **kwargs,
        )  # fmt: skip

    return wrapped


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "BackendName",
    "is_hopper",
    "select_attention_backend",
]
