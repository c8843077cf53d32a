"""Qwen2-VL (model/vision/qwen2_vl.py, engine/mrope.py, the Qwen2-VL loader of
engine/vision_models.py) against transformers' Qwen2VLForConditionalGeneration on a
tiny random checkpoint written by transformers (fp32): the vision tower, the M-RoPE
positions (``get_rope_index``), paged-forward logits with 0, 1 and 2 images of
different sizes, and the engine (chunked prefill, decode, the fused K-step loop,
preemption by recompute, prefix caching, ``LLM.chat``, the server through the official
``openai`` client) against ``generate``.

transformers 5.25's ``Qwen2VLProcessor`` cannot be constructed without torchvision (its
video processor's class check imports it), so the reference processor is built with
``__new__`` and its attributes set; its ``__call__`` (the PIL image processor + the
placeholder expansion + ``mm_token_type_ids``) is transformers' own.

Default tier: the pure pieces (M-RoPE positions vs ``get_rope_index``, the tower's
patch positions, M-RoPE with equal rows = RoPE, the step positions' slicing, the
refusals). Everything that builds a transformers model is tier2."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.engine.mrope import step_positions
from pagedjax.model.vision.qwen2_vl import (
    Qwen2VisionArch,
    convert_vision_tensors,
    mrope_positions,
    split_qwen2_vl_tensors,
    vision_positions,
)

# The byte-level tiny tokenizer's ids end at 258; the Qwen2-VL tokens follow.
SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
START, END, PAD, VIDEO = 259, 260, 261, 262
PH = "<|vision_start|><|image_pad|><|vision_end|>"
BS = 8
GREEDY_TOKENS = 12
VISION = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2)  # fmt: skip
MAX_PIXELS = 64 * 64  # 64 image tokens at most (patch 4 x merge 2 = 8 px a token side)
ONE = f"User: {PH}What is this?"
TWO = f"Compare {PH} and {PH} please."
TEXT = "User: hello there, how are you"
SIZES = [(40, 24), (30, 50), (48, 40)]  # (w, h): 15, 24 and 30 image tokens


def _image(seed: int, size=(40, 24)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), np.uint8))


# -- default tier: pure functions ----------------------------------------------------------


def _hf_rope_index(ids: list[int], grids: list[tuple[int, int, int]], merge: int):
    """transformers' Qwen2VLModel.get_rope_index on one sequence (called unbound on a
    stand-in self: only the config's merge size and get_vision_position_ids are used)."""
    import torch
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    me = SimpleNamespace(config=SimpleNamespace(
        vision_config=SimpleNamespace(spatial_merge_size=merge)))  # fmt: skip
    me.get_vision_position_ids = functools.partial(Qwen2VLModel.get_vision_position_ids, me)
    t = torch.tensor([ids])
    pos, delta = Qwen2VLModel.get_rope_index(
        me, t, mm_token_type_ids=(t == PAD).int(), image_grid_thw=torch.tensor(grids)
    )
    return pos[:, 0].numpy(), int(delta[0, 0])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 4), st.integers(1, 4)),
                max_size=3), st.integers(0, 5))  # fmt: skip
def test_mrope_positions_are_get_rope_index(layout, tail):
    """Prompts of text runs and images of any (rows, cols) grid, in any order:
    mrope_positions equals transformers' get_rope_index, positions and delta."""
    merge = 2
    ids, images, grids = [1], [], []
    for text, rows, cols in layout:
        ids += [5] * text + [START]
        images.append((len(ids), rows, cols))
        grids.append((1, rows * merge, cols * merge))
        ids += [PAD] * (rows * cols) + [END]
    ids += [6] * tail
    pos, delta = mrope_positions(len(ids), images)
    if not images:  # get_rope_index needs an image; text positions are the indices
        np.testing.assert_array_equal(pos, np.tile(np.arange(len(ids)), (3, 1)))
        assert delta == 0
        return
    want, want_delta = _hf_rope_index(ids, grids, merge)
    np.testing.assert_array_equal(pos, want)
    assert delta == want_delta
    with pytest.raises(ValueError, match="overlaps or overruns"):
        mrope_positions(len(ids), [*images, (images[-1][0], 1, 1)])


