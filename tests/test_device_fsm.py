"""The device-side token FSM (structured_outputs_config device_fsm, issue 33 item 2):
the token DFA (regex, choice, JSON schema) against xgrammar's host masks, the caps'
fallbacks, and engine outputs equal to the host-mask path's (one-step and in the fused
K-step loop, beside unconstrained and host-masked rows), on the tiny model and byte
tokenizer of test_structured_outputs.py."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("outlines_core")

from pagedjax.config import StructuredOutputsConfig  # noqa: E402
from pagedjax.engine.logit_controls import LogitControls  # noqa: E402
from pagedjax.sampling import SamplingParams  # noqa: E402
from pagedjax.sampling import StructuredOutputsParams as SO  # noqa: E402
from pagedjax.structured.json_regex import json_schema_regex  # noqa: E402
from pagedjax.structured.token_fsm import (  # noqa: E402
    FsmUnavailable,
    TokenFsm,
    ascii_classes,
    build_token_fsm,
    choice_regex,
    combine,
    vocab_bytes,
)
from tests.test_structured_outputs import (  # noqa: E402
    ARCH,
    CHOICES,
    EOS,
    REGEX,
    SCHEMA,
    TOK,
    _allowed,
    _engine,
    _manager,
    _requests,
    drain,
)

CASES = [SO(regex=REGEX), SO(choice=list(CHOICES)), SO(regex="[ab]{3}"),
         SO(regex=r"(cat|dog|bird)!"), SO(regex=r"[a-z ]{12}\.")]  # fmt: skip
# JSON schemas the device FSM takes (json_regex.py): nested objects, optional
# properties, bounded arrays, enums, integer ranges, numbers, strings, $ref, pattern.
NESTED = {"type": "object", "required": ["p"],
          "properties": {"p": {"type": "object", "properties": {
                                   "x": {"type": "integer", "minimum": -9, "maximum": 9}},
                               "required": ["x"]},
                         "t": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
                         "n": {"type": "string", "maxLength": 3}}}  # fmt: skip
NUMBERS = {"type": "object", "properties": {"v": {"type": "number"}, "ok": {"type": "boolean"},
                                            "z": {"type": "null"}},
           "required": ["v", "ok"]}  # fmt: skip
JSON_CASES = [
    SCHEMA, NESTED, NUMBERS,
    {"type": "string"},
    {"$defs": {"d": {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/d"}, "b": {"$ref": "#/$defs/d"}}},
    {"type": "object", "properties": {"c": {"type": "string", "pattern": "^[A-Z]{2}-\\d$"}},
     "required": ["c"]},
    {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "boolean"}}]},
]  # fmt: skip


def _fsm(so: SO, max_bytes: int = 1 << 20) -> TokenFsm:
    rx = ascii_classes(so.regex) if so.regex is not None else choice_regex(so.choice)
    return build_token_fsm(rx, vocab_bytes(TOK, ARCH.vocab_size), [EOS], max_bytes)


@pytest.mark.parametrize("so", CASES, ids=lambda so: so.regex or "choice")
def test_token_fsm_allows_what_xgrammar_allows(so: SO) -> None:
    """Random walks: at every step the DFA's allowed set equals xgrammar's mask (EOS
    only at the end), for the structured tests' regex and choice cases."""
    fsm, mgr = _fsm(so), _manager("xgrammar")
    compiled = mgr.compile(so)
    rng = random.Random(0)
    for _ in range(6):
        guide, state, steps = mgr.guide(compiled), fsm.initial, 0
        while True:
            want = _allowed(guide)
            assert set(np.flatnonzero(fsm.allowed(state)).tolist()) == want, (so, steps)
            tok = rng.choice(sorted(want))
            if tok == EOS:
                assert fsm.final[state]
                break
            assert guide.accept(tok)
            state, steps = fsm.next_state(state, tok), steps + 1
        assert steps > 0


