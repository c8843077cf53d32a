"""CLIP vision tower, LLaVA projector and image-embedding merge vs transformers'
LlavaForConditionalGeneration (tiny random model, fp32)."""

from __future__ import annotations

import functools
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.model.safetensors_io import load_tensors
from pagedjax.model.vision.clip import clip_hidden_states, select_features
from pagedjax.model.vision.llava import (
    LlavaArch,
    expand_image_tokens,
    image_features,
    load_llava_vision,
    merge_image_embeddings,
    project,
)
from pagedjax.model.vision.preprocess import load_image, preprocess_images

IMAGE_TOKEN = 60
VOCAB = 64


def _make(tmp_path, strategy: str, layer):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    torch.manual_seed(0)
    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2, hidden_act="quick_gelu")
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                      vision_feature_layer=layer, vision_feature_select_strategy=strategy)
    model = LlavaForConditionalGeneration(cfg).eval()
    # Random (not init-zero) biases and norms, so a dropped bias or swapped gain fails.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        tensors.update(load_tensors(f))
    return model, LlavaArch.from_hf(config), tensors


# All in the second tier: building a transformers LLaVA is most of this module's time,
# and the default tier checks the same tower end to end instead (greedy tokens of
# tests/test_multimodal_engine.py equal LlavaForConditionalGeneration.generate's).
@pytest.fixture(scope="module", params=[
    pytest.param(("default", -2), marks=pytest.mark.tier2),
    pytest.param(("full", -1), marks=pytest.mark.tier2),
    pytest.param(("default", [-3, -1]), marks=pytest.mark.tier2),
])
def llava(request, tmp_path_factory):
    strategy, layer = request.param
    return _make(tmp_path_factory.mktemp("llava"), strategy, layer)


def test_hidden_states_and_features_match_transformers(llava):
    model, arch, tensors = llava
    vision, projector, _ = load_llava_vision(arch, tensors)
    pixels = np.random.default_rng(1).standard_normal((3, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        ref = model.model.vision_tower(torch.from_numpy(pixels), output_hidden_states=True)
        ref_feats = model.get_image_features(
            pixel_values=torch.from_numpy(pixels),
            vision_feature_layer=model.config.vision_feature_layer,
            vision_feature_select_strategy=model.config.vision_feature_select_strategy,
        ).pooler_output
    hs = np.asarray(clip_hidden_states(vision, jnp.asarray(pixels), arch.vision))
    assert hs.shape[0] == len(ref.hidden_states) == 3
    for i, h in enumerate(ref.hidden_states):
        np.testing.assert_allclose(hs[i], h.numpy(), atol=1e-5, rtol=1e-5)
    feats = np.asarray(image_features(vision, projector, jnp.asarray(pixels), arch))
    assert feats.shape == (3, arch.num_image_tokens, 32)
    np.testing.assert_allclose(feats, torch.stack(list(ref_feats)).numpy(), atol=1e-5, rtol=1e-5)
    # The projector alone, on the selected features.
    sel = select_features(jnp.asarray(hs), arch.vision_feature_layer,
                          arch.vision_feature_select_strategy)
    with torch.no_grad():
        ref_proj = model.model.multi_modal_projector(torch.from_numpy(np.array(sel)))
    np.testing.assert_allclose(np.asarray(project(projector, sel, arch)), ref_proj.numpy(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_merged_embeddings_match_transformers(llava, num_images):
    model, arch, tensors = llava
    vision, projector, text = load_llava_vision(arch, tensors)
    rng = np.random.default_rng(num_images)
    prompt = [1, 5, 7]
    for _ in range(num_images):
        prompt += [IMAGE_TOKEN, int(rng.integers(2, 50))]
    ids = expand_image_tokens(prompt, arch.image_token_id, arch.num_image_tokens)
    assert len(ids) == len(prompt) + num_images * (arch.num_image_tokens - 1)
    pixels = rng.standard_normal((num_images, 3, 32, 32)).astype(np.float32)

    captured = {}

    def hook(_module, args, kwargs):
        captured["embeds"] = kwargs["inputs_embeds"].detach().clone()

    handle = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]),
                  pixel_values=torch.from_numpy(pixels) if num_images else None)
    finally:
        handle.remove()

    embed = jnp.asarray(text["model.embed_tokens.weight"])
    tok = jnp.asarray(ids, jnp.int32)
    feats = (image_features(vision, projector, jnp.asarray(pixels), arch).reshape(-1, 32)
             if num_images else jnp.zeros((0, 32), jnp.float32))
    merged = merge_image_embeddings(tok, embed[tok], feats, arch.image_token_id)
    np.testing.assert_allclose(np.asarray(merged), captured["embeds"][0].numpy(),
                               atol=1e-5, rtol=1e-5)


def test_merge_count_mismatch_raises():
    with pytest.raises(ValueError, match="do not match"):
        merge_image_embeddings(jnp.asarray([1, 9, 9]), jnp.zeros((3, 4)), jnp.zeros((1, 4)), 9)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=12), st.integers(1, 4))
