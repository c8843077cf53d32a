"""Shared test helpers: tiny random HF checkpoints and a host-side paged runner.

``save_tiny_hf_model(family, dir)`` writes a small random transformers model with
save_pretrained (no network) and returns the torch model. ``PagedRunner`` drives
``pagedjax.model`` step by step over a NaN-filled paged cache with random page placement,
padding every step to fixed sizes so a test compiles once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from pagedjax.attention import PAD_SLOT
from pagedjax.model import ModelArch, ModelInput, allocate_kv_cache, make_forward

# fmt: off
_LLAMA = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
TINY_HF_CONFIGS: dict[str, tuple[str, dict]] = {
    # family: (HF config class name, kwargs)
    "llama": ("LlamaConfig", _LLAMA),
    "llama3": ("LlamaConfig", dict(_LLAMA, num_attention_heads=8, num_key_value_heads=2,
                                   tie_word_embeddings=True,
                                   rope_theta=500000.0,
                                   rope_scaling=dict(rope_type="llama3", factor=8.0,
                                                     low_freq_factor=1.0, high_freq_factor=4.0,
                                                     original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", dict(_LLAMA, num_key_value_heads=2, sliding_window=7,
                                      head_dim=24)),
    # Per-layer windows (layer_types): layer 0 full, layer 1 sliding over 6 tokens.
    "qwen2": ("Qwen2Config", dict(_LLAMA, num_key_value_heads=2, rope_theta=1000000.0,
                                  use_sliding_window=True, sliding_window=6,
                                  max_window_layers=1)),
    "opt": ("OPTConfig", dict(vocab_size=384, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=256,
                              word_embed_proj_dim=64, do_layer_norm_before=True,
                              bos_token_id=2, eos_token_id=2, pad_token_id=1)),
    # OPT-350m style: post-LayerNorm, no final norm, project_in/out, untied head.
    "opt_post_ln": ("OPTConfig", dict(vocab_size=384, hidden_size=64, ffn_dim=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=256, word_embed_proj_dim=32,
                                      do_layer_norm_before=False, tie_word_embeddings=False,
                                      bos_token_id=2, eos_token_id=2, pad_token_id=1)),
    # GPT-NeoX: 3 heads (odd), partial rotary (4 of 16 dims), parallel residual, fused QKV.
    "gpt_neox": ("GPTNeoXConfig", dict(vocab_size=384, hidden_size=48, intermediate_size=96,
                                       num_hidden_layers=2, num_attention_heads=3,
                                       rotary_pct=0.25, max_position_embeddings=256,
                                       use_parallel_residual=True, layer_norm_eps=1e-5,
                                       bos_token_id=0, eos_token_id=2)),
    # Gemma 2: MQA with 3 query heads, query_pre_attn_scalar != head_dim, layer 0 sliding over 6,
    # soft caps small enough that tanh bends (HF's 50 / 30 barely would at this scale).
    "gemma2": ("Gemma2Config", dict(_LLAMA, hidden_size=48, num_attention_heads=3,
                                    num_key_value_heads=1,
                                    head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                    hidden_activation="gelu_pytorch_tanh",
                                    tie_word_embeddings=True, pad_token_id=0)),
    # Qwen3: GQA 6 query / 3 KV heads, q/k norms.
    "qwen3": ("Qwen3Config", dict(_LLAMA, num_attention_heads=6, num_key_value_heads=3,
                                  head_dim=16, rope_theta=1000000.0)),
    # Phi-3 (4k): fused qkv_proj / gate_up_proj, GQA 6 / 2, sliding window 9 on all layers.
    "phi3": ("Phi3Config", dict(_LLAMA, hidden_size=48, num_attention_heads=6,
                                num_key_value_heads=2, sliding_window=9,
                                original_max_position_embeddings=256, pad_token_id=0)),
    # Mixtral: 4 experts, top-2, GQA 4 / 2.
    "mixtral": ("MixtralConfig", dict(_LLAMA, num_key_value_heads=2, intermediate_size=96,
                                      num_local_experts=4, num_experts_per_tok=2,
                                      rope_theta=1000000.0)),
}
# fmt: on
NEW_FAMILIES = ("gpt_neox", "gemma2", "qwen3", "phi3", "mixtral")


def make_tiny_hf_model(family: str, seed: int = 0, **overrides):
    """A random transformers *ForCausalLM (fp32, eval mode), initializer_range 0.15."""
    import torch
    import transformers

    cls_name, kwargs = TINY_HF_CONFIGS[family]
    kwargs = dict(kwargs, initializer_range=0.15, init_std=0.15, **overrides)
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if family.startswith("opt"):
        # OPT's init ignores init_std for some tensors; make biases/LN non-trivial too.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.15) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    elif family == "qwen2":
        with torch.no_grad():  # nonzero qkv biases, so the bias path is actually tested
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.15)
    elif family in NEW_FAMILIES:
        # Norm gains and biases init to constants (Gemma's (1 + w) gains to w = 0): make
        # them random, so a swapped or ignored gain/bias shows in the logits.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim > 1:
                    continue
                if name.endswith("bias") or family == "gemma2":
                    p.normal_(0.0, 0.15)
                else:
                    p.uniform_(0.5, 1.5)
    return model.eval()


def save_tiny_hf_model(family: str, directory: str | Path, seed: int = 0, **save_kwargs):
    """make_tiny_hf_model + save_pretrained(directory) (safetensors); returns the model."""
    model = make_tiny_hf_model(family, seed)
    model.save_pretrained(str(directory), **save_kwargs)
    return model


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    """float64 logits [len(tokens), vocab] of one unpadded sequence."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False)
    return out.logits[0].double().numpy()


