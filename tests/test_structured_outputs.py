"""Structured outputs (issue 33): the grammar backends through the manager, and the
engine's constrained decoding on a tiny random model with the byte tokenizer (ids
0..255 are the bytes, so grammars compile in milliseconds); outputs must parse / match
whatever the random model prefers."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")

from pagedjax.config import (  # noqa: E402
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from pagedjax.engine.faults import fail_batch  # noqa: E402
from pagedjax.engine.llm_engine import LLMEngine  # noqa: E402
from pagedjax.engine.logit_controls import LogitControls  # noqa: E402
from pagedjax.model import preset_arch, random_params  # noqa: E402
from pagedjax.sampling import SamplingParams  # noqa: E402
from pagedjax.sampling import StructuredOutputsParams as SO  # noqa: E402
from pagedjax.structured import DEAD_END_REASON, StructuredOutputManager  # noqa: E402
from pagedjax.tokenizer import ByteTokenizer  # noqa: E402
from tests.engine_helpers import drain  # noqa: E402

ARCH = preset_arch("tiny-llama")  # vocab 512, EOS 2
EOS = ARCH.eos_token_id
TOK = ByteTokenizer(eos_token_id=EOS, bos_token_id=ARCH.bos_token_id)
SCHEMA = {
    "type": "object",
    "properties": {"b": {"enum": ["x", "y"]}, "c": {"type": "boolean"}},
    "required": ["b", "c"],
    "additionalProperties": False,
}
REGEX = r"[ab]{2}-\d"
CHOICES = ("yes", "no", "maybe")


def _manager(backend: str = "auto", **kw) -> StructuredOutputManager:
    return StructuredOutputManager(StructuredOutputsConfig(backend=backend, **kw), TOK,
                                   ARCH.vocab_size, [EOS])  # fmt: skip


def _allowed(guide) -> set[int]:
    m = np.zeros((ARCH.vocab_size + 31) // 32, np.int32)
    guide.fill_mask(m)
    return set(np.flatnonzero(np.unpackbits(m.view(np.uint8), bitorder="little")).tolist())


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_each_kind_compiles_and_masks(backend: str) -> None:
    mgr = _manager(backend)
    cases = [
        (SO(regex=REGEX), {ord("a"), ord("b")}),
        (SO(choice=list(CHOICES)), {ord("y"), ord("n"), ord("m")}),
        (SO(json=SCHEMA, disable_any_whitespace=True), {ord("{")}),
        (SO(json=json.dumps(SCHEMA)), {ord("{")}),  # schema as JSON text
        (SO(json_object=True, disable_any_whitespace=True), {ord("{")}),
        (SO(grammar='root ::= "x" root | "y"'), {ord("x"), ord("y")}),
        (SO(grammar='start: "q"+'), {ord("q")}),  # Lark
    ]
    for params, first in cases:
        compiled = mgr.compile(params)
        assert compiled.backend == backend
        guide = mgr.guide(compiled)
        got = _allowed(guide)
        assert got == first or (first <= got and params.json_object is None
                                and not params.disable_any_whitespace), params  # fmt: skip
    # EOS only where the grammar may end: after "ab-1", only EOS.
    guide = mgr.guide(mgr.compile(SO(regex=REGEX)))
    for ch in b"ab-":
        assert guide.accept(ch) and EOS not in _allowed(guide)
    assert guide.accept(ord("1")) and _allowed(guide) == {EOS}
    assert not mgr.guide(mgr.compile(SO(regex=REGEX))).accept(ord("z"))


@pytest.mark.parametrize("backend", ["auto", "xgrammar", "guidance"])
@pytest.mark.parametrize(
    "params, words",
    [
        (SO(regex="[a"), "regex"),
        (SO(json="{not json"), "not valid JSON"),
        (SO(json={"type": 5}), "json"),
        (SO(grammar="root ::= missing"), "grammar"),
    ],
)
def test_invalid_constraints_name_the_problem(backend: str, params: SO, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        _manager(backend).compile(params)


def test_backend_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    multiple = SO(json={"type": "object", "properties": {"n": {"type": "integer",
                                                               "multipleOf": 3}}})  # fmt: skip
    with pytest.raises(ValueError, match="multipleOf, which xgrammar does not enforce"):
        _manager("xgrammar").compile(multiple)
    assert _manager("auto").compile(multiple).backend == "guidance"  # vLLM's auto rule
    assert _manager("auto").compile(SO(regex=REGEX)).backend == "xgrammar"
    with pytest.raises(ValueError, match="whitespace_pattern"):
        _manager().compile(SO(regex="a", whitespace_pattern=r"[ ]?"))
    with pytest.raises(ValueError, match="structural_tag"):
        _manager("guidance").compile(SO(structural_tag='{"structures": [], "triggers": []}'))
    mgr = _manager()
    a, b = mgr.compile(SO(choice=["p", "q"])), mgr.compile(SO(choice=["p", "q"]))
    assert a is b and (mgr.stats.compiles, mgr.stats.cache_hits) == (1, 1)
    from pagedjax.structured import backend_xgrammar

    slow = backend_xgrammar.XgrammarBackend.compile
    monkeypatch.setattr(backend_xgrammar.XgrammarBackend, "compile",
                        lambda *a: time.sleep(0.5) or slow(*a))  # fmt: skip
    with pytest.raises(ValueError, match="took longer than compile_timeout_s"):
        _manager("xgrammar", compile_timeout_s=0.05).compile(SO(json=SCHEMA))


def test_config_keys() -> None:
    assert StructuredOutputsConfig.from_dict({"backend": "guidance"}).backend == "guidance"
    assert not StructuredOutputsConfig().jump_forward  # off by default (vLLM's tokens)
    assert StructuredOutputsConfig.from_dict({"jump_forward": True}).jump_forward
    with pytest.raises(ConfigError, match="unknown key structured_outputs_config.bakend"):
        StructuredOutputsConfig.from_dict({"bakend": "xgrammar"})
    with pytest.raises(ConfigError, match="not built in pagedjax"):
        StructuredOutputsConfig(backend="outlines")
    with pytest.raises(ConfigError, match="overlap_mask_fill: invalid value 'yes'"):
        StructuredOutputsConfig.from_dict({"overlap_mask_fill": "yes"})
    with pytest.raises(ConfigError, match="overlap_mask_fill: must be true, false or 'auto'"):
        StructuredOutputsConfig(overlap_mask_fill="yes")
    # "auto": masks filled while the forward runs on an accelerator, not on the CPU.
    for value, platform, want in (("auto", "cpu", False), ("auto", "gpu", True),
                                  (True, "cpu", True), (False, "tpu", False)):  # fmt: skip
        cfg = StructuredOutputsConfig(overlap_mask_fill=value)
        assert LogitControls(ARCH.vocab_size, TOK, cfg, {EOS}, platform).overlap_mask_fill is want


@functools.cache
def _engine(backend: str = "xgrammar", spec: bool = False, steps: int | str = "auto",
            jump: bool = False, blocks: int = 64, prefix: bool = False,
            fsm: bool = False, think: str = "", overlap: bool | str = "auto",
            warmup: str = "auto") -> LLMEngine:  # fmt: skip
    """think: "" (the random model), or the scripted thinking model (_think_params, THINK
    tokenizer) with reasoning_parser deepseek_r1 and enable_in_reasoning "off" / "on".
    overlap: StructuredOutputsConfig.overlap_mask_fill; warmup: EngineConfig.warmup (the
    suite's "auto" compiles nothing ahead)."""
    config = EngineConfig(
        model=ModelConfig(model="tiny-llama", max_model_len=64, seed=0),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=blocks,
                          enable_prefix_caching=prefix),  # fmt: skip
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, watermark=0.0,
                                  num_multi_steps=steps),  # fmt: skip
        speculative=SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3)
        if spec
        else None,
        structured_outputs=StructuredOutputsConfig(
            backend=backend, jump_forward=jump, device_fsm=fsm,
            reasoning_parser="deepseek_r1" if think else "", enable_in_reasoning=think == "on",
            overlap_mask_fill=overlap),
        warmup=warmup,
    )
    if think:
        return LLMEngine(ARCH, _think_params(), THINK, config)
    params = random_params(ARCH, seed=0, dtype=jnp.float32, std=0.15)
    return LLMEngine(ARCH, params, TOK, config)


