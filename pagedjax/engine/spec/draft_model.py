"""A separate draft checkpoint with its own paged KV pool under the target's block tables.

``{"method": "draft_model", "model": DIR_OR_NAME, "num_speculative_tokens": k}`` (no
``draft_num_layers``: that key selects the layer-skip draft, ``spec_draft.py``). DIR_OR_NAME
is anything ``LLM(model=...)`` loads: a Hugging Face directory, a ``.gguf`` file, a catalog
name or a preset (random weights), of any family pagedjax runs. It must share the target's
vocabulary: the same ``vocab_size`` and, when both sides have a real tokenizer, the same
token ids for a probe text and the same EOS id (``check_same_vocab``); anything else is
refused at load time, naming both sides.

**Its KV: a second pool indexed by the target's block ids.** ``SeparateDraft.kv`` is
(k, v), each ``[draft layers, num_blocks, draft KV heads, block_size, draft head_dim]``:
its own layers, heads and head size, but the target pool's block count and block size.
Block b of the draft pool belongs to whichever sequence owns block b of the target pool,
so the target's block tables and slot mapping index it directly. No second allocator,
scheduler or block table: growth, rollback (blocks past the accepted length go back to
the one free list and take their draft rows with them), copy-on-write (the step's
``last_cow`` is applied to this pool too), fork sharing for n > 1 and prefix-cache sharing
all follow from the shared ids. Cost: every block costs
``target bytes/token + draft bytes/token`` times the block size, so the engine counts the
draft in the KV budget (``kv_bytes_per_token`` of ``num_kv_blocks`` and the swap pool's
bytes per block, llm_engine.py): the same memory gives fewer blocks (SmolLM2-135M as its
own draft: half as many) and the engine never allocates more than the budget. It is
logged at start-up.

**The draft runs on every step** (the speculative path is taken even when no row has
proposals), over exactly the ragged batch the target runs (prefill chunks, decode rows,
recomputation after preemption), writing its pool at the same slots. So the draft pool
holds, for every block, the draft's KV of the very tokens the target's block holds, and:

- a prefix-cache hit is correct for the draft too: a block is only ever registered after
  the step that filled it, and that step wrote both pools (blocks registered from
  accepted tokens only, as for the target); a cached block's draft rows are a function of
  its token prefix, exactly like its target rows;
- its forward over the batch gives, at each decode row's last token, draft 0; then
  k more batched one-token steps (``spec_draft.greedy_draft_steps`` with ``kv_tail = 1``)
  give drafts 1..k-1 and write the draft's KV of every draft token, the last one
  included, so whatever prefix the verification accepts, the draft pool already holds it
  (one draft step more than proposals need: k + 1 draft forwards per speculative step,
  the first over the whole batch);
- rejected drafts' rows need no rollback: a block wholly past the accepted length is
  freed with the target's, and the rows of a kept block past it are overwritten by the
  next step's forward over the bonus token and the next drafts, before anything reads
  them (attention reads positions < kv_len only).

Swap preemption moves this pool's blocks too (``apply_swaps``, its own host pool with
the target's host block ids, copied with the target's plan before any draft write). Drafts
are greedy (point masses), so the verification's acceptance rule is exact for sampled
requests as well (spec_verify.py); with ``draft_sample_method="probabilistic"`` they are
samples of the draft's q and the verification applies rejection sampling
(``draft_sampling.py``). Refused: a quantized KV cache (int8 / fp8: the draft
pool would need its own scales), a draft with a shorter context than max_model_len.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config import ModelConfig, SpeculativeConfig
from pagedjax.engine.host_arrays import upload
from pagedjax.engine.loading import load_model
from pagedjax.engine.model_runner import apply_cow, build_model_input
from pagedjax.engine.spec.draft_pool import host_pool, mirror_swaps
from pagedjax.engine.spec.draft_sampling import draft_drawer, store
from pagedjax.engine.spec.eagle import head_kv_bytes_per_token
from pagedjax.engine.spec.eagle3 import head_kv_bytes_per_token as head3_kv_bytes_per_token
from pagedjax.engine.spec.layer_skip import greedy_draft_steps
from pagedjax.model import PRESETS, ModelArch, allocate_kv_cache, forward
from pagedjax.model.catalog import CATALOG
from pagedjax.model.kv_cache import cache_bytes_per_token
from pagedjax.tokenizer import HFTokenizer, Tokenizer

log = logging.getLogger(__name__)

# Probe for the tokenizer check: words, digits, punctuation, whitespace, non-ASCII.
PROBE_TEXT = "The quick brown fox, 1234 times: jumped!\n\tΑλφα 数字 émigré <|x|> def f(): pass"
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def is_separate_draft(config: SpeculativeConfig | None) -> bool:
    """A ``draft_model`` config naming another checkpoint (no ``draft_num_layers``)."""
    return (config is not None and config.method == "draft_model"
            and config.draft_num_layers is None)  # fmt: skip


def check_draft_source(model: str) -> None:
    """FileNotFoundError before any loading when ``model`` is nothing load_model loads."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.suffix == ".gguf" and path.is_file()):
        return
    if model in PRESETS or model in CATALOG:
        return
    raise FileNotFoundError(
        f"speculative_config model {model!r}: no draft checkpoint there (a model directory,"
        f" a .gguf file, a catalog name {sorted(CATALOG)} or a preset name)"
    )