def test_vision_positions_are_transformers():
    """The tower's patch (row, col) in merge-window order: transformers'
    get_vision_position_ids, for several grids."""
    import torch
    from transformers.vision_utils import get_vision_position_ids

    for gh, gw in [(2, 2), (6, 10), (12, 8), (4, 14)]:
        want = get_vision_position_ids(torch.tensor([[1, gh, gw]]), 2).numpy()
        np.testing.assert_array_equal(vision_positions(gh, gw, 2), want)


def test_mrope_with_equal_rows_is_rope_and_sections_matter():
    """apply_rope over [3, T] positions with equal rows is plain RoPE over [T] (why the
    decode steps can use a per-slot offset); unequal rows turn each section by its own
    row."""
    from pagedjax.model.rope import apply_rope

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 2, 16)), jnp.float32)
    inv = (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    p = jnp.asarray([0, 3, 7, 8, 100], jnp.int32)
    np.testing.assert_allclose(apply_rope(x, jnp.stack([p] * 3), inv, (2, 3, 3)),
                               apply_rope(x, p, inv), atol=1e-6)  # fmt: skip
    p3 = jnp.stack([p, p + 1, p + 2])
    got = np.asarray(apply_rope(x, p3, inv, (2, 3, 3)))
    for row, dims in [(0, [0, 1]), (1, [2, 3, 4]), (2, [5, 6, 7])]:
        ref = np.asarray(apply_rope(x, p3[row], inv))
        for j in dims:  # frequency j turns dims j and j + 8 (rotate-half layout)
            np.testing.assert_allclose(got[..., [j, j + 8]], ref[..., [j, j + 8]], atol=1e-6)
    with pytest.raises(ValueError, match="mrope_section"):
        apply_rope(x, p3, inv)


def test_step_positions_slice_prompts_and_offset_the_rest():
    """A step's [3, T] positions: a chunk of an image prompt is its slice of the host
    array, tokens past the prompt (a recompute's generated ones, decode) are index +
    delta, a text request's are its indices, padding 0."""
    pos, delta = mrope_positions(12, [(3, 2, 3)])
    assert delta == int(pos.max()) + 1 - 12 == -3  # 6 image tokens over max(2, 3) positions
    img = SimpleNamespace(multi_modal=SimpleNamespace(rope_positions=pos, rope_delta=delta))
    txt = SimpleNamespace(multi_modal=None)
    host = {"start_pos": [5, 10, 2], "q_lens": [4, 4, 3]}
    got = step_positions([(img, None), (img, None), (txt, None)], host, 16)
    np.testing.assert_array_equal(got[:, :4], pos[:, 5:9])
    np.testing.assert_array_equal(got[:, 4:6], pos[:, 10:12])
    np.testing.assert_array_equal(got[:, 6:8], np.tile(np.arange(12, 14) + delta, (3, 1)))
    np.testing.assert_array_equal(got[:, 8:11], np.tile(np.arange(2, 5), (3, 1)))
    assert not got[:, 11:].any()


def _vision_tensors(arch: Qwen2VisionArch, rng) -> dict[str, np.ndarray]:
    e, f, m = arch.embed_dim, arch.mlp_hidden, arch.merge_in
    t = {"patch_embed.proj.weight": (e, 3, 2, 4, 4), "merger.ln_q.weight": (e,),
         "merger.ln_q.bias": (e,), "merger.mlp.0.weight": (m, m), "merger.mlp.0.bias": (m,),
         "merger.mlp.2.weight": (arch.hidden_size, m), "merger.mlp.2.bias": (arch.hidden_size,)}
    for i in range(arch.depth):
        for name, shape in [("attn.qkv", (3 * e, e)), ("attn.proj", (e, e)),
                            ("mlp.fc1", (f, e)), ("mlp.fc2", (e, f))]:  # fmt: skip
            t[f"blocks.{i}.{name}.weight"], t[f"blocks.{i}.{name}.bias"] = shape, shape[:1]
        for name in ("norm1", "norm2"):
            t[f"blocks.{i}.{name}.weight"] = t[f"blocks.{i}.{name}.bias"] = (e,)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in t.items()}