def _requests(temperature: float) -> list:
    def p(so: SO, **kw) -> SamplingParams:
        kw.setdefault("max_tokens", 40)
        return SamplingParams(temperature=temperature, seed=7, structured_outputs=so, **kw)

    return [
        ("regex", "hello", p(SO(regex=REGEX))),
        ("choice", "pick one", p(SO(choice=list(CHOICES)))),
        ("json", "{", p(SO(json=SCHEMA, disable_any_whitespace=True))),
        ("object", "obj", p(SO(json_object=True, disable_any_whitespace=True), max_tokens=12)),
        # EOS pushed to the top: it may end the output only where the grammar accepts.
        ("eos", "eos", p(SO(regex="[ab]{3}"), logit_bias={EOS: 100.0})),
    ]


def _check_valid(out: dict) -> None:
    text = {k: v.outputs[0].text for k, v in out.items()}
    assert re.fullmatch(REGEX, text["regex"]), text
    assert text["choice"] in CHOICES
    doc = json.loads(text["json"])
    assert set(doc) == {"b", "c"} and doc["b"] in ("x", "y") and isinstance(doc["c"], bool)
    obj = out["object"].outputs[0]
    assert obj.text.startswith("{")  # 12 tokens may cut any JSON object short
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch("[ab]{3}", text["eos"]) and out["eos"].outputs[0].token_ids[-1] == EOS
    for k in ("regex", "choice", "json", "eos"):
        assert out[k].outputs[0].finish_reason == "stop", (k, out[k].outputs[0])