def check_same_vocab(target: tuple[str, ModelArch, Tokenizer],
                     draft: tuple[str, ModelArch, Tokenizer]) -> None:  # fmt: skip
    """ValueError naming both models unless the draft's token ids mean the target's:
    equal vocab sizes, and with two real (HF) tokenizers the same ids for PROBE_TEXT and
    the same EOS id. A byte-level fallback tokenizer (no tokenizer files) is not compared."""
    (tname, tarch, ttok), (dname, darch, dtok) = target, draft
    if tarch.vocab_size != darch.vocab_size:
        raise ValueError(
            f"speculative draft {dname!r} has vocab_size {darch.vocab_size}, the target"
            f" {tname!r} has {tarch.vocab_size}: a draft must share the target's vocabulary"
        )
    if isinstance(ttok, HFTokenizer) and isinstance(dtok, HFTokenizer):
        a = ttok.encode(PROBE_TEXT, add_special_tokens=False)
        b = dtok.encode(PROBE_TEXT, add_special_tokens=False)
        if a != b or ttok.eos_token_id != dtok.eos_token_id:
            raise ValueError(
                f"speculative draft {dname!r} and target {tname!r} have the same vocab_size"
                f" ({tarch.vocab_size}) but different tokenizers (probe ids {b[:8]}... vs"
                f" {a[:8]}..., eos {dtok.eos_token_id} vs {ttok.eos_token_id})"
            )


@dataclass
class DraftCheckpoint:
    """A loaded, checked draft: its arch, params (the target's compute dtype), the KV
    dtype (the target pool's) and its KV bytes per token (all its layers, K and V)."""

    model: str
    arch: ModelArch
    params: Any
    kv_dtype: Any
    bytes_per_token: int