def test_refusals_of_the_pure_pieces():
    """Missing / mis-shaped / unused tower tensors by name, a stray checkpoint tensor, a
    head size the 2-D rotary cannot split, an mrope_section not summing to half the
    rotary dims; both key layouts split alike."""
    from pagedjax.model.config import ModelArch

    arch = Qwen2VisionArch(**{k: v for k, v in VISION.items()})
    tensors = _vision_tensors(arch, np.random.default_rng(0))
    params = convert_vision_tensors(arch, tensors)
    assert params["blocks"]["qkv"]["kernel"].shape == (2, 32, 96)
    assert params["patch_embed"].shape == (arch.patch_dim, 32)
    key = "blocks.1.mlp.fc2.bias"
    with pytest.raises(ValueError, match=f"missing tensor '{key}'"):
        convert_vision_tensors(arch, {k: v for k, v in tensors.items() if k != key})
    with pytest.raises(ValueError, match=f"shape mismatch for '{key}'"):
        convert_vision_tensors(arch, dict(tensors, **{key: np.zeros(31, np.float32)}))
    with pytest.raises(ValueError, match="does not use.*blocks.2.norm1.bias"):
        convert_vision_tensors(arch, dict(tensors, **{"blocks.2.norm1.bias": np.zeros(32)}))
    with pytest.raises(ValueError, match="unexpected tensor 'vision_tower.x'"):
        split_qwen2_vl_tensors({"vision_tower.x": np.zeros(1)})
    hub = split_qwen2_vl_tensors({"visual.a": 1, "model.layers.0.b": 2, "lm_head.weight": 3})
    tree = split_qwen2_vl_tensors({"model.visual.a": 1, "model.language_model.layers.0.b": 2,
                                   "lm_head.weight": 3})  # fmt: skip
    assert hub == tree == ({"a": 1}, {"model.layers.0.b": 2, "lm_head.weight": 3})
    with pytest.raises(ValueError, match="multiple of 4"):
        Qwen2VisionArch(**dict(VISION, embed_dim=36, num_heads=2))
    text = dict(model_type="qwen2", vocab_size=8, hidden_size=32, num_layers=1, num_heads=2,
                num_kv_heads=1, head_dim=16, intermediate_size=8, max_position_embeddings=8)
    assert ModelArch(**text, mrope_section=(2, 3, 3)).mrope_section == (2, 3, 3)
    with pytest.raises(ValueError, match="mrope_section"):
        ModelArch(**text, mrope_section=(2, 3, 4))


# -- tier2: against transformers -----------------------------------------------------------