# One engine in the default tier (xgrammar, shared by the tests below); guidance's is tier 2.
@pytest.mark.parametrize("backend", ["xgrammar", pytest.param("guidance", marks=pytest.mark.tier2)])
def test_engine_outputs_are_valid(backend: str) -> None:
    engine = _engine(backend)
    plain = ("plain", "hello", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    alone = drain(engine, [plain])["plain"].outputs[0].token_ids
    for temperature in (0.0, 1.0):
        out = drain(engine, [*_requests(temperature), plain])
        _check_valid(out)
        assert {out[k].structured_output_backend for k in out if k != "plain"} == {backend}
        assert out["plain"].outputs[0].token_ids == alone  # other rows are unconstrained
    # One program per bucket: the masks are inputs of fixed shape, never a recompile.
    assert all(n == 1 for n in engine.runner.trace_count.values()), engine.runner.trace_count
    assert engine.stats()["structured_host_steps"] > 0


def test_mask_fill_overlap_equals_the_fused_step() -> None:
    """The grammar masks filled while the forward runs (forward and sampling as two
    programs) give the tokens and logprobs of the fused step with the masks filled before
    it, greedy and seeded; the fills are counted, and only the split engine overlaps them
    and compiles the halves (once per bucket)."""
    split, fused = _engine(overlap=True), _engine()  # "auto": fused on the CPU
    keys = ("structured_mask_fills", "structured_mask_fill_overlapped_s",
            "structured_mask_fill_hidden_s")  # fmt: skip
    before = {e: {k: e.stats()[k] for k in keys} for e in (split, fused)}
    for temperature in (0.0, 1.0):
        reqs = [(k, prompt, dataclasses.replace(p, logprobs=2))
                for k, prompt, p in _requests(temperature)]  # fmt: skip
        a, b = drain(split, reqs), drain(fused, reqs)
        _check_valid(a)
        for k in a:
            x, y = a[k].outputs[0], b[k].outputs[0]
            assert (x.token_ids, x.finish_reason, x.cumulative_logprob) == (
                y.token_ids, y.finish_reason, y.cumulative_logprob), k
            assert x.logprobs == y.logprobs, k
    s, f = ({k: e.stats()[k] - before[e][k] for k in keys} for e in (split, fused))
    assert s["structured_mask_fills"] == f["structured_mask_fills"] > 0
    assert s["structured_mask_fill_overlapped_s"] > 0 == f["structured_mask_fill_overlapped_s"]
    assert 0.0 <= s["structured_mask_fill_hidden_s"] <= s["structured_mask_fill_overlapped_s"]
    halves = split.runner.split_trace_count
    assert halves and all(n == 1 for n in halves.values()), halves
    assert not fused.runner.split_trace_count


def test_warm_up_compiles_the_split_step() -> None:
    """With overlap_mask_fill on, the warm-up compiles the step's two halves with the
    argument types a real split step passes: constrained requests afterwards trace
    nothing new (a half traced at serving time would count here)."""
    engine = _engine(overlap=True, warmup="decode")
    warmed = dict(engine.runner.split_trace_count)
    assert {k[0] for k in warmed} == {"forward", "sample"}, warmed
    drain(engine, _requests(0.0))
    assert engine.stats()["structured_mask_fill_overlapped_s"] > 0  # the split step ran
    assert engine.runner.split_trace_count == warmed


def test_a_failing_mask_fill_costs_only_its_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fill that raises between the split step's programs leaves the pool the forward
    returned in place (not a donated, deleted buffer): fail_batch aborts the batch and
    the next request runs as on a fresh engine."""
    engine = _engine(overlap=True)
    p = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=SO(regex=REGEX))
    want = drain(engine, [("before", "hello", p)])["before"].outputs[0].token_ids
    real, failed = engine.core.controls.fill_masks, []

    def fill_masks(dev, pending, running=None):
        if running is not None and not failed:
            failed.append(True)
            raise RuntimeError("fill failed")
        return real(dev, pending, running)

    monkeypatch.setattr(engine.core.controls, "fill_masks", fill_masks)
    engine.add_request("broken", "hello", p)
    with pytest.raises(RuntimeError, match="fill failed"):
        while engine.has_unfinished_requests():
            engine.step()
    assert not any(x.is_deleted() for x in jax.tree.leaves(engine.kv))
    assert fail_batch(engine, RuntimeError("fill failed"))[0] == ["broken"]
    assert drain(engine, [("after", "hello", p)])["after"].outputs[0].token_ids == want


def test_a_constraint_without_a_first_token_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A matcher whose start state allows no token: ValueError at add_request, nothing
    queued (n > 1 included, whose other samples would wait on a first token forever)."""
    engine = _engine()

    class NoStart:
        backend = "xgrammar"

        def fill_mask(self, out: np.ndarray) -> None:
            out.fill(0)

    monkeypatch.setattr(engine.core.controls.structured, "guide", lambda *a, **k: NoStart())
    p = SamplingParams(n=2, max_tokens=4, structured_outputs=SO(regex="ab"))
    with pytest.raises(ValueError, match="allows no token at its start"):
        engine.add_request("no-start", "x", p)
    assert not engine.has_unfinished_requests()


def test_dead_end_finishes_with_a_reason() -> None:
    engine = _engine()
    # ignore_eos: the grammar's forced EOS does not stop the output, and after it the
    # grammar allows nothing: the request finishes instead of sampling garbage.
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                       structured_outputs=SO(regex="ab"))  # fmt: skip
    out = drain(engine, [("dead", "x", p)])["dead"].outputs[0]
    assert out.token_ids == [ord("a"), ord("b"), EOS]
    assert (out.finish_reason, out.stop_reason) == ("stop", DEAD_END_REASON)