def load_draft(config: SpeculativeConfig | None, target_model: str, target_arch: ModelArch,
               target_tokenizer: Tokenizer, kv_spec: Any, max_model_len: int,
               seed: int = 0) -> tuple[DraftCheckpoint | None, int]:  # fmt: skip
    """(the separate draft of ``config`` or None for every other config, the KV bytes per
    token of the target's and the draft's pools together: an eagle head's one-layer pool
    counts too, spec_eagle.py). The draft is loaded and checked against the target
    (vocabulary, context length, KV format) before the KV budget is sized, so the budget
    can count its pool."""
    if config is not None and config.method in ("eagle", "eagle3") and not kv_spec.quantized:
        eagle3 = config.method == "eagle3"
        per_token = head3_kv_bytes_per_token if eagle3 else head_kv_bytes_per_token
        head = per_token(str(config.model), target_arch, kv_spec.dtype)
        log.info("speculative %s head: its KV pool adds %d bytes per token to the target's"
                 " %d", config.method, head, kv_spec.bytes_per_token)  # fmt: skip
        return None, kv_spec.bytes_per_token + head
    if not is_separate_draft(config):
        return None, kv_spec.bytes_per_token
    if kv_spec.quantized:
        raise NotImplementedError(
            f"speculative draft_model {config.model!r} with a quantized KV cache"
            f" (cache_dtype {kv_spec.cache_dtype!r}) is not built"
        )
    dtype = _DTYPE_NAMES.get(jnp.dtype(kv_spec.model_dtype).name, "auto")
    arch, params, tok, _ = load_model(ModelConfig(model=config.model, dtype=dtype, seed=seed))
    check_same_vocab((target_model, target_arch, target_tokenizer), (config.model, arch, tok))
    if arch.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative draft {config.model!r}: max_position_embeddings"
            f" {arch.max_position_embeddings} < the engine's max_model_len {max_model_len}"
        )
    per_token = cache_bytes_per_token(arch, "auto", kv_spec.dtype)
    log.info("speculative draft %s: %d layers, %d KV heads x %d; its KV pool adds %d bytes"
             " per token to the target's %d (%.2fx the blocks' memory)", config.model,
             arch.num_layers, arch.num_kv_heads, arch.head_dim, per_token,
             kv_spec.bytes_per_token, 1 + per_token / kv_spec.bytes_per_token)  # fmt: skip
    ckpt = DraftCheckpoint(config.model, arch, params, kv_spec.dtype, per_token)
    return ckpt, kv_spec.bytes_per_token + per_token