def _reference_processor(image_processor, tokenizer):
    """transformers' Qwen2VLProcessor without its video processor (module docstring)."""
    from transformers import Qwen2VLProcessor

    proc = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    proc.image_processor, proc.tokenizer = image_processor, tokenizer
    proc.video_processor, proc.chat_template = None, None
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id, proc.video_token_id = PAD, VIDEO
    return proc


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory):
    """A tiny random Qwen2-VL (ViT embed 32, 2 blocks, patch 4, merge 2; Qwen2 text
    model hidden 32, 2 layers, GQA 2:1, mrope_section (2, 3, 3)) saved by transformers
    with its PIL image processor (max 64 tokens an image) and the byte tokenizer +
    the Qwen2-VL special tokens: (directory, torch model, reference processor)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from tests.model_helpers import save_tiny_tokenizer

    d = tmp_path_factory.mktemp("qwen2vl")
    tok = save_tiny_tokenizer(d, chat_template=None)
    tok.add_tokens(SPECIAL, special_tokens=True)
    assert tok.convert_tokens_to_ids(SPECIAL) == [START, END, PAD, VIDEO]
    torch.manual_seed(0)
    text = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                 "rope_theta": 10000.0},
                bos_token_id=1, eos_token_id=2, initializer_range=0.15)  # fmt: skip
    cfg = Qwen2VLConfig(vision_config=VISION, text_config=text, image_token_id=PAD,
                        video_token_id=VIDEO, vision_start_token_id=START,
                        vision_end_token_id=END)  # fmt: skip
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # image features on the text embeddings' scale, random biases
        for name, p in model.named_parameters():
            if "merger" in name:
                p.normal_(0.0, 0.3)
            elif name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    img_proc = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                        min_pixels=64, max_pixels=MAX_PIXELS)  # fmt: skip
    img_proc.save_pretrained(str(d))
    return d, model, _reference_processor(img_proc, tok)


@pytest.mark.tier2
def test_tower_matches_transformers(qwen2vl):
    """The tower's last hidden state and the merged features (get_image_features) for
    two image sizes, atol 1e-5 fp32; in a batch of two images of one grid each image
    attends only to itself (HF's cu_seqlens)."""
    import torch

    from pagedjax.model.vision import qwen2_vl as q

    d, model, _ = qwen2vl
    _, _, arch, vision, proc = q.load_qwen2_vl_checkpoint(d)
    assert arch.num_image_tokens == 64
    for i, size in enumerate(SIZES[::2]):
        px, gh, gw = q.preprocess_image(proc, _image(i, size), arch)
        grid = torch.tensor([[1, gh, gw]])
        with torch.no_grad():
            ref = model.model.visual(torch.from_numpy(px), grid_thw=grid)
        if i == 0:
            hidden = q.vision_hidden(vision, jnp.asarray(px[None]), (gh, gw), arch.vision)
            np.testing.assert_allclose(np.asarray(hidden)[0], ref.last_hidden_state.numpy(),
                                       atol=1e-5, rtol=1e-5)  # fmt: skip
        two = jnp.asarray(np.stack([px, px[::-1]]))  # a batch: each row attends to itself
        feats = np.asarray(q.image_features(vision, two, (gh, gw), arch.vision))
        np.testing.assert_allclose(feats[0], ref.pooler_output.numpy(), atol=1e-5, rtol=1e-5)
        assert np.abs(ref.pooler_output.numpy()).max() > 0.3  # not a near-zero comparison


def _paged_logits(text_arch, params, ids, embeds, rope):
    """pagedjax's paged Qwen2 forward over inputs_embeds with M-RoPE positions rope
    int32[3, T] (pages scattered, the rest of the cache NaN, 4 padding rows) -> logits
    at every prompt position."""
    from tests.model_helpers import paged_embeds_logits

    return paged_embeds_logits(text_arch, params, ids, embeds, BS, rope)


@pytest.mark.tier2
def test_expansion_and_paged_logits_match_transformers(qwen2vl):
    """For prompts with 0, 1 and 2 images (of different sizes): the engine's prepare +
    expansion give the processor's input_ids; the M-RoPE positions give
    get_rope_index's; the merged embeddings through the paged forward with those
    positions give Qwen2VLForConditionalGeneration's logits at every position, atol
    1e-5 (and with 1-D positions they would not: the check can fail)."""
    import torch

    from pagedjax.config import ModelConfig
    from pagedjax.engine.multimodal import expand_placeholders
    from pagedjax.engine.vision_models import load_multimodal_model
    from pagedjax.model.vision.llava import merge_image_embeddings

    d, model, processor = qwen2vl
    text_arch, params, tokenizer, vision = load_multimodal_model(ModelConfig(model=str(d)))
    assert text_arch.mrope_section == (2, 3, 3) and vision.mrope
    a, b = _image(1, SIZES[0]), _image(2, SIZES[1])
    for prompt, images in [(TEXT, []), (ONE, [a]), (TWO, [b, a])]:
        inputs = processor(text=prompt, images=images or None, return_tensors="pt")
        want_ids = inputs["input_ids"][0].tolist()
        prepared = vision.prepare(images)
        ids = expand_placeholders(tokenizer.encode(prompt), PAD,
                                  [p.replacement for p in prepared], 1)  # fmt: skip
        assert ids == want_ids
        with torch.no_grad():
            ref = model(**inputs).logits[0].numpy()
        tok = jnp.asarray(ids, jnp.int32)
        embeds = params["embed_tokens"]["embedding"][tok]
        rope = np.tile(np.arange(len(ids)), (3, 1))
        if images:
            tiles = [t for p in prepared for t in p.tiles]
            lens = [vision.tile_tokens(t) for t in tiles]
            feats = vision.encode_tiles(tiles)
            feats = jnp.concatenate([feats[i, :n] for i, n in enumerate(lens)])
            embeds = merge_image_embeddings(tok, embeds, feats, PAD)
            offsets = [i for i in range(len(ids)) if ids[i] == PAD and ids[i - 1] == START]
            m = 2
            grids = [(o, t.shape[0] // m, t.shape[1] // m)
                     for o, t in zip(offsets, tiles, strict=True)]  # fmt: skip
            rope, delta = mrope_positions(len(ids), grids)
            grid_thw = inputs["image_grid_thw"]
            with torch.no_grad():
                want_pos, want_delta = model.model.get_rope_index(
                    inputs["input_ids"], inputs["mm_token_type_ids"], grid_thw)
            np.testing.assert_array_equal(rope, want_pos[:, 0].numpy())
            assert delta == int(want_delta[0, 0]) < 0
        got = _paged_logits(text_arch, params, ids, embeds, rope)
        # Measured max |diff| ~1e-6 on CPU fp32 (logits of magnitude ~3).
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
        if images:
            flat = _paged_logits(text_arch, params, ids, embeds,
                                 np.tile(np.arange(len(ids)), (3, 1)))  # fmt: skip
            assert np.abs(flat - ref).max() > 1e-3  # 1-D positions are wrong after an image


def _hf_greedy(model, processor, prompt, images, n, **kw):
    """(prompt ids, transformers' greedy continuation (EOS not special, as ignore_eos),
    each step's log-softmax); kw: the processor's tokenizer options."""
    import torch

    inputs = processor(text=prompt, images=images or None, return_tensors="pt", **kw)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)  # fmt: skip
    toks = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logp = [torch.log_softmax(s[0].double(), -1).numpy() for s in out.scores]
    return inputs["input_ids"][0].tolist(), toks, logp


def _check_against_hf(outs, reqs, model, processor):
    for o, (prompt, images) in zip(outs, reqs, strict=True):
        ids, toks, logp = _hf_greedy(model, processor, prompt, images, GREEDY_TOKENS)
        assert o.prompt_token_ids == ids
        got = o.outputs[0]
        assert got.token_ids == toks
        for step, lp in enumerate(got.logprobs):  # prefill's last token, then each decode
            for t, v in lp.items():
                assert abs(v.logprob - float(logp[step][t])) < 1e-5


@pytest.fixture(scope="module")
def llm(qwen2vl):
    """One engine for the module's engine tests: 16-token steps (chunked prefill cuts
    images), an encoder cache of one image (evictions) and 14 KV blocks of 8 for 3
    slots (the 2-image prompt alone takes 12: the batch is preempted and recomputed)."""
    from pagedjax import LLM

    return LLM(model=str(qwen2vl[0]), max_num_batched_tokens=16, block_size=BS,
               num_gpu_blocks_override=14, max_num_seqs=3, max_model_len=160,
               warmup="none", limit_mm_per_prompt={"image": 2})  # fmt: skip


@pytest.mark.tier2
def test_generate_equals_transformers(qwen2vl, llm):
    """LLM(model=<Qwen2-VL dir>).generate of prompts with 0, 1 and 2 images of different
    sizes gives the processor's prompt ids, generate's greedy tokens and its log-probs
    (2 per step, atol 1e-5: the prefill's last logits, then each decode step's), with
    chunked prefill cutting images, encoder-cache evictions and preemption by recompute
    on the way."""
    from pagedjax import SamplingParams

    d, model, processor = qwen2vl
    a, b, c = (_image(i, s) for i, s in enumerate(SIZES))
    reqs = [(ONE, [a]), (TEXT, []), (TWO, [b, c])]
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, logprobs=2,
                            ignore_eos=True)  # fmt: skip
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} if im else p
                         for p, im in reqs], greedy, use_tqdm=False)  # fmt: skip
    _check_against_hf(outs, reqs, model, processor)
    s = llm.llm_engine.stats()
    assert s["mm_split_image_slices"] > 0 and s["mm_encoder_cache_evictions"] > 0
    assert s["preemptions_recompute"] > 0


