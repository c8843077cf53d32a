"""Images through the engine end to end (engine/multimodal.py): ``LLM(model=<LLaVA dir>)
.generate({"prompt": ..., "multi_modal_data": {"image": ...}})`` against transformers'
LlavaProcessor + LlavaForConditionalGeneration.generate (greedy), on a tiny random
checkpoint written by transformers, with chunked prefill cutting images and an encoder
cache too small to keep them; prefix caching that never shares one image's KV with
another; and the refusals (text-only model, limit_mm_per_prompt, placeholder counts)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax import LLM, SamplingParams
from pagedjax.engine.multimodal import expand_placeholders, identity_ids
from tests.model_helpers import save_tiny_hf_model, save_tiny_tokenizer

IMAGE = 259  # "<image>": the byte-level tiny tokenizer's ids end at 258
N = 16  # image tokens: (32 / 8)^2 patches, CLS dropped ("default")
BS = 8  # block size
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
# 31 tokens (<s> + 30 bytes) before the image: its first 3 blocks are text only.
LONG = "A chat between friends. USER: <image>\nDescribe it. ASSISTANT:"
ARGS = dict(block_size=BS, num_gpu_blocks_override=64, max_num_seqs=2, max_model_len=128,
            warmup="none")  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _image(seed: int, size=(40, 30)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), np.uint8))


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """(directory, torch model, LlavaProcessor) of a tiny random LLaVA: CLIP 32 px / patch
    8, 2 layers; Llama text model, hidden 32, 1 layer; the byte tokenizer + "<image>"."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    d = tmp_path_factory.mktemp("llava_engine")
    tok = save_tiny_tokenizer(d, chat_template=None)
    tok.add_tokens(["<image>"], special_tokens=True)
    assert tok.convert_tokens_to_ids("<image>") == IMAGE
    tok.save_pretrained(str(d))
    proc = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    proc.save_pretrained(str(d))
    torch.manual_seed(0)
    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=2,
                              initializer_range=0.15)  # fmt: skip
    text = LlamaConfig(vocab_size=272, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2, initializer_range=0.15)  # fmt: skip
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE,
                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    model = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # image features on the text embeddings' scale, random biases
        for name, p in model.named_parameters():
            if "multi_modal_projector" in name and p.ndim > 1:
                p.normal_(0.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(d))
    processor = LlavaProcessor(image_processor=proc, tokenizer=tok, patch_size=8,
                               vision_feature_select_strategy="default",
                               num_additional_image_tokens=1)  # fmt: skip
    return d, model, processor


def _hf_greedy(llava, prompt: str, images: list, max_tokens: int = 6) -> list[int]:
    """transformers' processor (expansion, pixels) and greedy generate, one prompt."""
    _, model, processor = llava
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _mm(prompt: str, images: list) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


@pytest.fixture(scope="module")
def llm(llava):
    """One engine for the module (compiles are the cost): 16-token steps, so chunked
    prefill cuts 16-token images; an encoder cache of one image, so images are evicted
    between the chunks of their prompts and encoded again; at most 2 images a prompt."""
    return LLM(model=str(llava[0]), max_num_batched_tokens=16, mm_encoder_cache_size=N,
               limit_mm_per_prompt={"image": 2}, **ARGS)  # fmt: skip