def test_n_samples_have_their_own_matchers() -> None:
    p = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=20,
                       structured_outputs=SO(regex=r"(cat|dog|bird)!"))  # fmt: skip
    out = drain(_engine(), [("n", "pets", p)])["n"]
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert re.fullmatch(r"(cat|dog|bird)!", o.text), o.text


def test_invalid_constraint_is_refused_at_add_request() -> None:
    engine = _engine()
    bad = SamplingParams(structured_outputs=SO(json={"type": "object", "properties": 3}))
    with pytest.raises(ValueError, match="json"):
        engine.add_request("bad", "x", bad)
    assert not engine.has_unfinished_requests()


@pytest.mark.tier2  # two more engines (speculative, K-step loop): ~20 s of compiling
def test_speculation_and_k_step_loop_compose() -> None:
    """Constrained rows keep the one-step path (with n-gram speculation they draft under
    their grammar: test_constrained_rows_draft_and_equal_plain_decoding); outputs equal
    plain decoding, and unconstrained rows beside them still speculate."""
    reqs = [*_requests(0.0),
            ("repeat", "abcabcabcabc", SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True)),
            # Static controls ride along in the K-step program and in verification.
            ("static", "abcabcabc", SamplingParams(temperature=0.0, max_tokens=24,
                                                   ignore_eos=True, logit_bias={ord("c"): 5.0},
                                                   allowed_token_ids=list(b"abcd")))]  # fmt: skip
    base = drain(_engine(), reqs)
    spec = _engine(spec=True)
    got = drain(spec, reqs)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {
        k: v.outputs[0].token_ids for k, v in base.items()
    }
    assert spec.stats()["spec_rows"] > 0  # the unconstrained row speculated
    loop = _engine(steps=4)
    got = drain(loop, reqs)
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {
        k: v.outputs[0].token_ids for k, v in base.items()
    }
    assert loop.multi_step.stats.skipped.get("structured_output", 0) > 0
    assert loop.stats()["multi_step_loops"] > 0  # once the constrained rows finished
    assert set(got["static"].outputs[0].token_ids) <= set(b"abcd")


def test_structural_tag_on_xgrammar() -> None:
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "boolean"}, "end": "</f>"}],
           "triggers": ["<f>"]}  # fmt: skip
    mgr = _manager()
    compiled = mgr.compile(SO(structural_tag=json.dumps(tag)))
    assert compiled.backend == "xgrammar"
    guide = mgr.guide(compiled)
    for ch in b"free text <f>true</f>":
        assert guide.accept(ch), chr(ch)
    with pytest.raises(ValueError, match="structural_tag"):
        mgr.compile(SO(structural_tag="{not json"))
    # vLLM's hermes tool-call tag (the server's tool_choice="required", tool_tags.py):
    # envelopes only, free JSON arguments for a tool without "strict": true
    from pagedjax.entrypoints.openai.tool_tags import tool_structural_tag
    from pagedjax.entrypoints.openai.tools import parse_tools

    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    req = parse_tools({"tools": [fn], "tool_choice": "required"})
    tag = json.dumps(tool_structural_tag("hermes", req))
    guide = mgr.guide(mgr.compile(SO(structural_tag=tag)))
    assert ord("<") in _allowed(guide) and EOS not in _allowed(guide)  # a call is required
    for ch in b'<tool_call>{"name": "f", "arguments": [1, "x"]}</tool_call>':
        assert guide.accept(ch), chr(ch)
    assert EOS in _allowed(guide)


@pytest.mark.slow  # loads the real tokenizer from the GGUF (~5-20 s)
@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_real_tokenizer_vocabulary(smollm2_gguf, backend: str) -> None:
    """SmolLM2's BPE vocabulary: the tokens of a valid document are allowed one by one,
    and after it only EOS."""
    from pagedjax.tokenizer import gguf_tokenizer

    tok = gguf_tokenizer(smollm2_gguf)
    v = 49152
    mgr = StructuredOutputManager(StructuredOutputsConfig(backend=backend), tok, v,
                                  [tok.eos_token_id])  # fmt: skip
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}  # fmt: skip
    guide = mgr.guide(mgr.compile(SO(json=schema)))
    mask = np.zeros(v // 32, np.int32)
    for t in tok.encode('{"name": "Ann", "age": 7}', add_special_tokens=False):
        guide.fill_mask(mask)
        assert (int(mask[t >> 5]) >> (t & 31)) & 1, t
        assert guide.accept(t)
    guide.fill_mask(mask)
    assert np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist() == [
        tok.eos_token_id
    ]


def test_min_tokens_yields_to_the_grammar_end() -> None:
    """min_tokens beyond the grammar's end: the grammar's EOS is let through (rather
    than an empty distribution), so the output is the grammar's."""
    p = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10,
                       structured_outputs=SO(regex="ab"))  # fmt: skip
    out = drain(_engine(), [("mt", "x", p)])["mt"].outputs[0]
    assert out.token_ids == [ord("a"), ord("b"), EOS] and out.finish_reason == "stop"