def test_expand_and_merge_property(prompt, n):
    """Every placeholder becomes n tokens; the merge puts feature k at the k-th placeholder
    row (numpy reference) and leaves the others untouched."""
    ids = expand_image_tokens(prompt, 3, n)
    assert len(ids) == len(prompt) + prompt.count(3) * (n - 1)
    assert [t for t in ids if t != 3] == [t for t in prompt if t != 3]
    t = np.asarray(ids, np.int32)
    emb = np.arange(len(ids) * 2, dtype=np.float32).reshape(-1, 2)
    feats = -1.0 - np.arange(int((t == 3).sum()) * 2, dtype=np.float32).reshape(-1, 2)
    ref = emb.copy()
    ref[t == 3] = feats
    out = merge_image_embeddings(jnp.asarray(t), jnp.asarray(emb), jnp.asarray(feats), 3)
    np.testing.assert_array_equal(np.asarray(out), ref)


def _png(size=(40, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (*size[::-1], 3), np.uint8)).save(
        buf, format="PNG")
    return buf.getvalue()


def test_preprocess_matches_processor_and_rejects_bad_bytes():
    from PIL import Image
    from transformers import CLIPImageProcessor

    proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    data = _png()
    pixels = preprocess_images([data, data], proc)
    assert pixels.shape == (2, 3, 32, 32) and pixels.dtype == np.float32
    ref = proc(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="np")
    np.testing.assert_allclose(pixels[0], ref["pixel_values"][0], atol=1e-6)
    with pytest.raises(ValueError, match="cannot decode"):
        load_image(b"not an image at all")
    with pytest.raises(ValueError, match="cannot decode"):
        load_image(data[: len(data) // 2])  # truncated PNG
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="TIFF")
    with pytest.raises(ValueError, match="unsupported image format"):
        load_image(buf.getvalue())


@pytest.fixture(scope="module")
def llava_default(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("llava_default"), "default", -2)


@pytest.mark.tier2
@pytest.mark.parametrize("num_images", [0, 2])
def test_paged_llama_logits_with_images_match_transformers(llava_default, num_images):
    """Merged embeddings through pagedjax's paged Llama forward (pages scattered, the rest of
    the cache NaN) give LlavaForConditionalGeneration's logits at every prompt position."""
    from pagedjax.attention import PAD_SLOT
    from pagedjax.model import ModelInput, allocate_kv_cache, arch_from_hf_config
    from pagedjax.model.forward import forward
    from pagedjax.model.loader import convert_hf_tensors

    model, arch, tensors = llava_default
    vision, projector, text = load_llava_vision(arch, tensors)
    text_arch = arch_from_hf_config(model.config.text_config.to_dict())
    params = convert_hf_tensors(text_arch, text)
    rng = np.random.default_rng(7)
    prompt = [1, 9]
    for _ in range(num_images):
        prompt += [IMAGE_TOKEN, int(rng.integers(2, 50))]
    ids = expand_image_tokens(prompt, arch.image_token_id, arch.num_image_tokens)
    pixels = rng.standard_normal((num_images, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]),
                    pixel_values=torch.from_numpy(pixels) if num_images else None).logits[0]

    t, bs = len(ids), 8
    nblocks = -(-t // bs)
    pages = rng.permutation(np.arange(1, nblocks + 3))[:nblocks]  # never page 0 (null block)
    kv = allocate_kv_cache(text_arch, nblocks + 3, bs, jnp.float32, fill_value=np.nan)
    pad = 4  # padding rows, as a bucketed step has
    pos = np.arange(t)
    batch = ModelInput(
        tokens=jnp.asarray(ids + [0] * pad, jnp.int32),
        positions=jnp.asarray(list(pos) + [0] * pad, jnp.int32),
        slot_mapping=jnp.asarray(list(pages[pos // bs] * bs + pos % bs) + [PAD_SLOT] * pad,
                                 jnp.int32),
        block_tables=jnp.asarray(pages[None], jnp.int32),
        kv_lens=jnp.asarray([t], jnp.int32),
        cu_q_lens=jnp.asarray([0, t], jnp.int32),
        logits_indices=jnp.arange(t, dtype=jnp.int32),
    )
    tok = jnp.asarray(ids, jnp.int32)
    embed = params["embed_tokens"]["embedding"]
    feats = (image_features(vision, projector, jnp.asarray(pixels), arch).reshape(-1, 32)
             if num_images else jnp.zeros((0, 32), jnp.float32))
    merged = merge_image_embeddings(tok, embed[tok], feats, arch.image_token_id)
    merged = jnp.concatenate([merged, jnp.zeros((pad, 32), merged.dtype)])
    with pytest.raises(ValueError, match="inputs_embeds must be"):
        forward(params, kv, batch, arch=text_arch, inputs_embeds=merged[:-1])
    step = jax.jit(functools.partial(forward, arch=text_arch))
    _, logits = step(params, kv, batch, inputs_embeds=merged)
    # Measured max |diff| ~1e-7 on CPU fp32.
    np.testing.assert_allclose(np.asarray(logits), ref.numpy(), atol=1e-5, rtol=1e-5)


def test_merge_jits():
    """Under jit (traced ids) the merge gives the eager result; the count check is skipped."""
    ids = jnp.asarray([1, 9, 9, 2, 9], jnp.int32)
    emb = jnp.arange(10, dtype=jnp.float32).reshape(5, 2)
    feats = -jnp.arange(1, 7, dtype=jnp.float32).reshape(3, 2)
    f = jax.jit(merge_image_embeddings, static_argnums=3)
    np.testing.assert_array_equal(np.asarray(f(ids, emb, feats, 9)),
                                  np.asarray(merge_image_embeddings(ids, emb, feats, 9)))


def test_old_llava_hf_key_layout_and_refusals(llava):
    """llava-hf hub names (vision_tower.vision_model.*, language_model.model.*) load to the
    same params; a missing or unexpected vision tensor is refused by name."""
    _, arch, tensors = llava
    vision, projector, text = load_llava_vision(arch, tensors)
    old = {}
    for k, x in tensors.items():
        if k.startswith("vision_tower."):
            k = "vision_tower.vision_model." + k[len("vision_tower."):]
        old[k] = x
    v2, p2, t2 = load_llava_vision(arch, old)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), vision, v2))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), projector, p2))
    assert sorted(t2) == sorted(text)
    key = "vision_tower.encoder.layers.1.mlp.fc1.bias"
    with pytest.raises(ValueError, match="missing tensor 'encoder.layers.1.mlp.fc1.bias'"):
        load_llava_vision(arch, {k: x for k, x in tensors.items() if k != key})
    with pytest.raises(ValueError, match="does not use"):
        load_llava_vision(arch, dict(tensors, **{"vision_tower.extra.weight": np.zeros(2)}))