def test_generate_with_images_equals_transformers_and_prefix_cache(llava, llm):
    """A batch of two different images under one text, a text-only prompt and a
    two-image prompt gives transformers' greedy tokens, with images cut across steps and
    evicted from the encoder cache between them; then a new image under the same text
    hits the prefix cache only for the text blocks before the image, and the same image
    and text again hits every full block but the last token's."""
    engine = llm.llm_engine
    engine.reset_stats()
    a, b, c = _image(1), _image(2), _image(3)
    two = "USER: <image> and <image>\nCompare. ASSISTANT:"
    reqs = [(LONG, [a]), (LONG, [b]), ("USER: hello there ASSISTANT:", []), (two, [c, a])]
    outs = llm.generate([_mm(p, im) if im else p for p, im in reqs], GREEDY, use_tqdm=False)
    want = [_hf_greedy(llava, p, im) for p, im in reqs]
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want
    assert got[0] != got[1]  # the image matters (else the comparison proves little)
    s = engine.stats()
    assert s["mm_split_image_slices"] > 0  # chunked prefill did cut images
    assert s["mm_encoder_cache_evictions"] > 0 and s["mm_images_encoded"] > 3  # a again
    # Outputs report the real (expanded) prompt ids, not the identity ids.
    ids = outs[0].prompt_token_ids
    assert ids.count(IMAGE) == N and min(ids) >= 0

    # A new image under the same text: only the text blocks before the image hit.
    # (Not image a again here: a and b were prefilled together, so the host hint keeps
    # b's copies of the shared text blocks and a's image blocks' parent link fails
    # verification: a limit of the hint, docs/multimodal.md.)
    d_img = _image(4)
    engine.reset_stats()
    new = llm.generate([_mm(LONG, [d_img])], GREEDY, use_tqdm=False)[0]
    offset = ids.index(IMAGE)
    assert engine.stats()["prefix_cache_hit_tokens"] == offset // BS * BS == 24
    assert new.outputs[0].token_ids == _hf_greedy(llava, LONG, [d_img])
    # The same image and text again: every full block hits but the last token's.
    engine.reset_stats()
    again = llm.generate([_mm(LONG, [d_img])], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == new.outputs[0].token_ids
    s = engine.stats()
    assert s["prefix_cache_hit_tokens"] == (len(ids) - 1) // BS * BS == 64
    assert s["mm_images_encoded"] == 0  # the image's positions were all cached KV
    assert not engine.has_unfinished_requests()


def test_refusals_leave_the_engine_usable(llava, llm, tmp_path):
    engine = llm.llm_engine
    a = _image(7)
    with pytest.raises(ValueError, match="limit_mm_per_prompt allows 2"):
        llm.generate([_mm("<image><image><image>", [a, a, a])], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 image placeholder token"):
        llm.generate(["USER: hi ASSISTANT:", _mm("USER: <image><image> hi", [a])], GREEDY,
                     use_tqdm=False)  # fmt: skip
    with pytest.raises(ValueError, match="1 image placeholder token.*for 0 image"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="modality 'video'"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"video": [a]}}, use_tqdm=False)
    with pytest.raises(ValueError, match="cannot decode"):
        llm.generate(_mm(PROMPT, [b"not an image"]), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs with images"):
        llm.generate(_mm(PROMPT, [a]), SamplingParams(prompt_logprobs=1), use_tqdm=False)
    assert not engine.has_unfinished_requests()  # the batch's valid prompt was withdrawn
    # A prompt already expanded (token ids), with the image as encoded bytes, is taken.
    ids = llava[2](text=PROMPT, images=[a], return_tensors="np")["input_ids"][0].tolist()
    buf = io.BytesIO()
    a.save(buf, format="PNG")
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": buf.getvalue()}},
                       GREEDY, use_tqdm=False)[0]  # fmt: skip
    assert out.outputs[0].token_ids == _hf_greedy(llava, PROMPT, [a])

    text_dir = tmp_path / "text"
    save_tiny_hf_model("llama", text_dir)
    save_tiny_tokenizer(text_dir)
    text_llm = LLM(model=str(text_dir), **ARGS)
    with pytest.raises(ValueError, match="takes no images"):
        text_llm.generate(_mm(PROMPT, [a]), GREEDY, use_tqdm=False)
    assert not text_llm.llm_engine.has_unfinished_requests()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=10), st.integers(1, 4))
def test_expansion_and_identity_ids_properties(prompt, n):
    """One placeholder (3) per image expands to n copies; an expanded prompt passes
    unchanged; identity ids are negative, never -1, and differ between keys."""
    k = prompt.count(3)
    rep = [[3] * n] * k  # LLaVA's replacement: n copies of the placeholder
    ids = expand_placeholders(prompt, 3, rep, n)
    assert len(ids) == len(prompt) + k * (n - 1)
    if k:
        assert expand_placeholders(ids, 3, rep, n) == ids
        with pytest.raises(ValueError, match="placeholder"):
            expand_placeholders(prompt, 3, [*rep, [3] * n], n)
    x, y = identity_ids(12345, 64), identity_ids(12346, 64)
    assert (x <= -2).all() and (x >= -(2**31 - 1)).all()
    assert (x != y).all() and len(set(x.tolist())) == 64



