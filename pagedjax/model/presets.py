"""Named architectures (HF config values of the public checkpoints), so benchmarks at 7B/13B
shapes need no checkpoint on disk: pair with ``random_params`` (vLLM's load_format="dummy")."""

from __future__ import annotations

from pagedjax.model.config import ModelArch, arch_from_hf_config

_LLAMA2 = dict(model_type="llama", vocab_size=32000, rms_norm_eps=1e-5, bos_token_id=1,
               eos_token_id=2, max_position_embeddings=4096, rope_theta=10000.0)  # fmt: skip
_OPT = dict(model_type="opt", vocab_size=50272, max_position_embeddings=2048, bos_token_id=2,
            eos_token_id=2, do_layer_norm_before=True, activation_function="relu")  # fmt: skip


def _opt(hidden: int, layers: int, heads: int) -> dict:
    return dict(_OPT, hidden_size=hidden, word_embed_proj_dim=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, ffn_dim=4 * hidden)  # fmt: skip


PRESETS: dict[str, dict] = {
    "llama-2-7b": dict(_LLAMA2, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, intermediate_size=11008),
    "llama-13b": dict(_LLAMA2, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=40, intermediate_size=13824,
                      max_position_embeddings=2048, rms_norm_eps=1e-6),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=8192, bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         max_position_embeddings=131072, bos_token_id=128000,
                         eos_token_id=128001),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, rms_norm_eps=1e-5, rope_theta=10000.0,
                       sliding_window=4096, max_position_embeddings=32768, bos_token_id=1,
                       eos_token_id=2),
    "qwen2-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                     num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     intermediate_size=18944, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=32768, use_sliding_window=False,
                     tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643),
    # Llama-3-70B: the capacity table's large model (docs/parallelism.md).
    "llama-3-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        intermediate_size=28672, rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position_embeddings=8192, bos_token_id=128000,
                        eos_token_id=128001),
    "opt-125m": _opt(768, 12, 12),
    "opt-13b": _opt(5120, 40, 40),
    "opt-66b": _opt(9216, 64, 72),
    "opt-175b": _opt(12288, 96, 96),
    # Pythia (GPT-NeoX): rotary on 25 % of each head, parallel residual, untied embed_out.
    "pythia-6.9b": dict(model_type="gpt_neox", vocab_size=50432, hidden_size=4096,
                        num_hidden_layers=32, num_attention_heads=32, intermediate_size=16384,
                        rotary_pct=0.25, rotary_emb_base=10000, layer_norm_eps=1e-5,
                        use_parallel_residual=True, max_position_embeddings=2048,
                        tie_word_embeddings=False, hidden_act="gelu", bos_token_id=0,
                        eos_token_id=0),
    "pythia-12b": dict(model_type="gpt_neox", vocab_size=50688, hidden_size=5120,
                       num_hidden_layers=36, num_attention_heads=40, intermediate_size=20480,
                       rotary_pct=0.25, rotary_emb_base=10000, layer_norm_eps=1e-5,
                       use_parallel_residual=True, max_position_embeddings=2048,
                       tie_word_embeddings=False, hidden_act="gelu", bos_token_id=0,
                       eos_token_id=0),
    "gemma-2-9b": dict(model_type="gemma2", vocab_size=256000, hidden_size=3584,
                       num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, intermediate_size=14336, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=8192,
                       query_pre_attn_scalar=256, sliding_window=4096,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                       bos_token_id=2, eos_token_id=1),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, max_position_embeddings=40960,
                     use_sliding_window=False, tie_word_embeddings=False,
                     bos_token_id=151643, eos_token_id=151645),
    # Phi-3-mini-4k-instruct (the 128k variant's longrope is not implemented).
    "phi-3-mini": dict(model_type="phi3", vocab_size=32064, hidden_size=3072,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       intermediate_size=8192, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=4096, original_max_position_embeddings=4096,
                       sliding_window=2047, tie_word_embeddings=False, bos_token_id=1,
                       eos_token_id=32000),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                         rms_norm_eps=1e-5, rope_theta=1000000.0,
                         max_position_embeddings=32768, sliding_window=None,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # For tests and CPU smoke runs.
    "tiny-llama": dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                       rms_norm_eps=1e-6, max_position_embeddings=2048, bos_token_id=1,
                       eos_token_id=2),
    # Tensor-parallel tests: 8 query / 2 KV heads (TP 4 and 8 replicate KV heads), vocab
    # and MLP divisible by 8; and an OPT with 8 heads.
    "tiny-llama-tp": dict(model_type="llama", vocab_size=512, hidden_size=64,
                          num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                          intermediate_size=128, rms_norm_eps=1e-6, max_position_embeddings=2048,
                          bos_token_id=1, eos_token_id=2),
    "tiny-opt-tp": dict(_OPT, vocab_size=512, hidden_size=64, word_embed_proj_dim=64,
                        num_hidden_layers=2, num_attention_heads=8, ffn_dim=128,
                        max_position_embeddings=512),
    "tiny-mixtral": dict(model_type="mixtral", vocab_size=512, hidden_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                         rms_norm_eps=1e-5, max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=2),
}  # fmt: skip


def preset_arch(name: str) -> ModelArch:
    """ModelArch of a named preset, e.g. ``preset_arch("llama-2-7b")``."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return arch_from_hf_config(PRESETS[name])