@pytest.mark.tier2  # a subprocess that imports jax and xgrammar: ~7 s alone, ~18 s loaded
def test_a_crash_after_loading_xgrammar_kills_the_process() -> None:
    """tvm_ffi's SIGSEGV handler (loaded with xgrammar) can deadlock in the unwinder; after
    import_xgrammar the default action is back, so a crash ends the process at once."""
    import subprocess
    import sys

    code = (
        "import ctypes\n"
        "from pagedjax.structured.backend_xgrammar import import_xgrammar\n"
        "import_xgrammar()\n"
        "ctypes.string_at(0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -11, (r.returncode, r.stderr[-2000:])  # SIGSEGV, default action
    assert "Segfault encountered" not in r.stderr  # tvm_ffi's handler did not run


# ------------------------------------------------------------------ jump-forward decoding
# Fixed keys: after the model picks a value, the grammar forces the next key (e.g.
# `, "count": `), which jump-forward appends instead of decoding byte by byte.
FIXED_KEYS = {
    "type": "object",
    "properties": {"name": {"enum": ["ann", "bo"]}, "count": {"type": "integer"},
                   "flag": {"type": "boolean"}},
    "required": ["name", "count", "flag"],
    "additionalProperties": False,
}  # fmt: skip


def _fixed_keys(temperature: float, **kw) -> tuple:
    kw.setdefault("max_tokens", 48)
    kw.setdefault("seed", 5)
    so = SO(json=FIXED_KEYS, disable_any_whitespace=True)
    return ("keys", "{", SamplingParams(temperature=temperature, structured_outputs=so, **kw))


def _ids(out: dict) -> dict:
    return {k: (v.outputs[0].token_ids, v.outputs[0].text, v.outputs[0].finish_reason)
            for k, v in out.items()}  # fmt: skip


def _steps(engine: LLMEngine, reqs: list) -> tuple[dict, int]:
    before = engine.num_steps
    out = drain(engine, reqs)
    return out, engine.num_steps - before


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_jump_forward_finds_the_forced_tokens(backend: str) -> None:
    """Each backend's Guide.jump_forward accepts the forced run and returns it: the
    object's opening and first key, then the next key once a value is complete."""
    mgr = _manager(backend)
    guide = mgr.guide(mgr.compile(SO(json=FIXED_KEYS, disable_any_whitespace=True)))
    sep = ": " if backend == "xgrammar" else ":"  # xgrammar's compact JSON keeps ": "
    assert bytes(guide.jump_forward()).decode() == '{"name' + '"' + sep + '"'
    assert guide.jump_forward() == []  # nothing more is forced: the value is the model's
    for ch in b'bo"':
        assert guide.accept(ch)
    assert bytes(guide.jump_forward()).decode() == ',"count"'.replace(",", ", " if sep == ": "
                                                                      else ",") + sep
    assert _allowed(guide) == set(b"-0123456789")


def test_jump_forward_string_fallback() -> None:
    """xgrammar 0.2.8 has no find_jump_forward_tokens: the forced text is encoded and its
    last token, which a longer one could extend, left out."""
    from pagedjax.structured.backend_xgrammar import tokens_from_string

    encode = functools.partial(TOK.encode, add_special_tokens=False)
    assert tokens_from_string('", "count": ', encode) == list(b'", "count":')
    assert tokens_from_string("", encode) == []


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_jump_forward_outputs_equal_and_take_fewer_steps(temperature: float) -> None:
    """With the byte tokenizer the forced tokenization is the model's own (one token per
    byte), and the sampling key depends on the output position, so jump-forward must give
    the same tokens and text as decoding them one by one (valid: the structured tests'
    cases), with fewer engine steps for the fixed-key schema."""
    off, on = _engine(), _engine(jump=True)
    reqs = [*_requests(temperature), _fixed_keys(temperature),
            ("plain", "hello", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))]
    got_off, got_on = drain(off, reqs), drain(on, reqs)
    _check_valid(got_on)
    assert _ids(got_on) == _ids(got_off)
    doc = json.loads(got_on["keys"].outputs[0].text)
    assert list(doc) == ["name", "count", "flag"]
    alone_off = _steps(off, [_fixed_keys(temperature)])[1]
    tokens_before = on.stats()["jump_forward_tokens"]
    alone_on = _steps(on, [_fixed_keys(temperature)])[1]
    forced = on.stats()["jump_forward_tokens"] - tokens_before
    # `{"name":"`, `","count":`, `,"flag":`, the rest of true/false and `}`: >= 20 bytes
    assert forced >= 20 and alone_on <= alone_off - forced, (alone_on, alone_off, forced)
    assert off.stats()["jump_forward_tokens"] == 0  # off: nothing forced
    assert all(n == 1 for n in on.runner.trace_count.values()), on.runner.trace_count