@pytest.mark.parametrize("any_ws", [True, False], ids=["any_whitespace", "compact"])
def test_json_fsm_allows_what_xgrammar_allows(any_ws: bool) -> None:
    """Random walks (structural bytes preferred, so walks close their strings and
    objects): at every step the JSON schema's DFA allows exactly xgrammar's mask, with
    vLLM's default whitespace and with disable_any_whitespace. Byte 0xED is never chosen:
    the one known difference (next test)."""
    mgr = _manager("xgrammar")
    rng = random.Random(0)
    for schema in JSON_CASES:
        fsm = build_token_fsm(json_schema_regex(schema, any_ws),
                              vocab_bytes(TOK, ARCH.vocab_size), [EOS], 1 << 20)  # fmt: skip
        compiled = mgr.compile(SO(json=schema, disable_any_whitespace=not any_ws))
        ended = 0
        for _ in range(6):
            guide, state = mgr.guide(compiled), fsm.initial
            for step in range(80):
                want = _allowed(guide)
                assert set(np.flatnonzero(fsm.allowed(state)).tolist()) == want, (schema, step)
                want.discard(0xED)
                pri = sorted(t for t in want if t < 128 and chr(t) in '"}],:0123456789tfn-')
                tok = rng.choice(pri if pri and rng.random() < 0.6 else sorted(want))
                if tok == EOS:
                    assert fsm.final[state]
                    ended += 1
                    break
                assert guide.accept(tok)
                state = fsm.next_state(state, tok)
        assert ended > 0, schema


def test_json_fsm_known_difference_surrogates() -> None:
    """xgrammar's string characters admit UTF-16 surrogates as raw bytes (ED A0..BF ..,
    not valid UTF-8); outlines-core's regex DFA does not. Everything else is equal."""
    fsm = build_token_fsm(json_schema_regex({"type": "string"}, True),
                          vocab_bytes(TOK, ARCH.vocab_size), [EOS], 1 << 20)  # fmt: skip
    mgr = _manager("xgrammar")
    guide = mgr.guide(mgr.compile(SO(json={"type": "string"})))
    state = fsm.initial
    for t in (ord('"'), 0xED):
        assert guide.accept(t)
        state = fsm.next_state(state, t)
    got, want = set(np.flatnonzero(fsm.allowed(state)).tolist()), _allowed(guide)
    assert got == set(range(0x80, 0xA0)) and want == set(range(0x80, 0xC0))


def test_json_schemas_the_fsm_refuses_by_name(monkeypatch) -> None:
    """Not regular, outside the pattern subset, another backend's language, over the
    caps: the reason names it, and the request takes host masks."""
    with pytest.raises(FsmUnavailable, match="recursive"):
        json_schema_regex({"type": "object"}, True)  # any JSON value: basic_any <-> object
    with pytest.raises(FsmUnavailable, match="pattern"):
        json_schema_regex({"type": "string", "pattern": "^a.b$"}, True)

    def controls(backend: str = "xgrammar", **kw) -> LogitControls:
        return LogitControls(ARCH.vocab_size, TOK,
                             StructuredOutputsConfig(backend=backend, device_fsm=True, **kw),
                             {EOS})  # fmt: skip

    def reason(c: LogitControls, so: SO) -> object:
        return c.prepare(SamplingParams(structured_outputs=so))[2]

    assert isinstance(reason(controls(), SO(json=NESTED)), TokenFsm)
    assert "recursive" in reason(controls(), SO(json_object=True))
    assert "xgrammar's JSON language" in reason(controls("guidance"), SO(json=NESTED))
    assert "device_fsm_max_bytes=4096" in reason(controls(device_fsm_max_bytes=4096),
                                                 SO(json=NESTED))  # fmt: skip
    monkeypatch.setattr("pagedjax.structured.token_fsm.DENSE_LIMIT", 100 * ARCH.vocab_size * 4)
    assert "DENSE_LIMIT" in reason(controls(), SO(json={"type": "string", "maxLength": 200}))


