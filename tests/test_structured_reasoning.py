"""The structured-output constraint starts after the reasoning (issue 33; vLLM's
``structured_outputs_config.enable_in_reasoning=False``, docs/structured_outputs.md):
the rule and the gate without an engine, and the server over a *scripted* tiny llama
(the engine's own tests are in test_structured_outputs.py, on the same kind of model).

The server's model is an HF checkpoint whose attention and MLP outputs are zero, so the
next token depends only on the current one (a bigram table written into the embedding
and the LM head); its byte-level tokenizer has ``<think>`` and ``</think>`` as added
tokens and a DeepSeek-R1-style template that opens ``<think>`` in the prompt. Greedy it
writes ``hm</think>`` and then prefers ``Z``, which the JSON schema forbids."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("xgrammar")

from pagedjax import LLM  # noqa: E402
from pagedjax.structured.reasoning import (  # noqa: E402
    GatedGuide,
    ReasoningGate,
    ThinkTags,
    reasoning_ended_ids,
)
from tests.model_helpers import make_tiny_hf_model, save_tiny_tokenizer  # noqa: E402

# DeepSeek-R1's template shape: the generation prompt opens the think block itself.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)
NAME = "tiny-think"


def _bigram_model(directory, tok) -> None:
    """The tiny llama with zero attention / MLP outputs and a scripted bigram table:
    ? -> <think> -> h -> m -> </think> -> Z -> Z, and the chat prompt's last byte
    (newline) -> h. Logit margin ~80 between a scripted successor and anything else."""
    import torch

    model = make_tiny_hf_model("llama")
    ids = {c: tok.convert_tokens_to_ids(tok.tokenize(c))[0] for c in "?hmZ\n"}
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    script = [("?", think), (think, "h"), ("\n", "h"), ("h", "m"), ("m", end), (end, "Z"),
              ("Z", "Z")]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.randn(emb.shape, generator=gen))
        head = model.lm_head.weight
        head.copy_(0.01 * torch.randn(head.shape, generator=gen))
        for a, b in script:
            a, b = ids.get(a, a), ids.get(b, b)
            head[b] += 10.0 * emb[a] / emb[a].norm()
    model.save_pretrained(str(directory))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("think_model")
    tok = save_tiny_tokenizer(d, TEMPLATE)
    tok.add_tokens(["<think>", "</think>"])  # ordinary added tokens, as Qwen3's
    tok.save_pretrained(str(d))
    _bigram_model(d, tok)
    return d


def _llm(model_dir, **so_config) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", block_size=8, max_model_len=64,
               max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=64,
               seed=0, structured_outputs_config=so_config)  # fmt: skip


# ---------------------------------------------------------------- the rule, no engine


def test_gate_and_gated_guide_multi_token_tags() -> None:
    """A multi-token end tag, the gate's tail, and a GatedGuide's rollback across it."""
    gate = ReasoningGate([7, 8, 9], max_rollback=3)
    assert [gate.feed(t) for t in [7, 8, 1, 7, 8]] == [False] * 5 and gate.open
    assert gate.feed(9) and not gate.open  # 7 8 9 ends it; 7 8 1 did not
    gate.unfeed(2)
    assert gate.open and gate.feed(8) is False and gate.feed(9)
    with pytest.raises(ValueError, match="max_rollback"):
        ReasoningGate([9]).unfeed(1)
    for _ in range(100):  # the tail stays bounded
        ReasoningGate([1, 2]).feed(5)

    class Counter:  # a matcher that accepts only 5s and counts them
        backend = "test"

        def __init__(self):
            self.n = 0

        def accept(self, t):
            self.n += t == 5
            return t == 5

        def fill_mask(self, out):
            out.fill(0)
            out[0] = 1 << 5

        def is_terminated(self):
            return False

        def rollback(self, k):
            self.n -= k

        def jump_forward(self):
            return []

    inner = Counter()
    g = GatedGuide(inner, ReasoningGate([8, 9], max_rollback=4))
    mask = np.zeros(2, np.int32)
    g.fill_mask(mask)
    assert (mask == -1).all() and g.accept(3) and g.accept(8) and g.in_reasoning
    assert g.accept(9) and not g.in_reasoning and inner.n == 0  # the tag is not fed
    g.fill_mask(mask)
    assert mask.tolist() == [32, 0] and not g.accept(3) and g.accept(5) and inner.n == 1
    g.rollback(2)  # the 5 from the matcher, the 9 from the reasoning: open again
    assert inner.n == 0 and g.in_reasoning and g.jump_forward() == []


def test_prompt_rule_and_the_server_uses_the_same_function() -> None:
    from pagedjax.config import StructuredOutputsConfig as C
    from pagedjax.entrypoints.openai import reasoning

    assert reasoning.reasoning_ended_ids is reasoning_ended_ids  # one rule, moved down

    class Tok:
        def encode(self, text, add_special_tokens=True):
            return {"<think>": [1], "</think>": [2, 3]}[text]

    tags = ThinkTags.for_config(C(reasoning_parser="qwen3"), Tok())
    assert tags == ThinkTags((1,), (2, 3))
    assert tags.gate([5, 1, 6]) is not None and tags.gate([]) is not None
    assert tags.gate([1, 2, 3, 4]) is None  # qwen3 enable_thinking=false: ended
    assert tags.gate([1, 2, 3, 1]) is not None  # a later start reopens it
    assert ThinkTags.for_config(C(), Tok()) is None
    assert ThinkTags.for_config(C(reasoning_parser="qwen3", enable_in_reasoning=True),
                                Tok()) is None  # fmt: skip
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ThinkTags.for_config(C(reasoning_parser="granite"), Tok())


# ---------------------------------------------------------------- the server


@pytest.mark.tier2  # an HF checkpoint, its LLM and a server: ~20 s cold
def test_server_reasoning_content_then_valid_json(model_dir) -> None:
    """--reasoning-parser deepseek_r1 with response_format json_schema: the thinking in
    reasoning_content, valid JSON in content (streamed and not)."""
    from openai import OpenAI

    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.openai.api_server import build_app
    from tests.engine_helpers import serve_in_thread

    engine = AsyncLLMEngine.from_llm(_llm(model_dir, reasoning_parser="deepseek_r1"))
    server, thread, url = serve_in_thread(build_app(engine, [NAME], model_path=str(model_dir),
                                                    reasoning_parser="deepseek_r1"))  # fmt: skip
    try:
        client = OpenAI(api_key="unused", base_url=url + "/v1", timeout=120, max_retries=0)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False}  # fmt: skip
        kw = dict(model=NAME, messages=[{"role": "user", "content": "ok?"}], temperature=0,
                  max_tokens=30,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "r", "schema": schema}},
                  extra_body={"structured_outputs": {"disable_any_whitespace": True}})  # fmt: skip
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert msg.model_extra["reasoning_content"] == "hm", msg
        assert isinstance(json.loads(msg.content)["ok"], bool), msg.content
        assert r.choices[0].finish_reason == "stop"
        reasoning = content = ""
        for c in client.chat.completions.create(stream=True, **kw):
            if c.choices:
                reasoning += (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                content += c.choices[0].delta.content or ""
        assert (reasoning, content) == ("hm", msg.content)
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()


def test_drafts_checked_across_the_end_tag() -> None:
    """structured/drafts.check_drafts through a GatedGuide (xgrammar, the byte tokenizer
    with added think tags): drafts in the thinking are free, the grammar starts after
    </think>, the first refused draft truncates them, and the guide is rolled back."""
    from pagedjax.config import StructuredOutputsConfig
    from pagedjax.sampling import StructuredOutputsParams as SO
    from pagedjax.structured import StructuredOutputManager
    from pagedjax.structured.drafts import check_drafts
    from pagedjax.tokenizer import ByteTokenizer

    tok = ByteTokenizer(eos_token_id=2, bos_token_id=1, added_tokens={"<think>": 300,
                                                                      "</think>": 301})
    mgr = StructuredOutputManager(StructuredOutputsConfig(reasoning_parser="deepseek_r1"),
                                  tok, 512, [2])  # fmt: skip
    guide = mgr.guide(mgr.compile(SO(regex="[ab]{2}")), tok.encode("Q<think>"))
    assert isinstance(guide, GatedGuide)
    drafts = [ord("h"), 301, ord("a"), ord("b"), ord("Z")]
    out = np.zeros((len(drafts), 16), np.int32)
    now = np.zeros(16, np.int32)
    guide.fill_mask(now)
    assert check_drafts(guide, drafts, now, out) == 4  # Z refused

    def allowed(row):
        return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")))

    assert len(allowed(out[0])) == 512  # after h: still thinking, every token
    assert allowed(out[1]) == allowed(out[2]) == {ord("a"), ord("b")}  # after </think>, a
    assert allowed(out[3]) == {2}  # after "ab": only EOS
    assert guide.in_reasoning  # rolled back to where it was
    for t in drafts[:4]:
        assert guide.accept(t)
    assert not guide.accept(ord("a"))


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_drafts_refused_or_past_the_end_leave_the_matcher_usable(backend: str) -> None:
    """A refused draft (llguidance would enter an error state) and drafts past the
    grammar's end (EOS, then more) truncate the drafts; the matcher is rolled back intact."""
    from pagedjax.config import StructuredOutputsConfig
    from pagedjax.sampling import StructuredOutputsParams as SO
    from pagedjax.structured import StructuredOutputManager
    from pagedjax.structured.drafts import check_drafts
    from pagedjax.tokenizer import ByteTokenizer

    mgr = StructuredOutputManager(StructuredOutputsConfig(backend=backend),
                                  ByteTokenizer(2, 1), 512, [2])  # fmt: skip
    a, b, c = b"abc"
    for drafts, want in (([a, c], 1), ([a, b, a, b, c, 2, 5], 5), ([a, b, a], 3)):
        guide = mgr.guide(mgr.compile(SO(regex="(ab){2}c")))
        now, out = np.zeros(16, np.int32), np.zeros((len(drafts), 16), np.int32)
        guide.fill_mask(now)
        assert check_drafts(guide, drafts, now, out) == want, drafts
        assert all(guide.accept(t) for t in [a, b, a, b, c]), drafts