@dataclass
class _Seq:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens already in the cache


class PagedRunner:
    """Host-side driver of the model over a NaN-filled paged cache.

    Pages are handed out in a random permutation (never page 0, the null block), so a
    sequence's pages are scattered; every page not owned and every slot past a sequence's
    length holds NaN. Each step is padded to (max_tokens, max_seqs, max_blocks).
    """

    def __init__(self, arch: ModelArch, params, *, block_size: int, max_tokens: int,
                 max_seqs: int, max_len: int, seed: int = 0, dtype=jnp.float32,
                 attention_fn=None):  # fmt: skip
        self.arch, self.params, self.block_size = arch, params, block_size
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.max_blocks = -(-max_len // block_size)
        num_blocks = max_seqs * self.max_blocks + 1
        self.kv = allocate_kv_cache(arch, num_blocks, block_size, dtype, fill_value=np.nan)
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
        self.seqs: dict[int, _Seq] = {}
        self.forward = (
            make_forward(arch)
            if attention_fn is None
            else make_forward(arch, attention_fn=attention_fn)
        )

    def step(self, work: list[tuple[int, list[int]]], all_logits: bool = False):
        """Runs one ragged step: work = [(seq_id, new tokens), ...] (any mix of prompt chunks
        and single decode tokens). Returns {seq_id: logits [n, vocab]} (n = len(new tokens)
        if all_logits, else 1: the last token)."""
        if len(work) > self.max_seqs or sum(len(t) for _, t in work) > self.max_tokens:
            raise ValueError("step exceeds the runner's padded sizes")
        tokens, positions, slots, logits_idx, owners = [], [], [], [], []
        bt = np.zeros((self.max_seqs, self.max_blocks), np.int32)
        kv_lens = np.zeros(self.max_seqs, np.int32)
        cu = [0]
        for s, (sid, new) in enumerate(work):
            seq = self.seqs.setdefault(sid, _Seq())
            for i, tok in enumerate(new):
                pos = seq.length + i
                if pos // self.block_size >= len(seq.blocks):
                    seq.blocks.append(int(self.free.pop()))
                tokens.append(tok)
                positions.append(pos)
                slots.append(seq.blocks[pos // self.block_size] * self.block_size
                             + pos % self.block_size)  # fmt: skip
                if all_logits or i == len(new) - 1:
                    logits_idx.append(len(tokens) - 1)
                    owners.append(sid)
            seq.length += len(new)
            bt[s, : len(seq.blocks)] = seq.blocks
            kv_lens[s] = seq.length
            cu.append(len(tokens))
        n = len(tokens)
        pad_t = self.max_tokens - n
        cu += [n] * (self.max_seqs - len(work))
        pad_l = self.max_tokens - len(logits_idx)
        batch = ModelInput(
            tokens=jnp.asarray(tokens + [0] * pad_t, jnp.int32),
            positions=jnp.asarray(positions + [0] * pad_t, jnp.int32),
            slot_mapping=jnp.asarray(slots + [PAD_SLOT] * pad_t, jnp.int32),
            block_tables=jnp.asarray(bt),
            kv_lens=jnp.asarray(kv_lens),
            cu_q_lens=jnp.asarray(cu, jnp.int32),
            logits_indices=jnp.asarray(logits_idx + [0] * pad_l, jnp.int32),
        )
        self.kv, logits = self.forward(self.params, self.kv, batch)
        logits = np.asarray(logits)[: len(logits_idx)]
        out: dict[int, list] = {}
        for row, sid in zip(logits, owners, strict=True):
            out.setdefault(sid, []).append(row)
        return {sid: np.stack(rows) for sid, rows in out.items()}


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tiny_tokenizer(directory: str | Path, chat_template: str | None = TINY_CHAT_TEMPLATE):
    """A byte-level Hugging Face tokenizer (no merges: one token per UTF-8 byte, ids 3..258;
    <unk> 0, <s> 1 (prepended), </s> 2: the tiny llama config's bos/eos) with a chat
    template, saved with save_pretrained beside a tiny model. No network needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=chat_template,
    )
    fast.save_pretrained(str(directory))
    return fast


def peft_adapter(base, directory, seed, r, targets):
    """A random PEFT LoRA on a copy of ``base`` (B non-zero), saved to ``directory``."""
    import copy

    import peft
    import torch

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r + 1, target_modules=targets,
                          init_lora_weights=False, lora_dropout=0.0)  # fmt: skip
    model = peft.get_peft_model(copy.deepcopy(base), cfg).eval()
    model.save_pretrained(str(directory))
    return model


def paged_embeds_logits(arch, params, ids, embeds, block_size: int, rope=None) -> np.ndarray:
    """The paged forward of one prompt given as inputs_embeds float32[T, H] (its pages
    scattered at random over a NaN-filled cache, 4 padding rows after it) -> logits at
    every prompt position. ``rope`` int32[3, T]: M-RoPE positions (Qwen2-VL); None: RoPE by
    position. The image families' parity tests check merged embeddings through it."""
    import functools

    import jax

    from pagedjax.model.forward import forward

    rng = np.random.default_rng(3)
    t = len(ids)
    nblocks = -(-t // block_size)
    pages = rng.permutation(np.arange(1, nblocks + 3))[:nblocks]
    kv = allocate_kv_cache(arch, nblocks + 3, block_size, jnp.float32, fill_value=np.nan)
    pad, pos = 4, np.arange(t)
    slots = pages[pos // block_size] * block_size + pos % block_size
    batch = ModelInput(
        tokens=jnp.asarray(list(ids) + [0] * pad, jnp.int32),
        positions=jnp.asarray(list(pos) + [0] * pad, jnp.int32),
        slot_mapping=jnp.asarray(list(slots) + [PAD_SLOT] * pad, jnp.int32),
        block_tables=jnp.asarray(pages[None], jnp.int32),
        kv_lens=jnp.asarray([t], jnp.int32),
        cu_q_lens=jnp.asarray([0, t], jnp.int32),
        logits_indices=jnp.arange(t, dtype=jnp.int32),
        rope_positions=None if rope is None
        else jnp.asarray(np.pad(rope, ((0, 0), (0, pad))), jnp.int32),
    )  # fmt: skip
    embeds = jnp.concatenate([embeds, jnp.zeros((pad, embeds.shape[1]), embeds.dtype)])
    step = jax.jit(functools.partial(forward, arch=arch))
    return np.asarray(step(params, kv, batch, inputs_embeds=embeds)[1])