def test_tables_are_compressed_and_combined() -> None:
    fsms = [_fsm(so) for so in CASES]
    long = fsms[-1]  # [a-z ]{12}\.: 14 states; classes: letters/space, '.', EOS, the rest
    assert long.table.shape == (14, 4) and long.nbytes < 14 * 4 * 4 + ARCH.vocab_size * 4 + 1
    table, class_of, offsets = combine(fsms)
    assert table.shape[0] >= sum(f.table.shape[0] for f in fsms) and table.shape[0] % 16 == 0
    for f, off in zip(fsms, offsets, strict=True):  # each constraint's rows, re-indexed
        for s in range(f.table.shape[0]):
            got = table[off + s][class_of]
            want = f.table[s][f.class_of]
            assert np.array_equal(got, np.where(want >= 0, want + off, -1))


def test_host_path_when_over_the_cap_or_not_regular() -> None:
    """Over device_fsm_max_bytes, a JSON schema, min_tokens: the host path, with the
    reason counted (the engine logs it)."""
    def controls(**kw) -> LogitControls:
        return LogitControls(ARCH.vocab_size, TOK,
                             StructuredOutputsConfig(backend="xgrammar", device_fsm=True, **kw),
                             {EOS})  # fmt: skip

    small = controls(device_fsm_max_bytes=256)
    _, compiled, fsm = small.prepare(SamplingParams(structured_outputs=SO(regex=REGEX)))
    assert compiled is not None and isinstance(fsm, str) and "device_fsm_max_bytes" in fsm
    c = controls()
    assert isinstance(c.prepare(SamplingParams(structured_outputs=SO(regex=REGEX)))[2], TokenFsm)
    grammar_p = SamplingParams(structured_outputs=SO(grammar='root ::= "a" | "b"'))
    assert "host path" in c.prepare(grammar_p)[2]
    min_p = SamplingParams(min_tokens=2, structured_outputs=SO(regex=REGEX))
    assert "min_tokens" in c.prepare(min_p)[2]
    off = LogitControls(ARCH.vocab_size, TOK, StructuredOutputsConfig(backend="xgrammar"), {EOS})
    assert off.prepare(SamplingParams(structured_outputs=SO(regex=REGEX)))[2] is None


def _fsm_requests(temperature: float, json_rows: bool = True) -> list:
    def p(so: SO, **kw) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=7, max_tokens=40,
                              structured_outputs=so, **kw)  # fmt: skip

    return [("regex", "hello", p(SO(regex=REGEX))),
            ("choice", "pick one", p(SO(choice=list(CHOICES)))),
            ("eos", "eos", p(SO(regex="[ab]{3}"), logit_bias={EOS: 100.0})),
            ("long", "x", p(SO(regex=r"[a-z ]{12}\."))),
            # ignore_eos: after the grammar's EOS nothing is allowed; both paths finish
            # the row there (DEAD_END_REASON) instead of sampling garbage.
            ("dead", "x", p(SO(regex="ab"), ignore_eos=True, logit_bias={EOS: 100.0})),
            *([("nested", "{", p(SO(json=NESTED))),  # vLLM's default: any whitespace
               ("numbers", "n", p(SO(json=NUMBERS, disable_any_whitespace=True)))]
              if json_rows else []),
            ("plain", "hello", SamplingParams(temperature=0.0, max_tokens=10,
                                              ignore_eos=True))]  # fmt: skip


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].outputs[0], b[k].outputs[0]
        assert (x.token_ids, x.finish_reason, x.stop_reason) == (
            y.token_ids, y.finish_reason, y.stop_reason), k  # fmt: skip
        assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4), k


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_device_fsm_outputs_equal_host_masks(temperature: float) -> None:
    """One-step programs: the structured tests' requests (regex, choice and JSON-schema
    rows take the FSM, json_object keeps host masks, an unconstrained row beside them)
    give the same tokens and logprobs as with host masks only; the JSON outputs that
    finish are valid against their schemas (jsonschema)."""
    reqs = [*_requests(temperature), *_fsm_requests(temperature)[3:]]
    base = drain(_engine(), reqs)
    engine = _engine(fsm=True)
    before = engine.stats()
    got = drain(engine, reqs)
    _same(base, got)
    assert got["dead"].outputs[0].token_ids == [ord("a"), ord("b"), EOS]
    after = engine.stats()
    assert after["structured_device_fsm"] - before["structured_device_fsm"] == 8
    assert after["structured_host_masks"] - before["structured_host_masks"] == 1  # json_object
    assert {k for k, o in got.items() if o.structured_output_path == "device_fsm"} == {
        "regex", "choice", "json", "eos", "long", "dead", "nested", "numbers"}
    assert got["object"].structured_output_path.startswith("host_masks: the schema is recursive")
    assert got["plain"].structured_output_path is None
    assert base["regex"].structured_output_path == "host_masks"  # device_fsm off
    _check_json(got, {"json": SCHEMA, "nested": NESTED, "numbers": NUMBERS})