@pytest.mark.tier2  # second tier (docs/testing.md): 29 s cold; generate with images stays
def test_llm_chat_with_image_parts_equals_generate(llm):
    """LLM.chat takes vLLM's image parts (a data: URL and a PIL image): each message's
    images become placeholders before its text, and the reply is generate's on the
    rendered ids; an http URL is a ValueError."""
    import base64

    from tests.model_helpers import TINY_CHAT_TEMPLATE

    a, b = _image(10), _image(11)
    buf = io.BytesIO()
    a.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}},
             {"type": "image_pil", "image_pil": b}, {"type": "text", "text": "Compare."}]
    got = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False,
                   chat_template=TINY_CHAT_TEMPLATE)[0]  # fmt: skip
    rendered = "<|user|><image>\n<image>\nCompare.\n<|assistant|>"
    ids = llm.get_tokenizer().encode(rendered, add_special_tokens=False)
    want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [a, b]}},
                        GREEDY, use_tqdm=False)[0]  # fmt: skip
    assert got.prompt == rendered
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    parts[0] = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    with pytest.raises(ValueError, match="not fetched"):
        llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False,
                 chat_template=TINY_CHAT_TEMPLATE)  # fmt: skip
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.tier2
def test_engine_core_process_serves_chat_images(llava):
    """Through the engine core process protocol (MPEngineClient: the API process sends
    the image bytes, the core expands and encodes): the chat answer's tokens are
    transformers' greedy tokens for the same ids (chat text is tokenized without <s>)."""
    import asyncio
    import base64

    import httpx

    from pagedjax.engine.core_client import MPEngineClient
    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.llm import engine_config
    from pagedjax.entrypoints.openai.api_server import build_app
    from tests.model_helpers import TINY_CHAT_TEMPLATE

    a = _image(9)
    buf = io.BytesIO()
    a.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    rendered = "<|user|><image>\nWhat is this?\n<|assistant|>"
    _, model, processor = llava
    inputs = processor(text=rendered, images=[a], return_tensors="pt", add_special_tokens=False)
    assert inputs["input_ids"][0, 0] != 1  # no <s>, as the server's chat tokenization
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    want = ref[0, inputs["input_ids"].shape[1]:].tolist()

    client = MPEngineClient(engine_config(model=str(llava[0]), **ARGS))
    engine = AsyncLLMEngine(client)
    app = build_app(engine, ["m"], model_path=str(llava[0]), chat_template=TINY_CHAT_TEMPLATE)
    parts = [{"type": "image_url", "image_url": {"url": url}},
             {"type": "text", "text": "What is this?"}]  # fmt: skip
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 6,
            "temperature": 0.0, "logprobs": True}  # fmt: skip

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=300) as c:  # fmt: skip
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

    try:
        choice = asyncio.run(main())
    finally:
        engine.shutdown()
    # transformers' tokens as pagedjax's detokenizer renders them (the byte-level tiny
    # tokenizer's random bytes are not valid UTF-8: a plain decode differs).
    from pagedjax.engine.detokenizer import IncrementalDetokenizer
    from pagedjax.tokenizer import load_tokenizer

    detok = IncrementalDetokenizer(load_tokenizer(llava[0]), [])
    for t in want:
        detok.append(t)
    assert choice["message"]["content"] == detok.text
    assert len(choice["logprobs"]["content"]) == len(want)


def test_server_chat_with_data_url_image_equals_generate(llava, llm, tmp_path):
    """The OpenAI chat endpoint (in process, over this module's engine: it runs last)
    takes an image_url part with a data: URL, an http URL (a local server) or a file URL
    under --allowed-local-media-path, and answers the text LLM.generate gives for the
    rendered prompt (one placeholder per image before the text, vLLM's placement); a host
    off --allowed-media-domains, a file outside the allowed directory, bad base64 and
    undecodable bytes are 400s and change nothing."""
    import asyncio
    import base64

    import httpx

    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.openai.api_server import build_app
    from pagedjax.entrypoints.openai.media import MediaFetchPolicy
    from tests.media_server import serve_media
    from tests.model_helpers import TINY_CHAT_TEMPLATE

    a = _image(8)
    buf = io.BytesIO()
    a.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    (tmp_path / "a.png").write_bytes(buf.getvalue())
    rendered = "<|user|><image>\nWhat is this?\n<|assistant|>"
    # Chat prompts are tokenized without <s> (the template writes special tokens).
    ids = llm.get_tokenizer().encode(rendered, add_special_tokens=False)
    want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": a}}, GREEDY,
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    engine = AsyncLLMEngine.from_llm(llm)
    media = MediaFetchPolicy(allowed_local_media_path=str(tmp_path),
                             allowed_media_domains=("127.0.0.1",))  # fmt: skip
    app = build_app(engine, ["m"], model_path=str(llava[0]), chat_template=TINY_CHAT_TEMPLATE,
                    media=media)  # fmt: skip

    def chat(image_url: str) -> dict:
        parts = [{"type": "image_url", "image_url": {"url": image_url}},
                 {"type": "text", "text": "What is this?"}]  # fmt: skip
        return {"messages": [{"role": "user", "content": parts}], "max_tokens": 6,
                "temperature": 0.0}  # fmt: skip

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=120) as c:  # fmt: skip
            for good in (url, f"{base}/a.png", f"file://{tmp_path}/a.png"):
                r = await c.post("/v1/chat/completions", json=chat(good))
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == want.text
            for bad_url, msg in [("https://example.com/cat.png", "--allowed-media-domains"),
                                 (f"file://{tmp_path}/../x.png", "outside"),
                                 ("data:image/png;base64,@@@", "not valid base64"),
                                 ("data:image/png;base64,aGVsbG8=", "cannot decode")]:
                r = await c.post("/v1/chat/completions", json=chat(bad_url))
                assert r.status_code == 400 and msg in r.json()["error"]["message"], r.text

    try:
        with serve_media(buf.getvalue()) as base:
            asyncio.run(main())
    finally:
        engine.shutdown()


