"""Each family's Hugging Face checkpoint keys -> the canonical keys our parameters are named
after (the HF module path relative to the decoder stack, Llama-style where the roles match).

``canonical_tensors`` strips the family's prefix ("model.", "gpt_neox.", ...) and rewrites
the tensors our modules keep in another shape:

- Phi-3: fused ``qkv_proj`` -> q/k/v_proj (row blocks [q | k | v]); fused ``gate_up_proj``
  -> gate_proj / up_proj (first / second half of the rows).
- GPT-NeoX: fused ``query_key_value`` -> q/k/v_proj (rows interleaved per head:
  [q_0 k_0 v_0 q_1 k_1 v_1 ...], each head_dim long); ``attention.dense`` -> ``o_proj``.
- Mixtral: per-expert ``experts.{j}.w1/w2/w3.weight`` ([out, in] each) -> one stacked
  ``block_sparse_moe.w1/w2/w3`` per layer in our layout ([E, in, out]).

Why split rather than keep fused: every family then has one parameter per role (q, k, v,
gate, up), so the attention and MLP code, the loader's shape checks, random init and a
future quantized linear treat them alike. The cost is two or three matmuls where one would
do; they read the same weight bytes, which is what a decode step pays for.

Each entry is (source name, array); the source name (with the part taken, e.g. ``[q]``)
is what error messages quote.
"""

from __future__ import annotations

import re

import numpy as np

from pagedjax.model.config import ModelArch

Named = dict[str, tuple[str, np.ndarray]]  # canonical key -> (source name, array)

_PREFIXES = {"llama": ("model.",), "opt": ("model.", "decoder."), "gpt_neox": ("gpt_neox.",)}
# Tensors a checkpoint may carry that the model recomputes or shares (canonical keys).
_BUFFERS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|(^|\.)embed_positions\._float_tensor$")
_IGNORED = {
    "llama": _BUFFERS,
    "opt": _BUFFERS,
    # Old GPT-NeoX checkpoints store the causal mask and its fill value as buffers.
    "gpt_neox": re.compile(r"(^|\.)rotary_emb\.inv_freq$|\.attention\.(masked_)?bias$"),
}


def ignored(arch: ModelArch, key: str) -> bool:
    """Whether a canonical key names a buffer the model does not load."""
    return bool(_IGNORED[arch.family].search(key))


def _strip(name: str, family: str) -> str:
    for prefix in _PREFIXES[family]:
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def _split_rows(
    named: Named, key: str, parts: dict[str, slice | np.ndarray], rows: int
) -> None:
    """Replaces named[key] ([rows, ...]) by named[new] = rows selected by parts[new]."""
    source, x = named.pop(key)
    if x.shape[0] != rows:
        raise ValueError(
            f"shape mismatch for tensor {source!r}: checkpoint has {tuple(x.shape)}, config "
            f"implies {rows} rows"
        )
    for new, sel in parts.items():
        named[new] = (f"{source}[{new.rsplit('.', 2)[-2]}]", np.asarray(x[sel]))


def _phi3(arch: ModelArch, named: Named) -> None:
    h, hkv, d, inter = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size
    for key in [k for k in named if k.endswith("self_attn.qkv_proj.weight")]:
        base = key[: -len("qkv_proj.weight")]
        q, kv = h * d, hkv * d
        parts = {f"{base}q_proj.weight": slice(0, q), f"{base}k_proj.weight": slice(q, q + kv),
                 f"{base}v_proj.weight": slice(q + kv, q + 2 * kv)}  # fmt: skip
        _split_rows(named, key, parts, q + 2 * kv)
    for key in [k for k in named if k.endswith("mlp.gate_up_proj.weight")]:
        base = key[: -len("gate_up_proj.weight")]
        parts = {f"{base}gate_proj.weight": slice(0, inter),
                 f"{base}up_proj.weight": slice(inter, 2 * inter)}  # fmt: skip
        _split_rows(named, key, parts, 2 * inter)


def _gpt_neox(arch: ModelArch, named: Named) -> None:
    h, d = arch.num_heads, arch.head_dim
    # Row r of the fused projection is head r // (3d), part (r // d) % 3, dim r % d.
    rows = np.arange(3 * h * d).reshape(h, 3, d)
    for key in [k for k in named if ".attention.query_key_value." in k]:
        base, leaf = key.split(".query_key_value.")
        parts = {f"{base}.{p}_proj.{leaf}": rows[:, i].reshape(-1) for i, p in enumerate("qkv")}
        _split_rows(named, key, parts, 3 * h * d)
    for key in [k for k in named if ".attention.dense." in k]:
        named[key.replace(".attention.dense.", ".attention.o_proj.")] = named.pop(key)


_EXPERT = re.compile(r"^(layers\.\d+\.block_sparse_moe)\.experts\.(\d+)\.(w[123])\.weight$")


def _mixtral(arch: ModelArch, named: Named) -> None:
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for key in named:
        m = _EXPERT.match(key)
        if m:
            groups.setdefault((m[1], m[3]), {})[int(m[2])] = key
    for (base, w), by_expert in groups.items():
        experts = sorted(by_expert)
        if experts != list(range(arch.num_experts)):
            raise ValueError(
                f"{base}: checkpoint has experts {experts} for {w}, config says "
                f"num_local_experts={arch.num_experts}"
            )
        mats = [named.pop(by_expert[j]) for j in experts]
        source = mats[0][0].replace(".experts.0.", ".experts.*.")
        named[f"{base}.{w}"] = (source, np.stack([x.T for _, x in mats]))  # [E, in, out]


_REWRITES = {"phi3": _phi3, "gpt_neox": _gpt_neox, "mixtral": _mixtral}


def canonical_tensors(arch: ModelArch, tensors: dict[str, np.ndarray]) -> Named:
    """HF tensor dict -> {canonical key: (source name, array)} for arch's family."""
    named = {_strip(k, arch.family): (k, v) for k, v in tensors.items()}
    rewrite = _REWRITES.get(arch.model_type)
    if rewrite is not None:
        rewrite(arch, named)
    return named