@pytest.mark.slow  # the K-step loop's compilation: ~25 s of CPU alone, ~60 s under load
def test_fused_decode_loop_equals_transformers(qwen2vl):
    """The fused K-step decode loop (num_scheduler_steps=4, the default on accelerators)
    reads each slot's M-RoPE delta from the step parameters: greedy tokens of prompts
    with 0, 1 and 2 images equal generate's."""
    from pagedjax import LLM, SamplingParams

    d, model, processor = qwen2vl
    loop = LLM(model=str(d), max_num_batched_tokens=16, block_size=BS, max_model_len=160,
               num_gpu_blocks_override=96, max_num_seqs=3, num_scheduler_steps=4,
               warmup="none", limit_mm_per_prompt={"image": 2})  # fmt: skip
    a, b, c = (_image(i, s) for i, s in enumerate(SIZES))
    reqs = [(ONE, [a]), (TEXT, []), (TWO, [b, c])]
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = loop.generate([{"prompt": p, "multi_modal_data": {"image": im}} if im else p
                          for p, im in reqs], greedy, use_tqdm=False)  # fmt: skip
    for o, (prompt, images) in zip(outs, reqs, strict=True):
        assert o.outputs[0].token_ids == _hf_greedy(model, processor, prompt, images,
                                                    GREEDY_TOKENS)[1]  # fmt: skip
    assert loop.llm_engine.stats()["multi_step_loops"] > 0