def _check_json(out: dict, schemas: dict) -> None:
    """Every JSON row that stopped is valid against its schema; at least one stopped."""
    jsonschema = pytest.importorskip("jsonschema")  # the test extra installs it
    done = [k for k in schemas if out[k].outputs[0].finish_reason == "stop"]
    assert done, {k: out[k].outputs[0].text for k in schemas}
    for k in done:
        jsonschema.validate(json.loads(out[k].outputs[0].text), schemas[k])


def test_n_samples_have_their_own_states() -> None:
    p = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=20,
                       structured_outputs=SO(regex=r"(cat|dog|bird)!"))  # fmt: skip
    base = drain(_engine(), [("n", "pets", p)])["n"]
    got = drain(_engine(fsm=True), [("n", "pets", p)])["n"]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in base.outputs]
    assert len({o.text for o in got.outputs}) > 1  # the samples differ
    assert all(re.fullmatch(r"(cat|dog|bird)!", o.text) for o in got.outputs)


@pytest.mark.tier2  # two K-step engines: ~15 s of compiling
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_device_fsm_rows_run_in_the_k_step_loop(temperature: float) -> None:
    """K = 4: constrained rows no longer leave the fused loop (no "structured_output"
    skip; pipelined loops too), and the outputs equal the host-mask path's (which runs
    them one step at a time)."""
    _k_step_case(_fsm_requests(temperature, json_rows=False))


# JSON rows in the loop: the same table and state arrays as regex rows (covered above and,
# for JSON outputs, by test_device_fsm_outputs_equal_host_masks); their larger tables
# add (R, C) buckets, so two more compilations of the step and the loop: ~40 s cold at
# load 13-17, over the second tier's budget.
@pytest.mark.slow
def test_device_fsm_json_rows_run_in_the_k_step_loop() -> None:
    _k_step_case(_fsm_requests(0.0))


def _k_step_case(reqs: list) -> None:
    host = _engine(steps=4).multi_step.stats
    host_skips = host.skipped.get("structured_output", 0)
    base = drain(_engine(steps=4), reqs)
    assert host.skipped.get("structured_output", 0) - host_skips >= 8  # host masks: skipped
    engine = _engine(steps=4, fsm=True)
    stats = engine.multi_step.stats
    skipped, iterations = stats.skipped.get("structured_output", 0), stats.iterations
    pipelined, fsm_rows = stats.pipelined, engine.stats()["structured_device_fsm"]
    _same(base, drain(engine, reqs))
    assert stats.skipped.get("structured_output", 0) == skipped
    assert stats.iterations - iterations >= 8  # the ~13 decode steps of the longest row
    # Loops dispatched before the host replayed the previous one start from its states.
    assert stats.pipelined > pipelined
    n_fsm = sum(1 for _, _, p in reqs if p.structured_outputs is not None)
    assert engine.stats()["structured_device_fsm"] - fsm_rows == n_fsm  # all on the device