class SeparateDraft:
    """The draft's params, pool, host swap pool and proposal program (module docstring).

    propose(params, kv, tokens, mem, batch, counts, *, num_tokens, num_seqs) ->
    (kv', tokens'): kv and tokens donated; batch is the scheduled batch (the target's
    q_lens, before the speculative extension), counts int32[N] drafts per batch row;
    one program per (T, S) bucket, whatever the counts (the draft loop's trip count is
    traced: a step without proposals runs the batch forward only).
    """

    def __init__(self, ckpt: DraftCheckpoint, attention_fn: Callable[..., Any],
                 block_size: int, num_blocks: int, num_host_blocks: int,
                 native_matmul: bool = False):  # fmt: skip
        self.ckpt, self.arch, self.params = ckpt, ckpt.arch, ckpt.params
        self.native_matmul = native_matmul  # as the target's step (ModelRunner)
        self.block_size = block_size
        self.attention_fn = attention_fn
        self.kv = allocate_kv_cache(ckpt.arch, num_blocks, block_size, ckpt.kv_dtype)
        # the target's host block ids; 0 rows when preemption is recompute-only
        self.host_kv = host_pool(self.kv, num_host_blocks)
        pool = sum(p.nbytes for p in jax.tree.leaves(self.kv))
        log.info("speculative draft %s: KV pool %d blocks x %d tokens, %.1f MiB (counted in"
                 " the KV budget), host swap pool %d blocks", ckpt.model, num_blocks,
                 block_size, pool / 2**20, num_host_blocks)  # fmt: skip
        self.trace_count: dict[tuple[int, int], int] = {}
        self.propose = jax.jit(self._propose,
                               static_argnames=("num_tokens", "num_seqs", "num_drafts"),
                               donate_argnames=("kv", "tokens"))  # fmt: skip

    def _apply(self, params: Any, kv: Any, inp: Any) -> tuple[Any, jax.Array]:
        return forward(params, kv, inp, arch=self.arch, attention_fn=self.attention_fn,
                       native_matmul=self.native_matmul)  # fmt: skip

    def _propose(self, params: Any, kv: Any, tokens: jax.Array, mem: Any, batch: Any,
                 counts: jax.Array, sampling: Any = None, output_len: Any = None,
                 num_drafts: int = 0, *, num_tokens: int, num_seqs: int) -> tuple:  # fmt: skip
        key = (num_tokens, num_seqs)
        self.trace_count[key] = self.trace_count.get(key, 0) + 1  # at trace time only
        tables = mem.tables.tables
        kv = apply_cow(kv, mem.last_cow.src, mem.last_cow.dst, mem.last_cow.valid)
        # 1. The scheduled batch, as the target runs it: the draft's KV of every token
        #    the target processes this step, and logits at each row's last token.
        inp = build_model_input(tokens, tables, batch, num_tokens, num_seqs, self.block_size)
        kv, logits = self._apply(params, kv, inp)
        sid = batch.seq_ids[:num_seqs]
        row_ok = sid >= 0
        safe = jnp.maximum(sid, 0)
        total = batch.start_pos + batch.q_lens  # [N] position of the first draft
        cnt = jnp.where(row_ok, counts[:num_seqs], 0)
        draw = q = None
        if sampling is None:
            d0 = jnp.argmax(logits[:num_seqs], axis=-1).astype(jnp.int32)
        else:  # sampled drafts (draft_sampling.py): q of each, float32[S, K, V]
            v = self.arch.vocab_size
            draw = draft_drawer(sampling, output_len, sid, v)
            d0, p0 = draw(jnp.int32(0), logits[:num_seqs])
            q = store(jnp.zeros((num_seqs, num_drafts, v), jnp.float32), 0, p0, cnt > 0)
        n = tokens.shape[0]
        tokens = tokens.at[jnp.where(row_ok & (cnt > 0), safe, n), total[:num_seqs]].set(
            d0, mode="drop"
        )
        # 2. Drafts 1..k-1, and the KV of every draft (kv_tail = 1: step k writes the
        #    last draft's KV only). Zero trips when no row speculates.
        apply = lambda kv, inp: self._apply(params, kv, inp)
        upper = jnp.max(cnt) + 1
        return greedy_draft_steps(apply, kv, tokens, tables, batch.seq_ids, total, counts,
                                  1, jnp.where(upper > 1, upper, 1), kv_tail=1,
                                  num_seqs=num_seqs, block_size=self.block_size,
                                  draw=draw, q=q)  # fmt: skip

    def run(self, core: Any, batch: Any, counts: np.ndarray, num_tokens: int,
            num_seqs: int, mem: Any = None, num_drafts: int = 0) -> Any:  # fmt: skip
        """The draft's step over ``batch`` (bucket (num_tokens, num_seqs)) on the core's
        token buffer and paged state (``mem``, default the current one); drafts go into
        the token buffer. num_drafts = K > 0: sampled drafts (draft_sampling.py), returns
        their q float32[num_seqs, K, V]; else None."""
        dev = core.device
        mem = dev.state.mem if mem is None else mem
        extra = (dev.sampling(), dev.state.output_len) if num_drafts else ()
        kw = dict(num_drafts=num_drafts) if num_drafts else {}

        def propose(tokens: Any) -> tuple[Any, Any]:
            kv, tokens, *q = self.propose(
                self.params, self.kv, tokens, mem, batch._replace(swap=None),
                upload(np.asarray(counts, np.int32)), *extra, num_tokens=num_tokens,
                num_seqs=num_seqs, **kw,
            )  # fmt: skip
            return tokens, (kv, q[0] if q else None)

        self.kv, q = dev.with_tokens(propose)
        return q

    def apply_swaps(self, plan: Any, host: dict) -> None:
        """Mirror the step's swap copies (``swap_copies.apply_swap_copies``) on the draft pool:
        device -> host blocks of groups swapped out, then host -> device of groups
        swapped in, with the target's plan (same block ids on both sides). Called before
        the draft writes anything in the step, so freed device blocks still hold the
        swapped-out group's rows."""
        self.kv = mirror_swaps(self.kv, self.host_kv, plan, host)  # draft_pool.py


__all__ = [
    "DraftCheckpoint", "SeparateDraft", "check_draft_source", "check_same_vocab",
    "is_separate_draft", "load_draft",
]  # fmt: skip