def test_jump_forward_stop_rules_and_logprobs_across_forced_tokens() -> None:
    """A stop string inside a forced run, max_tokens inside one, and logprobs: as decoding
    one token at a time, except that a forced token's logprob is 0.0 (rank 1, alone)."""
    off, on = _engine(), _engine(jump=True)
    reqs = [
        ("stop", *_fixed_keys(0.0, stop=["count"])[1:]),
        ("len", *_fixed_keys(0.0, max_tokens=5)[1:]),
        ("lp", *_fixed_keys(0.0, logprobs=1)[1:]),
    ]
    got_off, got_on = drain(off, reqs), drain(on, reqs)
    assert _ids(got_on) == _ids(got_off)
    stop = got_on["stop"].outputs[0]
    assert (stop.finish_reason, stop.stop_reason) == ("stop", "count")
    assert stop.text.endswith('"')  # cut before the stop string, inside the forced run
    assert len(got_on["len"].outputs[0].token_ids) == 5
    assert got_on["len"].outputs[0].finish_reason == "length"
    # A forced token's entry is {token: Logprob(0.0, rank 1)}; with one token per byte the
    # grammar mask leaves that byte the only choice, so decoding it gives the same entry.
    lp_on, lp_off = got_on["lp"].outputs[0], got_off["lp"].outputs[0]

    def entries(o):
        return [{t: (round(x.logprob, 4), x.rank) for t, x in e.items()} for e in o.logprobs]

    assert len(lp_on.logprobs) == len(lp_on.token_ids)
    assert entries(lp_on) == entries(lp_off)
    assert lp_on.cumulative_logprob == pytest.approx(lp_off.cumulative_logprob, abs=1e-3)
    assert on.stats()["jump_forward_tokens"] >= 20


@pytest.mark.tier2  # four more engines: ~20 s of compiling
def test_jump_forward_composes() -> None:
    """Jump-forward with llguidance, with n-gram speculation beside (constrained rows do
    not draft with jump-forward on; a jumping row is a chunk in the verification
    program), with n > 1 samples (each its own matcher), with preemption by recompute and
    prefix caching (the forced tokens are output tokens, prefilled again): the outputs of
    decoding without it."""
    keys = [_fixed_keys(t) for t in (0.0, 1.0)]
    reqs = [*_requests(0.0), ("keys0", *keys[0][1:]), ("keys1", *keys[1][1:]),
            ("n", "pets", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=20,
                                         structured_outputs=SO(regex=r"(cat|dog|bird)!"))),
            ("repeat", "abcabcabcabc", SamplingParams(temperature=0.0, max_tokens=12,
                                                      ignore_eos=True))]  # fmt: skip

    def outs(engine: LLMEngine, rs: list) -> dict:
        got = drain(engine, rs)
        return {k: [(o.token_ids, o.text) for o in v.outputs] for k, v in got.items()}

    base = outs(_engine(), reqs)
    for engine in (_engine(spec=True, jump=True), _engine(prefix=True, jump=True)):
        assert outs(engine, reqs) == base
        assert engine.stats()["jump_forward_tokens"] > 0
    assert _engine(spec=True, jump=True).stats()["spec_rows"] > 0
    guided = [r for r in reqs if r[0] != "repeat"]
    assert outs(_engine("guidance", jump=True), guided) == outs(_engine("guidance"), guided)
    # 20 blocks of 4 tokens for four 48-token outputs: rows are preempted and recomputed.
    small = _engine(blocks=20, jump=True)
    four = [(f"k{i}", *_fixed_keys(1.0, seed=i)[1:]) for i in range(4)]
    got = outs(small, four)
    assert small.num_preemptions > 0
    assert got == outs(_engine(), four)


def test_disable_additional_properties_closes_objects_as_vllm() -> None:
    """vLLM's walk: objects listing properties are closed wherever a schema may be
    (properties, $defs, items, anyOf), data values (const / enum / default) and a bare
    {"type": "object"} (json_object) are left alone."""
    from pagedjax.structured.spec import schema_dict

    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object"},  # a property named "properties"
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "c": {"const": {"properties": {}}},
            "d": {"type": "array", "items": {"anyOf": [{"properties": {"e": {}}}]}},
        },
        "$defs": {"x": {"properties": {"y": {}}, "additionalProperties": True}},
    }
    got = schema_dict(SO(json=schema, disable_additional_properties=True), True)
    assert got["additionalProperties"] is False
    props = got["properties"]
    assert props["properties"] == {"type": "object"} and "additionalProperties" not in props
    assert props["a"]["additionalProperties"] is False
    assert props["c"] == {"const": {"properties": {}}}
    assert props["d"]["items"]["anyOf"][0]["additionalProperties"] is False
    assert got["$defs"]["x"]["additionalProperties"] is True  # explicit: kept
    assert schema_dict(SO(json_object=True), True) == {"type": "object"}
    assert "additionalProperties" not in schema_dict(SO(json=schema), False)


# ------------------------------------------------- the constraint starts after </think>
# A scripted "thinking" model (structured/reasoning.py, enable_in_reasoning=False): the
# random tiny llama with its attention and MLP outputs zeroed, so the next token depends
# only on the current one, and a bigram table written into the embedding and LM head.
# Its tokenizer has <think> and </think> as added tokens. Greedy from a prompt ending in
# "?" it writes <think>hm</think> and then prefers Z: all outside the constraints below,
# so the output shows exactly where the mask applied.
THINK_IDS = {"<think>": 300, "</think>": 301}
THINK = ByteTokenizer(eos_token_id=EOS, bos_token_id=ARCH.bos_token_id, added_tokens=THINK_IDS)
THINK_SCRIPT = [(ord("?"), 300), (300, ord("h")), (ord("h"), ord("m")), (ord("m"), 301),
                (301, ord("Z")), (ord("Z"), ord("Z"))]  # fmt: skip


