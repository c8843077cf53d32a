"""Idefics3 / SmolVLM (model/vision/siglip.py, idefics3.py; engine/multimodal.py's
Idefics3 loader) against transformers' Idefics3ForConditionalGeneration on a tiny random
checkpoint written by transformers (fp32): the SigLIP tower's hidden states, the
connector, get_image_features, the prompt expansion against Idefics3Processor's ids,
paged-forward logits with 0, 1 and 2 images, and ``LLM.generate`` with images against
``generate`` (greedy) under chunked prefill. Both preprocessing modes: one global tile
per image (``do_image_splitting=False``) and split tiles + the global one.

Default tier: the pure pieces (pixel shuffle, the prompt text, the tile expansion, the
refusals). Everything that builds a transformers model is tier2."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.engine.multimodal import expand_placeholders
from pagedjax.model.vision.idefics3 import (
    Idefics3Arch,
    image_prompt_text,
    pixel_shuffle,
    split_idefics3_tensors,
)
from pagedjax.model.vision.siglip import SiglipVisionArch, check_full_image, convert_siglip_tensors

# The byte-level tiny tokenizer's ids end at 258; the Idefics3 tokens follow.
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
           *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]]  # fmt: skip
FAKE, IMAGE, EOU, GLOBAL = 259, 260, 261, 262
N = 4  # image tokens per tile: (32 / 8)^2 patches / scale_factor 2 squared
BS = 8
GREEDY_TOKENS = 6
VISION = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
              num_hidden_layers=2, num_attention_heads=2)  # fmt: skip
ONE = "User:<image>What is this?<end_of_utterance>\nAssistant:"
TWO = "User:<image>and<image>Compare.<end_of_utterance>\nAssistant:"
TEXT = "User: hello there<end_of_utterance>\nAssistant:"


def _image(seed: int, size=(50, 30)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), np.uint8))


# -- default tier: pure functions ----------------------------------------------------------


def _hf_pixel_shuffle(x: np.ndarray, s: int) -> np.ndarray:
    """Idefics3Connector.pixel_shuffle, transcribed to numpy."""
    b, seq, d = x.shape
    h = w = int(seq**0.5)
    x = x.reshape(b, h, w // s, d * s).transpose(0, 2, 1, 3)
    x = x.reshape(b, w // s, h // s, d * s * s).transpose(0, 2, 1, 3)
    return x.reshape(b, seq // (s * s), d * s * s)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 4))
def test_pixel_shuffle_is_the_connectors(b, s, blocks, d):
    """Any batch, scale factor, grid (blocks * s a side) and width: HF's formula; every
    input value appears exactly once (a permutation). On numpy arrays (the function only
    reshapes and transposes; one jnp case below, the tier2 test runs it jitted)."""
    side = blocks * s
    x = np.arange(b * side * side * d, dtype=np.float32).reshape(b, side * side, d)
    got = pixel_shuffle(x, s)
    np.testing.assert_array_equal(got, _hf_pixel_shuffle(x, s))
    assert sorted(got.ravel().tolist()) == x.ravel().tolist()
    with pytest.raises(ValueError, match="square grid"):
        pixel_shuffle(np.zeros((1, side * side + 1, d)), s)


def test_pixel_shuffle_on_jax_arrays():
    x = np.arange(2 * 16 * 3, dtype=np.float32).reshape(2, 16, 3)
    np.testing.assert_array_equal(np.asarray(pixel_shuffle(jnp.asarray(x), 2)),
                                  _hf_pixel_shuffle(x, 2))  # fmt: skip


def test_image_prompt_text_is_the_processors():
    """The strings Idefics3Processor.replace_image_token writes (transcribed from
    transformers 5.25's processing_idefics3.py)."""
    run = "<image>" * 2
    glob = f"<fake_token_around_image><global-img>{run}<fake_token_around_image>"
    assert image_prompt_text(0, 0, 2) == glob
    assert image_prompt_text(2, 1, 2) == (
        f"<fake_token_around_image><row_1_col_1>{run}\n"
        f"<fake_token_around_image><row_2_col_1>{run}\n\n{glob}"
    )


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=8), st.data())
def test_tile_expansion_property(prompt, data):
    """Each placeholder (3) becomes its image's replacement (k tiles: k runs of n image
    tokens between other ids, as Idefics3's); the expanded prompt passes unchanged; one
    image too many is refused."""
    n = 2
    k_images = prompt.count(3)
    tiles = data.draw(st.lists(st.integers(1, 3), min_size=k_images, max_size=k_images))
    reps = [[9] + [x for _ in range(k) for x in (8, *[3] * n)] + [9] for k in tiles]
    ids = expand_placeholders(prompt, 3, reps, n)
    assert ids.count(3) == n * sum(tiles)
    assert len(ids) == len(prompt) - k_images + sum(map(len, reps))
    assert [t for t in ids if t not in (3, 8, 9)] == [t for t in prompt if t != 3]
    if k_images:
        assert expand_placeholders(ids, 3, reps, n) == ids
        with pytest.raises(ValueError, match="placeholder"):
            expand_placeholders(prompt, 3, [*reps, [3] * n], n)