@pytest.mark.tier2
def test_warm_up_compiles_the_largest_grid_and_the_image_steps(qwen2vl):
    """warmup="all" compiles the encoder at the processor's largest square grid (a 64 x 64
    image: 16 x 16 patches, 64 tokens) and the image step program (M-RoPE positions) of
    every (T, S) pair: a first request with such an image traces and compiles nothing
    (XLA included) and gives generate's tokens; an image of another size compiles its
    own grid's encoder, and only that (every grid is its own program: docs/multimodal.md)."""
    from pagedjax import LLM, SamplingParams
    from pagedjax.engine.engine_stats import backend_compilations

    d, model, processor = qwen2vl
    engine = LLM(model=str(d), max_num_batched_tokens=16, block_size=BS, max_model_len=160,
                 num_gpu_blocks_override=64, max_num_seqs=2, warmup="all").llm_engine
    assert [k[:3] for k in engine.mm.vision.trace_count] == [(1, 16, 16)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before, xla = engine.stats()["compilations"], backend_compilations()[0]

    def run(size):
        image = _image(7, size)
        engine.add_request(str(size), {"prompt": ONE, "multi_modal_data": {"image": image}},
                           greedy)  # fmt: skip
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    assert o.outputs[0].token_ids == _hf_greedy(model, processor, ONE, [image],
                                                                4)[1]  # fmt: skip

    run((64, 64))
    assert engine.stats()["compilations"] == before and backend_compilations()[0] == xla
    run(SIZES[0])  # 40 x 24 px: another grid
    assert engine.stats()["compilations"] == before + 1
    assert len(engine.mm.vision.trace_count) == 2


@pytest.mark.tier2
def test_prefix_cache_chat_and_openai_server(qwen2vl, llm):
    """A new image under a cached text hits only the text blocks before the image; the
    same image and text again hits every full block and encodes nothing; LLM.chat with
    an image part equals generate on the rendered prompt; the server's chat through the
    official openai client with a data: URL answers LLM.chat's text (runs last: the
    server shuts the engine down)."""
    import base64
    import io

    import openai

    from pagedjax import SamplingParams
    from pagedjax.engine.vision_models import image_prompt_info
    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.openai.api_server import build_app
    from tests.engine_helpers import serve_in_thread
    from tests.model_helpers import TINY_CHAT_TEMPLATE

    d, _, _ = qwen2vl
    engine = llm.llm_engine
    a, b = _image(1, SIZES[0]), _image(2, SIZES[2])
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    first = llm.generate({"prompt": ONE, "multi_modal_data": {"image": a}}, greedy,
                         use_tqdm=False)[0]  # fmt: skip
    offset = first.prompt_token_ids.index(PAD)
    engine.reset_stats()
    other = llm.generate({"prompt": ONE, "multi_modal_data": {"image": b}}, greedy,
                         use_tqdm=False)[0]  # fmt: skip
    assert engine.stats()["prefill_tokens_saved"] == offset // BS * BS == 8
    assert other.prompt_token_ids.count(PAD) == 30 and first.prompt_token_ids.count(PAD) == 15
    engine.reset_stats()
    again = llm.generate({"prompt": ONE, "multi_modal_data": {"image": a}}, greedy,
                         use_tqdm=False)[0]  # fmt: skip
    s = engine.stats()
    assert s["prefill_tokens_saved"] == (len(again.prompt_token_ids) - 1) // BS * BS > offset
    assert s["mm_images_encoded"] == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids

    # LLM.chat: one placeholder per image before the text; generate's reply on the ids.
    parts = [{"type": "image_pil", "image_pil": b}, {"type": "text", "text": "What is this?"}]
    chat = llm.chat([{"role": "user", "content": parts}], greedy, use_tqdm=False,
                    chat_template=TINY_CHAT_TEMPLATE)[0]  # fmt: skip
    rendered = f"<|user|>{PH}\nWhat is this?\n<|assistant|>"
    ids = llm.get_tokenizer().encode(rendered, add_special_tokens=False)
    ref = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": b}}, greedy,
                       use_tqdm=False)[0]  # fmt: skip
    assert chat.prompt == rendered and chat.outputs[0].token_ids == ref.outputs[0].token_ids
    text, bound = image_prompt_info(d, llm.get_tokenizer())
    assert (text, bound) == (PH, 64)
    assert len(ref.prompt_token_ids) - len(ids) <= bound - 1

    buf = io.BytesIO()
    b.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    async_engine = AsyncLLMEngine.from_llm(llm)
    app = build_app(async_engine, ["m"], model_path=str(d), chat_template=TINY_CHAT_TEMPLATE)
    server, thread, base = serve_in_thread(app)
    try:
        client = openai.OpenAI(api_key="unused", base_url=base + "/v1", timeout=120,
                               max_retries=0)  # fmt: skip
        r = client.chat.completions.create(
            model="m", max_tokens=6, temperature=0.0,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is this?"}]}],
        )  # fmt: skip
        assert r.choices[0].message.content == chat.outputs[0].text
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        async_engine.shutdown()