@pytest.mark.tier2
def test_encoder_budget_spreads_a_large_request_while_others_decode(llava):
    """max_num_encoder_input_tokens = one image's tokens: a three-image request arriving
    while a text request decodes is encoded one image per step at admission (held until
    all three are cached), no step encodes more than the budget, the text request keeps
    decoding meanwhile, and both outputs are transformers' greedy tokens."""
    llm = LLM(model=str(llava[0]), max_num_batched_tokens=64, mm_encoder_cache_size=4 * N,
              limit_mm_per_prompt={"image": 3}, max_num_encoder_input_tokens=N,
              **ARGS)  # fmt: skip
    engine = llm.llm_engine
    engine.reset_stats()
    three = "USER: <image> <image> <image> Which? ASSISTANT:"
    imgs = [_image(21), _image(22), _image(23)]
    text = "USER: count slowly ASSISTANT:"
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    engine.add_request("text", text, sp)
    for _ in range(2):  # the text request is prefilled and decoding
        engine.step()
    engine.add_request("images", _mm(three, imgs), SamplingParams(temperature=0.0, max_tokens=6))
    progress, outs = [], {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == "text":
                progress.append(len(o.outputs[0].token_ids))
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    s = engine.stats()
    assert s["mm_max_step_encoder_tokens"] <= N  # never more than the budget in a step
    assert s["mm_admission_holds"] >= 2  # held while its 3 images were encoded
    assert s["mm_images_encoded"] == 3  # each once: the admission's encodes were kept
    assert outs["text"] == _hf_greedy(llava, text, [], max_tokens=8)
    assert outs["images"] == _hf_greedy(llava, three, imgs)
    assert len(progress) >= 3  # the text request decoded during the holds


@pytest.mark.tier2  # second tier (docs/testing.md): the warm-up compiles ~20 programs
def test_warm_up_compiles_the_image_path(llava):
    """warmup="all" on a LLaVA model also compiles the encoder (1 and 2 images: the cache
    holds 2) and the image step program of every (T, S) pair: the first image requests
    (one image; two images met in one step) then trace and compile nothing, the XLA
    compile count included, and give transformers' tokens. With warmup="none" nothing
    of the image path is compiled at start; the same requests then compile both."""
    from pagedjax.engine.engine_stats import backend_compilations

    args = dict(ARGS, max_num_batched_tokens=32)  # encoder cache: 32 // 16 = 2 images
    two = "USER: <image> and <image>\nCompare. ASSISTANT:"
    reqs = [(LONG, [_image(31)]), (two, [_image(32), _image(33)])]
    prompts = [_mm(p, im) for p, im in reqs]
    warm = LLM(model=str(llava[0]), **dict(args, warmup="all")).llm_engine
    assert sorted(warm.mm.vision.trace_count) == [(1, 3, 32, 32, 2), (2, 3, 32, 32, 2)]
    pairs = {k[:2] for k in warm.runner.programs if "mm" in k}
    assert pairs and pairs == {k[:2] for k in warm.runner.programs if "mm" not in k}
    before, xla = warm.stats()["compilations"], backend_compilations()[0]
    got = []
    for i, prompt in enumerate(prompts):  # one after the other: the second's images meet
        warm.add_request(str(i), prompt, GREEDY)
        while warm.has_unfinished_requests():
            got += [list(o.outputs[0].token_ids) for o in warm.step() if o.finished]
    assert got == [_hf_greedy(llava, p, im) for p, im in reqs]
    s = warm.stats()
    assert s["mm_images_encoded"] == 3 and s["mm_encoder_cache_images"] == 2
    assert s["compilations"] == before and backend_compilations()[0] == xla
    # Control (the checks above can fail): an engine without warm-up compiles them then.
    cold = LLM(model=str(llava[0]), **args).llm_engine
    assert cold.mm.encoder_compilations == 0 and not cold.runner.programs
    assert not any("mm" in k for k in cold.runner.trace_count)
    for i, prompt in enumerate(prompts):
        cold.add_request(str(i), prompt, GREEDY)
        while cold.has_unfinished_requests():
            cold.step()
    assert cold.mm.encoder_compilations == 2  # 1 and 2 images
    assert any("mm" in k for k in cold.runner.trace_count)
