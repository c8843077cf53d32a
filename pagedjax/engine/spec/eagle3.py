"""EAGLE-3 in the engine: the EAGLE head's path with fused three-layer features.

``{"method": "eagle3", "model": DIR, "num_speculative_tokens": k}`` (vLLM 0.32's method
name) with DIR an EAGLE-3 head directory (``pagedjax/model/eagle3.py``: pagedjax's
layout or vLLM / EAGLE-3's checkpoint names; train one with ``python -m
pagedjax.tools.train_eagle3``). Everything but the features and the head is the EAGLE
head's machinery (``eagle.py``), reused by subclassing: the head's own one-layer KV
pool under the target's block ids (counted in the KV budget, copied on swaps, rolled
back with the blocks), the proposal program (draft 0 from the head output g kept per
slot, then k - 1 head steps feeding g back), and the verification program with the
catch-up over each row's committed positions. What differs:

* the target's forward in the speculative programs (``forward_with_aux``) also returns
  the residual stream entering three layers (``Eagle3Config.aux_layers``; vLLM's
  default (2, L // 2, L - 3)) for every token, concatenated [T, 3H]; the plain
  program is unchanged. The catch-up hands these to the head, whose ``fc`` fuses them
  (3H -> H); the proposal's later steps hand it its own g (H), no fc, as EAGLE-3;
* drafts come from the head's own norm and LM head (``head_logits``) over its draft
  vocabulary (ids mapped back through ``draft_vocab``, vLLM's d2t), not the target's.

Exactness does not depend on the head (verification is the target's): greedy outputs
equal no speculation; sampled drafts (``draft_sample_method="probabilistic"``) take the
shared rejection-sampling path (q over the draft vocabulary, scattered back to the V
ids). Refused by name: what ``eagle.py`` refuses (quantized KV cache or target
embedding / LM head, a non-Llama target), a pipeline-parallel target.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.engine.host_arrays import upload
from pagedjax.engine.spec.draft_pool import host_pool
from pagedjax.engine.spec.eagle import EagleDraft, EagleVerifier, check_eagle, embed_tokens
from pagedjax.model import ModelArch, ModelInput, build_module
from pagedjax.model.eagle3 import (
    TRAIN_HINT,
    Eagle3Config,
    Eagle3Head,
    is_vllm_layout,
    load_head,
    module_params,
    vllm_config,
)
from pagedjax.model.kv_cache import cache_bytes_per_token
from pagedjax.model.layers import LayerLoop, RMSNorm, dot_transposed, layer_view
from pagedjax.model.llama import LlamaForCausalLM


def forward_with_aux(
    params: Any, kv: Any, inp: ModelInput, *, arch: ModelArch,
    attention_fn: Callable[..., Any], layers: tuple[int, ...], native_matmul: bool = False,
) -> tuple[Any, jax.Array, jax.Array]:
    """The target's forward, plus its residual stream entering each of ``layers`` (ids
    in [0, num_layers], ascending; num_layers = after the last layer) for every token.

    Runs the model with its layer loop replaced (``nn.intercept_methods``) by the same
    loop whose carry also holds the captured states: each layer body is the model's own
    (its params as ``layer_view``s, so the CPU matmul reads them in place), and a
    ``where`` per layer keeps x [T, H] in the slots of the ids it matches (3 T H
    element selects per layer: noise beside the layer's matmuls). Logits only at
    ``inp.logits_indices``, as ``forward``. Returns (kv', fp32 logits, aux [T, n H]),
    aux's n slices in the order of ``layers``. NotImplementedError for a pipeline-
    parallel layer stack."""
    n = len(layers)
    kept: dict[str, jax.Array] = {}

    def run(loop: LayerLoop, carry: Any, inputs: Any, batch: ModelInput) -> Any:
        if loop.stack is not None:
            raise NotImplementedError("speculative method 'eagle3' with pipeline parallelism"
                                      " is not built")  # fmt: skip
        stacked = loop.variables["params"]
        pick = np.zeros((loop.num_layers + 1, n), bool)  # pick[j, s]: slot s takes id j
        pick[np.asarray(layers), np.arange(n)] = True
        pick = jnp.asarray(pick)
        x = carry[0]
        keep = lambda aux, j, x: jnp.where(pick[j][:, None, None], x[None], aux)
        aux = keep(jnp.zeros((n, *x.shape), x.dtype), 0, x)

        def body(i: jax.Array, c: Any) -> Any:
            *c, aux = c
            view = layer_view(stacked, i, loop.native)
            layer_in = jax.tree.map(lambda a: a[i], inputs)
            c, _ = loop.layer_cls(*loop.layer_args, parent=None).apply(
                {"params": view}, tuple(c), layer_in, batch
            )
            return (*c, keep(aux, i + 1, c[0]))

        *carry, aux = jax.lax.fori_loop(0, loop.num_layers, body, (*carry, aux))
        kept["aux"] = aux.transpose(1, 0, 2).reshape(x.shape[0], n * x.shape[1])
        return tuple(carry), None

    def grab(next_fun, args, kwargs, context):
        mod = context.module
        if (context.method_name == "__call__" and isinstance(mod, LayerLoop)
                and isinstance(mod.parent, LlamaForCausalLM)):  # fmt: skip
            return run(mod, *args, **kwargs)
        return next_fun(*args, **kwargs)

    module = build_module(arch, attention_fn=attention_fn, native_matmul=native_matmul)
    with nn.intercept_methods(grab):
        kv, logits = module.apply({"params": params}, kv, inp)
    return kv, logits, kept["aux"]


def head_config(head_dir: str, arch: ModelArch) -> Eagle3Config:
    """The head's config (either layout) from its config.json only; FileNotFoundError /
    ValueError naming the directory, as ``load_head``."""
    path = Path(head_dir).expanduser() / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"eagle3 head directory {str(path.parent)!r} lacks config.json"
                                f" ({TRAIN_HINT})")  # fmt: skip
    data = json.loads(path.read_text())
    if is_vllm_layout(data):
        return vllm_config(data, arch, str(path))
    return Eagle3Config.from_dict(data, where=str(path))


def head_kv_bytes_per_token(head_dir: str, arch: ModelArch, dtype: Any) -> int:
    """KV bytes per token of the head's one-layer pool in ``dtype``."""
    return cache_bytes_per_token(head_config(head_dir, arch).head_arch(arch), "auto", dtype)


class Eagle3Draft(EagleDraft):
    """The EAGLE-3 head, its KV pool and per-slot g (``EagleDraft`` with the head,
    its logits and its params replaced). params: {"head": fc + midlayer, "norm",
    "lm": [N, H] (the head's LM head, transposed for ``dot_transposed``), and "vocab"
    int32[N] with a draft vocabulary}."""

    def __init__(self, arch: ModelArch, head_dir: str, attention_fn: Callable[..., Any],
                 block_size: int, k: int):  # fmt: skip
        self.arch, self.block_size, self.k = arch, block_size, k
        self.cfg, head, self.draft_vocab = load_head(head_dir, arch)  # clear errors
        self.params: dict[str, Any] = {
            "head": module_params(head), "norm": head["norm"],
            "lm": jnp.asarray(head["lm_head"]["kernel"]).T,
        }  # fmt: skip
        if self.draft_vocab is not None:
            self.params["vocab"] = upload(self.draft_vocab)
        self.head_arch = self.cfg.head_arch(arch)
        self.module = Eagle3Head(self.head_arch, attention_fn=attention_fn)
        self.kv: Any = None  # allocated on first use (``ensure``): needs the pool's size
        self.host_kv: Any = None
        self.feature: Any = None  # [max_seqs, H]: g at each slot's last committed position
        self.trace_count: dict[int, int] = {}
        self.propose = self.jit_propose()

    def ensure(self, core: Any) -> None:
        """Allocate the head's pool (the target's block count and size) and per-slot g
        (``EagleDraft.ensure`` without its gather of the target's LM head rows: the
        head's LM head is its own)."""
        if self.kv is not None:
            return
        kv = core.device.kv
        check_eagle(self.arch, core.params, kv, method="eagle3")
        _, nb, _, b, _ = kv[0].shape
        a = self.head_arch
        shape = (1, nb, a.num_kv_heads, b, a.head_dim)
        self.kv = (jnp.zeros(shape, kv[0].dtype), jnp.zeros(shape, kv[1].dtype))
        self.host_kv = host_pool(self.kv, jax.tree.leaves(core.device.host_kv)[0].shape[1] - 1)
        self.feature = upload(np.zeros((core.max_seqs, a.hidden_size), np.float32))

    def head_step(self, params: Any, draft_kv: Any, feats: jax.Array, next_ids: jax.Array,
                  inp: ModelInput, target_params: Any) -> tuple[Any, jax.Array]:  # fmt: skip
        """One head forward over a ragged batch: feats the fused target features [T, 3H]
        (the catch-up) or fed-back g [T, H] (the proposal). (draft_kv', g [T, H])."""
        x = embed_tokens(target_params, self.arch, next_ids)
        return self.module.apply({"params": params["head"]}, draft_kv,
                                 feats.astype(jnp.float32), x, inp)  # fmt: skip

    def draft_logits(self, params: Any, target_params: Any,
                     g: jax.Array) -> tuple[jax.Array, jax.Array | None]:  # fmt: skip
        """(logits [S, N], vocab int32[N] or None): lm_head(norm(g)) over the head's
        draft vocabulary (vocab None: the full one, ids are positions)."""
        x = RMSNorm(self.arch.norm_eps).apply({"params": params["norm"]}, g)
        w = params["lm"]
        return dot_transposed(x.astype(w.dtype), w).astype(jnp.float32), params.get("vocab")


class Eagle3Verifier(EagleVerifier):
    """``EagleVerifier`` whose target forward returns the fused layers' states
    (``forward_with_aux``) for the catch-up instead of the post-norm feature."""

    def _forward(self, params: Any, kv: Any, inp: Any) -> tuple[Any, jax.Array, Any]:
        return forward_with_aux(params, kv, inp, arch=self.arch, attention_fn=self.attention_fn,
                                layers=self.draft.cfg.aux_layers,
                                native_matmul=self.native_matmul)  # fmt: skip


__all__ = ["Eagle3Draft", "Eagle3Verifier", "forward_with_aux", "head_config",
           "head_kv_bytes_per_token"]  # fmt: skip
