"""The structured-output constraint starts after the reasoning (issue 33; vLLM's
``structured_outputs_config.enable_in_reasoning=False``, docs/structured_outputs.md).

The engine tests run a *scripted* tiny llama: its attention and MLP outputs are zero, so
the next token depends only on the current one (a bigram table written into the
embedding and the LM head), and its byte-level tokenizer has ``<think>`` and ``</think>``
as single added tokens. Greedy from a prompt ending in ``?`` it writes
``<think>hm</think>`` and then prefers ``Z``: every token of that is one the tests'
constraints forbid, so the output shows exactly where the mask applied."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("xgrammar")

from pagedjax import LLM, SamplingParams  # noqa: E402
from pagedjax.sampling import StructuredOutputsParams as SO  # noqa: E402
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
REGEX = "[ab]{2}"
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


def _llm(model_dir, steps: int | str = "auto", **so_config) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", block_size=8, max_model_len=64,
               max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=64,
               seed=0, num_scheduler_steps=steps,
               structured_outputs_config=so_config)  # fmt: skip


@pytest.fixture(scope="module")
def llm(model_dir):
    return _llm(model_dir, reasoning_parser="deepseek_r1")


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def _run(llm: LLM, prompts: dict[str, list[int]], so: SO, **kw) -> dict:
    kw.setdefault("temperature", 0.0)
    params = SamplingParams(max_tokens=16, seed=5, structured_outputs=so, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], params,
                        use_tqdm=False)  # fmt: skip
    return {k: o.outputs[0] for k, o in zip(prompts, outs, strict=True)}


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


# ---------------------------------------------------------------- the engine


def test_constraint_starts_after_the_reasoning(llm) -> None:
    """(a) the thinking is unconstrained: <think>, h, m are all outside [ab]{2};
    (b) after </think> the output follows the regex (its tag not fed to the grammar);
    (d) a prompt that already ended the reasoning is constrained from token one; a
    prompt that reopened it is not. Greedy and seeded."""
    tok = llm.get_tokenizer()
    think, end = tok.hf_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    prompts = {"open": _ids(llm, "Q?"), "ended": _ids(llm, "Q<think></think>"),
               "reopened": _ids(llm, "</think>Q<think>?")}  # fmt: skip
    for temperature in (0.0, 1.0):
        out = _run(llm, prompts, SO(regex=REGEX), temperature=temperature)
        o = out["open"]
        assert o.token_ids[:4] == [think, *_ids(llm, "hm"), end], o.token_ids
        assert o.text.startswith("<think>hm</think>")
        assert re.fullmatch(REGEX, o.text.removeprefix("<think>hm</think>")), o.text
        assert o.finish_reason == "stop" and o.stop_reason is None  # EOS, where allowed
        assert re.fullmatch(REGEX, out["ended"].text), out["ended"].text
        assert out["reopened"].text.startswith("<think>hm</think>")
    assert llm.llm_engine.stats()["structured_host_steps"] > 0


def test_enable_in_reasoning_keeps_the_constraint_from_token_one(model_dir) -> None:
    """(c) enable_in_reasoning=True (and no parser at all): constrained from the first
    token, so the model's <think> is forbidden."""
    for cfg in ({"reasoning_parser": "deepseek_r1", "enable_in_reasoning": True}, {}):
        llm = _llm(model_dir, **cfg)
        out = _run(llm, {"open": _ids(llm, "Q?")}, SO(regex=REGEX))["open"]
        assert re.fullmatch(REGEX, out.text), (cfg, out.text)


@pytest.mark.tier2  # two more engines (device FSM, jump-forward): ~10 s of compiling
def test_device_fsm_and_jump_forward_respect_the_reasoning(model_dir, llm) -> None:
    """The device FSM row has no state while it thinks and needs the host; from
    </think> on its table applies, in the K-step loop too. Jump-forward forces nothing in
    the thinking, and after </think> forces the regex's fixed `x=`. Tokens equal the
    host path's."""
    prompts = {"open": _ids(llm, "Q?"), "ended": _ids(llm, "Q<think></think>")}
    fixed = SO(regex="x=[ab]")
    long = SO(regex="[ab]{12}")  # long enough after </think> for fused loops
    want = {so.regex: _run(llm, prompts, so) for so in (long, fixed)}
    fsm = _llm(model_dir, steps=4, reasoning_parser="deepseek_r1", device_fsm=True)
    for so in (long, fixed):
        got = _run(fsm, prompts, so)
        assert {k: v.token_ids for k, v in got.items()} == {
            k: v.token_ids for k, v in want[so.regex].items()}
    stats = fsm.llm_engine.stats()
    assert stats["structured_device_fsm"] >= 4 and stats["multi_step_loops"] > 0, stats
    assert re.fullmatch("<think>hm</think>[ab]{12}", want[long.regex]["open"].text)
    jf = _llm(model_dir, reasoning_parser="deepseek_r1", jump_forward=True)
    got = _run(jf, prompts, fixed)
    assert {k: v.token_ids for k, v in got.items()} == {
        k: v.token_ids for k, v in want[fixed.regex].items()}
    assert got["open"].text.endswith("</think>x=a") or got["open"].text.endswith("</think>x=b")
    assert jf.llm_engine.stats()["jump_forward_tokens"] >= 2


# ---------------------------------------------------------------- the server (last: it
# takes over the module's LLM)


def test_server_reasoning_content_then_valid_json(llm, model_dir) -> None:
    """--reasoning-parser deepseek_r1 with response_format json_schema: the thinking in
    reasoning_content, valid JSON in content (streamed and not)."""
    from openai import OpenAI

    from pagedjax.entrypoints.async_engine import AsyncLLMEngine
    from pagedjax.entrypoints.openai.api_server import build_app
    from tests.engine_helpers import serve_in_thread

    engine = AsyncLLMEngine.from_llm(llm)
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