@functools.cache
def _think_params():
    p = random_params(ARCH, seed=0, dtype=jnp.float32, std=0.15)
    rng = np.random.default_rng(0)
    layers = dict(p["layers"])
    layers["self_attn"] = dict(layers["self_attn"], o_proj={"kernel": jnp.zeros_like(
        layers["self_attn"]["o_proj"]["kernel"])})  # fmt: skip
    layers["mlp"] = dict(layers["mlp"], down_proj={"kernel": jnp.zeros_like(
        layers["mlp"]["down_proj"]["kernel"])})  # fmt: skip
    emb = rng.standard_normal(p["embed_tokens"]["embedding"].shape).astype(np.float32)
    head = 0.01 * rng.standard_normal(p["lm_head"]["kernel"].shape).astype(np.float32)
    for a, b in THINK_SCRIPT:  # logit margin ~80 for the scripted successor
        head[:, b] += 10.0 * emb[a] / np.linalg.norm(emb[a])
    return dict(p, layers=layers, embed_tokens={"embedding": jnp.asarray(emb)},
                lm_head={"kernel": jnp.asarray(head)}, norm={"weight": jnp.ones_like(
                    p["norm"]["weight"])})  # fmt: skip


def _think_run(engine: LLMEngine, so: SO, temperature: float = 0.0) -> dict:
    p = SamplingParams(temperature=temperature, seed=5, max_tokens=20, structured_outputs=so)
    prompts = {"open": "Q?", "ended": "Q<think></think>", "reopened": "</think>Q<think>?"}
    return {k: o.outputs[0] for k, o in drain(engine, [(k, v, p) for k, v in
                                                       prompts.items()]).items()}  # fmt: skip


def test_constraint_starts_after_the_reasoning() -> None:
    """reasoning_parser, enable_in_reasoning=False (vLLM's default): (a) the thinking is
    unconstrained (<think>, h, m are all outside [ab]{2}); (b) after </think> the output
    follows the regex (the tag is not fed to the grammar); (d) a prompt that already
    ended the reasoning is constrained from token one, one that reopened it is not.
    Greedy and seeded. (c) enable_in_reasoning=True: constrained from token one."""
    engine = _engine(think="off")
    think = [300, ord("h"), ord("m"), 301]
    for temperature in (0.0, 1.0):
        out = _think_run(engine, SO(regex=REGEX), temperature)
        o = out["open"]
        assert o.token_ids[:4] == think and o.text.startswith("<think>hm</think>"), o
        assert re.fullmatch(REGEX, o.text.removeprefix("<think>hm</think>")), o.text
        assert o.finish_reason == "stop" and o.token_ids[-1] == EOS  # where allowed
        assert re.fullmatch(REGEX, out["ended"].text), out["ended"]
        assert out["reopened"].token_ids[:4] == think, out["reopened"]
    out = _think_run(_engine(think="on"), SO(regex=REGEX))
    assert all(re.fullmatch(REGEX, o.text) for o in out.values()), out  # <think> forbidden


@pytest.mark.tier2  # two more engines (device FSM at K = 4, jump-forward): ~15 s cold
def test_device_fsm_and_jump_forward_respect_the_reasoning() -> None:
    """The device FSM row has no state while it thinks (it needs the host); from
    </think> on its table applies, in fused K-step loops too. Jump-forward forces nothing
    in the thinking and, after </think>, the regex's fixed `x=`. Tokens equal the host
    path's."""
    host = _engine(think="off")
    fixed, long = SO(regex="x=[ab]"), SO(regex="[ab]{12}")
    want = {so.regex: _think_run(host, so) for so in (fixed, long)}
    assert re.fullmatch("<think>hm</think>[ab]{12}", want[long.regex]["open"].text)
    fsm = _engine(think="off", fsm=True, steps=4)
    for so in (fixed, long):
        got = _think_run(fsm, so)
        assert {k: v.token_ids for k, v in got.items()} == {
            k: v.token_ids for k, v in want[so.regex].items()}
    stats = fsm.stats()
    assert stats["structured_device_fsm"] >= 6 and stats["multi_step_loops"] > 0, stats
    jf = _engine(think="off", jump=True)
    got = _think_run(jf, fixed)
    assert {k: v.token_ids for k, v in got.items()} == {
        k: v.token_ids for k, v in want[fixed.regex].items()}
    assert got["open"].text in ("<think>hm</think>x=a", "<think>hm</think>x=b")
    assert jf.stats()["jump_forward_tokens"] >= 4  # x= after </think>, and from token one