def _siglip_tensors(arch: SiglipVisionArch, rng) -> dict[str, np.ndarray]:
    h, f, p = arch.hidden_size, arch.intermediate_size, arch.patch_size
    t = {"embeddings.patch_embedding.weight": (h, 3, p, p), "embeddings.patch_embedding.bias": (h,),
         "embeddings.position_embedding.weight": (arch.num_patches, h),
         "post_layernorm.weight": (h,), "post_layernorm.bias": (h,)}  # fmt: skip
    for i in range(arch.num_layers):
        for name, shape in [("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h, h)),
                            ("self_attn.v_proj", (h, h)), ("self_attn.out_proj", (h, h)),
                            ("mlp.fc1", (f, h)), ("mlp.fc2", (h, f))]:  # fmt: skip
            t[f"encoder.layers.{i}.{name}.weight"] = shape
            t[f"encoder.layers.{i}.{name}.bias"] = shape[:1]
        for name in ("layer_norm1", "layer_norm2"):
            t[f"encoder.layers.{i}.{name}.weight"] = t[f"encoder.layers.{i}.{name}.bias"] = (h,)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in t.items()}


def test_refusals_of_the_pure_pieces():
    """Missing / mis-shaped / unexpected tower tensors, a pooling head (ignored), padded
    patches, a scale factor that does not divide the grid, a stray checkpoint tensor."""
    cfg = dict(VISION, model_type="idefics3_vision")
    arch = SiglipVisionArch.from_hf(cfg)
    tensors = _siglip_tensors(arch, np.random.default_rng(0))
    params = convert_siglip_tensors(arch, dict(tensors, **{"head.probe": np.zeros(3)}))
    assert params["layers"]["q_proj"]["kernel"].shape == (2, 32, 32)
    key = "encoder.layers.1.mlp.fc2.bias"
    with pytest.raises(ValueError, match=f"missing tensor '{key}'"):
        convert_siglip_tensors(arch, {k: v for k, v in tensors.items() if k != key})
    with pytest.raises(ValueError, match="shape mismatch"):
        convert_siglip_tensors(arch, dict(tensors, **{key: np.zeros(31, np.float32)}))
    with pytest.raises(ValueError, match="does not use"):
        convert_siglip_tensors(arch, dict(tensors, **{"encoder.layers.2.mlp.fc1.bias": 0}))
    with pytest.raises(ValueError, match="only square"):
        SiglipVisionArch.from_hf(dict(cfg, image_size=[32, 64]))
    with pytest.raises(ValueError, match="not a SigLIP"):
        SiglipVisionArch.from_hf(dict(cfg, model_type="clip_vision_model"))

    mask = np.ones((2, 32, 32), np.int64)
    check_full_image(mask, 8)
    mask[1, :, 25:] = 0  # the last patch column still has a valid pixel column: full
    check_full_image(mask, 8)
    mask[1, :, 24:] = 0  # the last patch column is all padding
    with pytest.raises(ValueError, match="padded patches"):
        check_full_image(mask, 8)

    config = {"model_type": "idefics3", "vision_config": cfg, "scale_factor": 3,
              "text_config": {"hidden_size": 32}, "image_token_id": IMAGE}  # fmt: skip
    with pytest.raises(ValueError, match="scale_factor 3 does not divide"):
        Idefics3Arch.from_hf(config)
    assert Idefics3Arch.from_hf(dict(config, scale_factor=2)).num_image_tokens == N
    with pytest.raises(ValueError, match="unexpected tensor 'model.other.weight'"):
        split_idefics3_tensors({"model.other.weight": np.zeros(1)})