@pytest.mark.tier2  # a speculative engine: ~10 s of compiling ([1]: slow, tests/tiers.py)
@pytest.mark.parametrize("steps", [1, 4])
def test_device_fsm_rows_speculate_and_equal_plain_decoding(steps: int) -> None:
    """n-gram chains on device FSM rows, one step at a time and inside the fused K-step
    loop: the verification samples each draft position under the FSM's state after the
    drafts before it (sampler.fsm_walk) and the loop advances the state by the accepted
    tokens. FSM rows alone accept drafts (a forced "b" after each "a" of the prompt's
    pattern), and outputs equal host masks without speculation, beside a plain
    speculating row too. Without the walk the second run's tokens break the regexes
    (checked by hand: position j >= 1 sampled under the row's state before the drafts)."""
    def p(so: SO) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so)

    # With the structured tests' FSM rows (EOS inside a run, the ignore_eos dead end).
    fsm_rows = [("chain", "abababababab", p(SO(regex="(ab){3,8}c"))),
                ("words", "cat dog cat dog cat dog", p(SO(regex="((cat|dog) ){2,6}!"))),
                *_fsm_requests(0.0, json_rows=False)[:-1]]  # fmt: skip
    reqs = [*fsm_rows, ("repeat", "abcabcabcabc",
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    base = drain(_engine(), reqs)
    spec = _engine(spec=True, steps=steps, fsm=True)
    before, iterations = spec.stats(), spec.multi_step.stats.iterations
    got = drain(spec, fsm_rows)
    _same({k: base[k] for k in got}, got)
    assert {o.structured_output_path for o in got.values()} == {"device_fsm"}
    after = spec.stats()
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"]  # FSM rows' drafts
    if steps > 1:
        assert after["spec_fused_steps"] > before["spec_fused_steps"]
        assert spec.multi_step.stats.iterations > iterations
    _same(base, drain(spec, reqs))


def test_fsm_walk_on_a_tree_is_the_walk_along_each_nodes_path() -> None:
    """sampler.fsm_walk with parents: column k is the state after the root-to-node-k path
    (a plain walk of that path's tokens), for random tables, trees and start states (-1:
    no FSM; refused tokens give -1 from there on)."""
    import jax.numpy as jnp

    from pagedjax.sampling.sampler import fsm_walk
    from pagedjax.sampling.tensors import SamplingTensors

    rng = np.random.default_rng(5)
    n_states, n_classes, vocab, s, k = 7, 4, 12, 5, 8
    for _ in range(20):
        table = rng.integers(-1, n_states, (n_states, n_classes)).astype(np.int32)
        classes = rng.integers(0, n_classes, vocab).astype(np.int32)
        root = rng.integers(-1, n_states, s).astype(np.int32)
        ids = rng.integers(0, vocab, (s, k)).astype(np.int32)
        parents = np.array([[rng.integers(-1, i) if i else -1 for i in range(k)]
                            for _ in range(s)], np.int32)  # fmt: skip
        t = SamplingTensors.from_params([], pad_to=s)._replace(
            fsm_table=jnp.asarray(table), fsm_class=jnp.asarray(classes),
            fsm_state=jnp.asarray(root))  # fmt: skip
        got = np.asarray(fsm_walk(t, jnp.asarray(ids), jnp.asarray(parents)))
        for r in range(s):
            for node in range(k):
                path, i = [], node
                while i >= 0:
                    path.append(ids[r, i])
                    i = parents[r, i]
                state = root[r]
                for tok in reversed(path):
                    state = table[state, classes[tok]] if state >= 0 else -1
                assert got[r, node] == state, (r, node)
        chain = np.asarray(fsm_walk(t, jnp.asarray(ids)))  # parents None: node k - 1
        as_tree = np.asarray(fsm_walk(t, jnp.asarray(ids), jnp.asarray(
            np.tile(np.arange(-1, k - 1, dtype=np.int32), (s, 1)))))  # fmt: skip
        assert np.array_equal(chain, as_tree)


@pytest.mark.tier2  # a speculative engine's programs: ~10 s of compiling each
@pytest.mark.parametrize("kind", ["layer_skip", "ngram_tree"])
def test_device_fsm_rows_take_drafting_models_and_trees(kind: str) -> None:
    """Device FSM rows draft with a drafting model's chains (layer-skip: the target's
    first layer, made on the device without the grammar) and with n-gram trees: the
    verification samples each position under the FSM's state after its node's path
    (sampler.fsm_walk with parents), so the FSM rows propose drafts and greedy outputs
    equal host masks without speculation. The random model's layer-skip drafts are
    almost never accepted, so that case checks that such rows draft and stay equal; the
    walk past an accepted draft is exercised by the tree case here (the chain walk
    applied to trees fails it) and by the n-gram chain test above (the same code)."""
    import dataclasses

    import jax.numpy as jnp

    from pagedjax.config import DraftTreeConfig, SpeculativeConfig
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.model import random_params

    def p(so: SO) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so)

    fsm_rows = [("chain", "abababababab", p(SO(regex="(ab){3,8}c"))),
                ("words", "cat dog cat dog cat dog", p(SO(regex="((cat|dog) ){2,6}!"))),
                *_fsm_requests(0.0, json_rows=False)[:-1]]  # fmt: skip
    base = drain(_engine(), fsm_rows)
    host = _engine(fsm=True)
    if kind == "layer_skip":
        spec = SpeculativeConfig(method="draft_model", model="self", draft_num_layers=1,
                                 num_speculative_tokens=3)  # fmt: skip
    else:
        spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3,
                                 tree=DraftTreeConfig(budget=6, top_k=2))  # fmt: skip
    params = random_params(ARCH, seed=0, dtype=jnp.float32, std=0.15)  # _engine's
    engine = LLMEngine(ARCH, params, TOK, dataclasses.replace(host.config, speculative=spec))
    got = drain(engine, fsm_rows)
    _same(base, got)
    assert {o.structured_output_path for o in got.values()} == {"device_fsm"}
    stats = engine.stats()  # only FSM rows ran: they drafted
    assert stats["spec_proposed_tokens"] > 0
    if kind == "ngram_tree":
        assert stats["spec_accepted_tokens"] > 0