# ------------------------------------------------- speculative drafts under the grammar
# Default tier (xgrammar): the speculating engine's verification programs, 5.0 s cold
# after the module's first engine (load ~3.6); guidance: two more engines, slow.
@pytest.mark.parametrize("backend", ["xgrammar", pytest.param("guidance", marks=pytest.mark.slow)])
def test_constrained_rows_draft_and_equal_plain_decoding(backend: str) -> None:
    """n-gram speculation (k = 3): constrained rows draft, their drafts checked against
    the grammar and each verified position masked with the grammar state after the drafts
    before it (structured/drafts.py); tokens, logprobs and finish reasons equal plain
    decoding, greedy and seeded, for a regex and a JSON schema, beside an unconstrained
    row. Without the per-position masks these outputs differ (checked by hand: `abb`
    instead of `ababababc`)."""
    def p(so: SO | None, t: float) -> SamplingParams:
        return SamplingParams(temperature=t, seed=3, max_tokens=30, logprobs=2,
                              structured_outputs=so, ignore_eos=so is None)  # fmt: skip

    reqs = []
    for t in (0.0, 1.0):
        reqs += [(f"regex{t}", "abababababab", p(SO(regex="(ab){3,8}c"), t)),
                 (f"json{t}", '{"b":"x","c":true}{"b":"x","c":true}{',
                  p(SO(json=SCHEMA, disable_any_whitespace=True), t)),
                 (f"plain{t}", "xyzxyzxyz", p(None, t))]  # fmt: skip
    base = drain(_engine(backend), reqs)
    spec = _engine(backend, spec=True)
    before = spec.stats()
    # Twice: the second run's rows take slots whose earlier owners drafted under a grammar
    # (their old per-position masks must not reach an unconstrained row).
    for got in (drain(spec, reqs), drain(spec, reqs[::-1])):
        for k, want in base.items():
            a, b = want.outputs[0], got[k].outputs[0]
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), (k, a, b)
            assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4), k
            assert [set(e) for e in a.logprobs] == [set(e) for e in b.logprobs], k
    assert re.fullmatch("(ab){3,8}c", got["regex0.0"].outputs[0].text)
    assert json.loads(got["json1.0"].outputs[0].text)["b"] in ("x", "y")
    stats = spec.stats()
    assert stats["spec_accepted_tokens"] - before["spec_accepted_tokens"] >= 10, stats


def test_constrained_draft_masks_stay_with_their_rows() -> None:
    """An unconstrained row whose drafts are all accepted (the scripted model repeats Z)
    takes a slot whose earlier owner drafted under a grammar, while another constrained
    row drafts in the same steps: its tokens equal plain decoding (the earlier owner's
    per-position masks do not reach it)."""
    def p(so: SO | None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=so,
                              ignore_eos=so is None)  # fmt: skip

    ab = SO(regex="(ab){3,8}c")
    first = [(f"c{i}", "Q<think></think>abababab", p(ab)) for i in range(4)]  # every slot
    second = [("z", "ZZZZZZ", p(None)), ("c", "Q<think></think>abababab", p(ab))]
    want = drain(_engine(think="off"), second)
    spec = _engine(think="off", spec=True)
    drain(spec, first)
    got = drain(spec, second)
    assert want["z"].outputs[0].token_ids == [ord("Z")] * 12
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == {
        k: v.outputs[0].token_ids for k, v in want.items()}
    assert spec.stats()["spec_accepted_tokens"] >= 8


def test_constrained_drafts_cross_the_end_tag() -> None:
    """A reasoning row drafts across </think> (the prompt holds `hm</think>ab` before an
    open <think>): the drafts in the thinking are verified unconstrained, those after the
    tag under the grammar from its start; tokens equal decoding without speculation."""
    p = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=SO(regex="[ab]{2}"))
    reqs = [("x", "hm</think>ab<think>Q?", p), ("y", "hm</think>ba<think>Q?", p)]
    want = drain(_engine(think="off"), reqs)
    spec = _engine(think="off", spec=True)
    before = spec.stats()["spec_accepted_tokens"]
    got = drain(spec, reqs)
    for k in want:
        assert got[k].outputs[0].token_ids == want[k].outputs[0].token_ids, k
        assert got[k].outputs[0].text.startswith("<think>hm</think>"), got[k].outputs[0]
    assert spec.stats()["spec_accepted_tokens"] - before >= 4  # m, </think> at least


def test_json_max_whitespace_bounds_whitespace_xgrammar_only() -> None:
    """pagedjax's json_max_whitespace (xgrammar's max_whitespace_cnt; vLLM passes none):
    0 leaves JSON whitespace unbounded as vLLM; N allows at most N whitespace characters
    in a row; guidance cannot bound it and refuses; bounded rows keep the host path."""
    nl = ord("\n")

    def newlines(mgr: StructuredOutputManager) -> int:
        guide = mgr.guide(mgr.compile(SO(json=SCHEMA)))
        assert guide.accept(ord("{"))
        n = 0
        while n < 6 and nl in _allowed(guide):
            assert guide.accept(nl)
            n += 1
        return n

    assert newlines(_manager("xgrammar")) == 6  # unbounded (vLLM's default)
    assert newlines(_manager("xgrammar", json_max_whitespace=2)) == 2
    # compact JSON and non-JSON constraints are untouched by the bound
    assert _manager("xgrammar", json_max_whitespace=2).compile(SO(regex=REGEX))
    with pytest.raises(ValueError, match="json_max_whitespace"):
        _manager("guidance", json_max_whitespace=2).compile(SO(json=SCHEMA))
    assert _manager("guidance", json_max_whitespace=2).compile(
        SO(json=SCHEMA, disable_any_whitespace=True)
    )
    mgr = _manager("xgrammar", json_max_whitespace=2, device_fsm=True)
    assert "host path" in mgr.device_fsm(SO(json=SCHEMA), "xgrammar")
    with pytest.raises(ValueError, match="json_max_whitespace"):
        StructuredOutputsConfig(json_max_whitespace=-1)