def test_smolvlm_style_config():
    """A config.json shaped like SmolVLM-256M's (partial sub-configs, training-time keys,
    the text model named "VLlama3ForCausalLM"): transformers' defaults fill the gaps, the
    text model is a Llama ModelArch, 64 image tokens a 512 px tile at scale factor 4."""
    from pagedjax.model.config import arch_from_hf_config
    from pagedjax.model.vision.idefics3 import complete_idefics3_config

    cfg = {"model_type": "idefics3", "image_token_id": 49190, "scale_factor": 4,
           "tie_word_embeddings": False,
           "text_config": {"architectures": ["VLlama3ForCausalLM"], "model_type": "llama",
                           "hidden_size": 576, "intermediate_size": 1536, "head_dim": 64,
                           "num_attention_heads": 9, "num_hidden_layers": 30,
                           "num_key_value_heads": 3, "rope_theta": 100000, "vocab_size": 49280,
                           "pixel_shuffle_factor": 4, "_flash_attn_2_enabled": True},
           "vision_config": {"model_type": "idefics3_vision", "hidden_size": 768,
                             "image_size": 512, "patch_size": 16, "num_attention_heads": 12,
                             "max_image_size": {"longest_edge": 512}}}  # fmt: skip
    full = complete_idefics3_config(cfg)
    arch = Idefics3Arch.from_hf(full)
    assert arch.num_image_tokens == 64 and arch.vision.num_layers == 12  # HF's default depth
    text = arch_from_hf_config(full["text_config"])
    # rms_norm_eps: LlamaConfig's 1e-6 (Idefics3Config's 1e-5 applies without a text_config)
    assert (text.family, text.num_layers, text.rope_theta, text.norm_eps) == (
        "llama", 30, 1e5, 1e-6)
    assert not text.tie_word_embeddings
    with pytest.raises(ValueError, match="not an Idefics3 config"):
        complete_idefics3_config(dict(cfg, model_type="llava"))


# -- tier2: against transformers -----------------------------------------------------------