@pytest.mark.slow  # the real tokenizer from the GGUF (~5-20 s), and ~1 s of DFA builds
def test_token_fsm_on_smollm2_vocabulary(smollm2_gguf) -> None:
    """SmolLM2's byte-level BPE vocabulary: random walks allow what xgrammar allows."""
    from pagedjax.structured import StructuredOutputManager
    from pagedjax.tokenizer import gguf_tokenizer

    tok = gguf_tokenizer(smollm2_gguf)
    v, eos = 49152, [tok.eos_token_id]
    mgr = StructuredOutputManager(StructuredOutputsConfig(backend="xgrammar"), tok, v, eos)
    vocab = vocab_bytes(tok, v)
    rng = random.Random(1)
    for so in (SO(regex="[a-z ]{40}"), SO(regex=r"\d{3}-\d{4}"),
               SO(choice=["yes", "no", "Paris, France"]), SO(json=NESTED), SO(json=NUMBERS),
               SO(json=NESTED, disable_any_whitespace=True)):  # fmt: skip
        if so.json is not None:
            rx = json_schema_regex(so.json, not so.disable_any_whitespace)
        else:
            rx = ascii_classes(so.regex) if so.regex is not None else choice_regex(so.choice)
        fsm, compiled = build_token_fsm(rx, vocab, eos, 1 << 20), mgr.compile(so)
        for _ in range(3):
            guide, state = mgr.guide(compiled), fsm.initial
            for _ in range(100):  # JSON numbers and whitespace may go on: a cap
                mask = np.zeros(v // 32, np.int32)
                guide.fill_mask(mask)
                want = np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool)
                assert np.array_equal(fsm.allowed(state), want), so
                # Not a token holding byte 0xED: the known surrogate difference (above).
                t = rng.choice([t for t in np.flatnonzero(want).tolist()
                                if b"\xed" not in (vocab[t] or b"")])  # fmt: skip
                if t in eos:
                    break
                assert guide.accept(t)
                state = fsm.next_state(state, t)