@pytest.mark.slow  # an engine core process of its own: ~40 s of CPU
def test_engine_core_process_serves_chat_images(qwen2vl):
    """Through the engine core process (MPEngineClient: the API process sends the image
    bytes, the core expands, encodes and keeps the M-RoPE deltas): the chat answer is
    transformers' greedy continuation of the same ids (chat text has no <s>)."""
    import asyncio
    import base64
    import io

    import httpx

    from pagedjax.engine.core_client import MPEngineClient
    from pagedjax.engine.detokenizer import IncrementalDetokenizer
    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.llm import engine_config
    from pagedjax.entrypoints.openai.api_server import build_app
    from pagedjax.tokenizer import load_tokenizer
    from tests.model_helpers import TINY_CHAT_TEMPLATE

    d, model, processor = qwen2vl
    a = _image(9, SIZES[1])
    buf = io.BytesIO()
    a.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    rendered = f"<|user|>{PH}\nWhat is this?\n<|assistant|>"
    ids, want, _ = _hf_greedy(model, processor, rendered, [a], GREEDY_TOKENS,
                              add_special_tokens=False)  # fmt: skip
    assert ids[0] != 1  # no <s>, as the server's chat tokenization
    client = MPEngineClient(engine_config(model=str(d), max_num_batched_tokens=16,
                                          block_size=BS, num_gpu_blocks_override=64,
                                          max_model_len=160, warmup="none"))  # fmt: skip
    engine = AsyncLLMEngine(client)
    app = build_app(engine, ["m"], model_path=str(d), chat_template=TINY_CHAT_TEMPLATE)
    parts = [{"type": "image_url", "image_url": {"url": url}},
             {"type": "text", "text": "What is this?"}]  # fmt: skip
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": GREEDY_TOKENS,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=300) as c:  # fmt: skip
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

    try:
        got = asyncio.run(main())
    finally:
        engine.shutdown()
    detok = IncrementalDetokenizer(load_tokenizer(d), [])
    for t in want:
        detok.append(t)
    assert got["choices"][0]["message"]["content"] == detok.text
    assert got["usage"]["prompt_tokens"] == len(ids)