def _write(directory, model, tok, splitting: bool):
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    proc = Idefics3ImageProcessorPil(do_image_splitting=splitting, size={"longest_edge": 64},
                                     max_image_size={"longest_edge": 32})  # fmt: skip
    proc.save_pretrained(str(directory))
    return proc


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    """A tiny random Idefics3 (SigLIP 32 px / patch 8, 2 layers, hidden 32; Llama text
    model, hidden 32, 1 layer; scale factor 2: 4 image tokens a tile) saved twice, with
    and without image splitting: {"split": (dir, processor), "global": (dir, processor),
    "model": torch model}."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
    )
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig

    from tests.model_helpers import save_tiny_tokenizer

    root = tmp_path_factory.mktemp("idefics3")
    tok = save_tiny_tokenizer(root, chat_template=None)
    tok.add_tokens(SPECIAL, special_tokens=True)
    assert tok.convert_tokens_to_ids(SPECIAL[:4]) == [FAKE, IMAGE, EOU, GLOBAL]
    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=1, eos_token_id=2, initializer_range=0.15)  # fmt: skip
    cfg = Idefics3Config(vision_config=Idefics3VisionConfig(**VISION), text_config=text,
                         image_token_id=IMAGE, scale_factor=2)  # fmt: skip
    model = Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # image features on the text embeddings' scale, random biases
        for name, p in model.named_parameters():
            if "connector" in name:
                p.normal_(0.0, 0.3)
            elif name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    out = {"model": model}
    for name, splitting in (("global", False), ("split", True)):
        d = root / name
        proc = _write(d, model, tok, splitting)
        out[name] = (d, Idefics3Processor(image_processor=proc, tokenizer=tok, image_seq_len=N))
    return out


@pytest.mark.tier2
def test_tower_connector_and_features_match_transformers(idefics3):
    """SigLIP hidden states (every layer), the post-layernormed last state, the
    connector and get_image_features, atol 1e-5 fp32; HF's position buckets for a
    full image are the identity at this grid and the released checkpoints' grids."""
    import torch
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

    from pagedjax.model.safetensors_io import load_tensors
    from pagedjax.model.vision.idefics3 import (
        complete_idefics3_config,
        connect,
        image_features,
        load_idefics3_vision,
    )
    from pagedjax.model.vision.siglip import siglip_hidden_states, siglip_last_hidden_state

    model = idefics3["model"]
    d = idefics3["global"][0]
    config = complete_idefics3_config(json.loads((d / "config.json").read_text()))
    arch = Idefics3Arch.from_hf(config)
    vision, connector, text = load_idefics3_vision(arch, load_tensors(d / "model.safetensors"))
    assert sorted(text) == sorted(k.replace("model.text_model.", "model.")
                                  for k in model.state_dict() if "vision" not in k
                                  and "connector" not in k)  # fmt: skip
    px = np.random.default_rng(1).standard_normal((3, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        ref = model.model.vision_model(torch.from_numpy(px), output_hidden_states=True)
        ref_conn = model.model.connector(ref.last_hidden_state)
        ref_feats = model.model.get_image_features(torch.from_numpy(px)[None]).pooler_output[0]
    hs = np.asarray(siglip_hidden_states(vision, jnp.asarray(px), arch.vision))
    assert hs.shape[0] == len(ref.hidden_states) == 3
    for i, h in enumerate(ref.hidden_states):
        np.testing.assert_allclose(hs[i], h.numpy(), atol=1e-5, rtol=1e-5)
    last = siglip_last_hidden_state(vision, jnp.asarray(px), arch.vision)
    np.testing.assert_allclose(np.asarray(last), ref.last_hidden_state.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(connect(connector, last, arch)), ref_conn.numpy(),
                               atol=1e-5)  # fmt: skip
    feats = np.asarray(image_features(vision, connector, jnp.asarray(px), arch))
    assert feats.shape == (3, N, 32)
    np.testing.assert_allclose(feats.reshape(-1, 32), ref_feats.numpy(), atol=1e-5, rtol=1e-5)

    # HF's float32 buckets for a full image equal the row-major patch index (what
    # siglip.py uses) at this grid and at Idefics3-8B's / SmolVLM's (26, 27, 32 a side).
    for side in (4, 26, 27, 32):
        emb = Idefics3VisionEmbeddings(type(model.config.vision_config)(
            image_size=side, patch_size=1, hidden_size=1, num_channels=1))
        with torch.no_grad():
            emb.patch_embedding.weight.zero_()
            emb.patch_embedding.bias.zero_()
            emb.position_embedding.weight.copy_(torch.arange(side * side)[:, None])
            pos = emb(torch.zeros(1, 1, side, side), torch.ones(1, side, side, dtype=torch.bool))
        np.testing.assert_array_equal(pos[0, :, 0].numpy(), np.arange(side * side))


def _paged_logits(text_arch, params, ids, embeds):
    """pagedjax's paged Llama forward over inputs_embeds (pages scattered, the rest of
    the cache NaN, 4 padding rows) -> logits at every prompt position."""
    from tests.model_helpers import paged_embeds_logits

    return paged_embeds_logits(text_arch, params, ids, embeds, BS)


@pytest.mark.tier2
@pytest.mark.parametrize("mode", ["global", "split"])
def test_expansion_and_paged_logits_match_transformers(idefics3, mode):
    """For prompts with 0, 1 and 2 images (two sizes, so split images have different
    grids): the engine loader's prepare + expand_placeholders give Idefics3Processor's
    input_ids, and the merged embeddings through the paged Llama forward give
    Idefics3ForConditionalGeneration's logits at every position, atol 1e-5."""
    import torch

    from pagedjax.config import ModelConfig
    from pagedjax.engine.vision_models import load_multimodal_model
    from pagedjax.model.vision.llava import merge_image_embeddings

    d, processor = idefics3[mode]
    model = idefics3["model"]
    text_arch, params, tokenizer, vision = load_multimodal_model(ModelConfig(model=str(d)))
    a, b = _image(1), _image(2, size=(30, 70))
    for prompt, images in [(TEXT, []), (ONE, [a]), (TWO, [a, b])]:
        inputs = processor(text=prompt, images=images or None, return_tensors="pt")
        want_ids = inputs["input_ids"][0].tolist()
        prepared = vision.prepare(images)
        ids = expand_placeholders(tokenizer.encode(prompt), IMAGE,
                                  [p.replacement for p in prepared], N)  # fmt: skip
        assert ids == want_ids
        tiles = sum(len(p.tiles) for p in prepared)
        assert ids.count(IMAGE) == N * tiles
        if mode == "split" and images:
            assert tiles > len(images)  # the images were split
        with torch.no_grad():
            ref = model(**inputs).logits[0].numpy()
        tok = jnp.asarray(ids, jnp.int32)
        embeds = params["embed_tokens"]["embedding"][tok]
        if images:
            px = np.concatenate([p.tiles for p in prepared])
            np.testing.assert_allclose(px, inputs["pixel_values"][0].numpy(), atol=1e-6)
            feats = vision.encode_tiles(list(px)).reshape(-1, 32)
            embeds = merge_image_embeddings(tok, embeds, feats, IMAGE)
        # Measured max |diff| 1.5e-6 .. 2.3e-6 on CPU fp32 (logits of magnitude ~3).
        np.testing.assert_allclose(_paged_logits(text_arch, params, ids, embeds), ref,
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.tier2
@pytest.mark.parametrize("mode", ["global", "split"])
def test_generate_with_images_equals_transformers(idefics3, mode):
    """LLM(model=<Idefics3 dir>).generate with 0, 1 and 2 images per prompt (16-token
    steps: chunked prefill cuts tiles; an encoder cache of 2 tiles: evictions) gives
    Idefics3Processor + generate's greedy tokens; the same image again hits the prefix
    cache and encodes nothing; LLM.chat and (without splitting) the server's chat take
    image parts."""
    import torch

    from pagedjax import LLM, SamplingParams

    d, processor = idefics3[mode]
    model = idefics3["model"]
    llm = LLM(model=str(d), max_num_batched_tokens=16, mm_encoder_cache_size=2 * N,
              block_size=BS, num_gpu_blocks_override=96, max_num_seqs=2, max_model_len=192,
              warmup="none", limit_mm_per_prompt={"image": 2})  # fmt: skip
    a, b, c = _image(1), _image(2, size=(30, 70)), _image(3)
    reqs = [(ONE, [a]), (ONE, [c]), (TEXT, []), (TWO, [b, a])]
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, logprobs=2)
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} if im else p
                         for p, im in reqs], greedy, use_tqdm=False)  # fmt: skip
    want = []
    for p, im in reqs:
        inputs = processor(text=p, images=im or None, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=GREEDY_TOKENS, do_sample=False)
        want.append(out[0, inputs["input_ids"].shape[1]:].tolist())
        if im:
            assert outs[len(want) - 1].prompt_token_ids == inputs["input_ids"][0].tolist()
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want
    # The image matters (the tiny model's greedy tokens may not show it; its logprobs do).
    assert outs[0].outputs[0].logprobs[0] != outs[1].outputs[0].logprobs[0]
    s = llm.llm_engine.stats()
    assert s["mm_split_image_slices"] > 0 and s["mm_encoder_cache_evictions"] > 0
    engine = llm.llm_engine
    engine.reset_stats()
    again = llm.generate({"prompt": ONE, "multi_modal_data": {"image": c}}, greedy,
                         use_tqdm=False)[0]  # fmt: skip
    assert again.outputs[0].token_ids == got[1]
    assert engine.stats()["prefix_cache_hit_tokens"] == (len(again.prompt_token_ids) - 1) // BS * BS
    assert engine.stats()["mm_images_encoded"] == 0

    # LLM.chat's image parts: one "<image>" placeholder per image before the text, the
    # reply is generate's on the rendered ids; the front ends' bound on an image's
    # expansion (image_prompt_info) holds the real expansions of this test's images.
    from pagedjax.engine.vision_models import image_prompt_info
    from tests.model_helpers import TINY_CHAT_TEMPLATE

    parts = [{"type": "image_pil", "image_pil": b}, {"type": "text", "text": "What is this?"}]
    chat = llm.chat([{"role": "user", "content": parts}], greedy, use_tqdm=False,
                    chat_template=TINY_CHAT_TEMPLATE)[0]  # fmt: skip
    rendered = "<|user|><image>\nWhat is this?\n<|assistant|>"
    ids = llm.get_tokenizer().encode(rendered, add_special_tokens=False)
    ref = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": b}}, greedy,
                       use_tqdm=False)[0]  # fmt: skip
    assert chat.prompt == rendered and chat.outputs[0].token_ids == ref.outputs[0].token_ids
    text, bound = image_prompt_info(d, llm.get_tokenizer())
    assert text == "<image>"
    assert bound == {"global": N + 3, "split": 2 * 2 * (N + 2) + 2 + 1 + N + 3}[mode]
    assert len(ref.prompt_token_ids) - (len(ids) - 1) <= bound
    if mode == "global":
        _server_chat_equals(llm, d, b, ref.outputs[0].text)


def _server_chat_equals(llm, directory, image, want_text: str) -> None:
    """The OpenAI chat endpoint (in process, over llm's engine; shuts it down) answers an
    image_url data URL part with the text generate gives for the rendered prompt."""
    import asyncio
    import base64
    import io

    import httpx

    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.openai.api_server import build_app
    from tests.model_helpers import TINY_CHAT_TEMPLATE

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    engine = AsyncLLMEngine.from_llm(llm)
    app = build_app(engine, ["m"], model_path=str(directory), chat_template=TINY_CHAT_TEMPLATE)
    parts = [{"type": "image_url", "image_url": {"url": url}},
             {"type": "text", "text": "What is this?"}]  # fmt: skip
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": GREEDY_TOKENS,
            "temperature": 0.0}  # fmt: skip

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=120) as c:  # fmt: skip
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

    try:
        assert asyncio.run(main()) == want_text
    finally:
        engine.shutdown()
