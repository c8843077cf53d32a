"""Structured outputs: validity per backend, and decode-step time constrained vs not.

    python benchmarks/structured_outputs.py [--model smollm2-135m-instruct | --tiny]
        [--backends xgrammar guidance] [--batch-sizes 1 16] [--max-tokens 48]

Issue 33's benchmark (docs/structured_outputs.md): a fixed set of JSON schemas,
regexes and choice lists (``CASES``: the issue's 30 / 10 / 10), greedy. For each
backend: every case once, the share of outputs that are valid (JSON parsing plus the
schema: ``jsonschema`` where installed, else the required keys; regexes with
``re.fullmatch``; choices by membership; an output cut by max_tokens counts as
invalid). Then, per batch size B, B requests under a regex no output can finish vs
B unconstrained requests, all running exactly max_tokens steps, stepped to completion
once to compile, then ``--rounds`` interleaved pairs; the fastest wall time per engine
step of each is reported (the box is shared).
``--tiny``: the random tiny-llama preset with the byte tokenizer
(smoke runs; its outputs are not meaningful text). Prints the load before and after; the
last line is ``constrained_step_ratio: R`` at the largest B.

    python benchmarks/structured_outputs.py --jump-forward [--backends xgrammar]
        [--max-tokens 96] [--rounds 1] [--disable-any-whitespace]

    python benchmarks/structured_outputs.py --device-fsm [--steps 1 8] [--batch-sizes 64]
        [--constraints regex json] [--mask-time]

Host masks vs the device FSM (``structured_outputs_config["device_fsm"]``) instead: per
num_scheduler_steps K, two engines (host masks, device FSM), the step-time pair above at
the largest B for each of ``--constraints`` (``STEP_CONSTRAINTS``: the regex
``[a-z ]{400}``, a JSON schema of >= 40 points), and how many of the constrained run's
iterations ran inside fused K-step loops. A Markdown row per engine, constraint and B.
``--mask-time``: then the host's mask time per token and row for each of --backends and
the device FSM's state mirror, at 1 row and the largest B (``mask_times``).

    python benchmarks/structured_outputs.py --overlap [--batch-sizes 1 16 64]
        [--constraints json] [--backends xgrammar guidance]

Grammar masks filled while the forward runs vs before a fused step (``structured_outputs_
config["overlap_mask_fill"]``; ``overlap_compare``): per backend and B the step-time pair,
host mask fills, microseconds per fill, and the shares of fill time overlapped and hidden
(the engine's ``structured_mask_fill_*`` counters). The last lines are
``mask_fill_hidden_share[backend]: S`` at the largest B. First each engine runs the 50
``CASES`` greedy (``--cases-max-tokens``, 96 as structured_vs_vllm.py; 0 skips): their
validity, and on how many the two engines' outputs are equal token for token.

Jump-forward decoding on and off instead (``structured_outputs_config["jump_forward"]``):
two engines (max_num_seqs 1), the 30 JSON schemas of ``CASES`` (all have fixed keys),
one request at a time, greedy; per request the engine steps, the wall time (a first run
per engine compiles; the fastest of ``--rounds`` interleaved runs after it), the forced
tokens, validity (on and off) and whether the text equals the off-run's. Prints a
Markdown row per schema and the totals; the last line is ``jump_forward_speedup: R``
(total wall off / on). ``--disable-any-whitespace``: compact JSON (the engines'
``disable_any_whitespace``), where a key and its punctuation are forced as one run; with
vLLM's default (any whitespace) a key's closing quote and colon are not forced.

    python benchmarks/structured_outputs.py --speculative [--backends xgrammar] [--k 4]
        [--max-tokens 96] [--rounds 1]

Constrained rows without and with n-gram speculation instead (docs/structured_outputs.md,
"Speculative decoding composes"): two engines (max_num_seqs 1; prompt lookup 2-4 tokens,
k drafts), the 30 JSON schemas of ``CASES``, each prompt holding its schema's JSON text
(so keys can be drafted from it), one request at a time, greedy. Totals of output tokens,
engine steps, wall (the fastest of ``--rounds`` runs after a first that compiles),
validity, token-for-token equality and the drafts proposed / accepted; the last line is
``constrained_speculation_speedup: R`` (wall without / with).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedjax import LLM

# pagedjax is imported inside the functions that run it: CASES and valid() are imported
# by benchmarks/structured_vs_vllm.py's children in vLLM's venv, which has no pagedjax.

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
}  # fmt: skip
_ADDRESS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["city", "zip"],
}  # fmt: skip


def _obj(props: dict, required: list[str] | None = None, **extra: object) -> dict:
    """An object schema: ``required`` defaults to every property."""
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required, **extra}  # fmt: skip


_STR8 = {"type": "string", "maxLength": 8}
# Issue 33's set: 30 JSON schemas (nested objects, arrays, enums, pattern, numeric
# ranges, $defs / $ref, optional fields), 10 regexes, 10 choice lists. Strings and
# arrays are bounded so a valid output fits in the benchmarks' max_tokens.
# fmt: off
JSON_SCHEMAS: list[dict] = [
    PERSON,
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}),
    {"$defs": {"p": PERSON}, **_obj({"owner": {"$ref": "#/$defs/p"}})},
    _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999}}),
    _obj({"price": {"type": "number", "minimum": 0, "maximum": 100}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}),
    _obj({"date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"}}),
    _obj({"name": _STR8, "nick": _STR8}, required=["name"]),
    _obj({"address": _ADDRESS}),
    _obj({"user": PERSON, "admin": {"type": "boolean"}}),
    _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                 "maximum": 10}, "minItems": 1,
                     "maxItems": 4}}),  # fmt: skip
    _obj({"point": _obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                         "y": {"type": "integer", "minimum": -9, "maximum": 9}})}),
    _obj({"size": {"enum": ["S", "M", "L", "XL"]}, "qty": {"type": "integer", "minimum": 1,
                                                          "maximum": 9}}),  # fmt: skip
    _obj({"status": {"enum": ["open", "closed"]}, "note": _STR8}, required=["status"]),
    {"$defs": {"a": _ADDRESS}, **_obj({"home": {"$ref": "#/$defs/a"},
                                       "work": {"$ref": "#/$defs/a"}}, required=["home"])},
    _obj({"items": {"type": "array", "items": _obj({"sku": {"type": "string",
                                                             "pattern": "^[a-z]{2}[0-9]{2}$"},
                                                     "n": {"type": "integer", "minimum": 1,
                                                           "maximum": 5}}),
                    "maxItems": 2}}),  # fmt: skip
    _obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0,
                                                            "maximum": 1}}),  # fmt: skip
    _obj({"title": {"type": "string", "minLength": 1, "maxLength": 16}}),
    _obj({"temp": {"type": "integer", "minimum": -40, "maximum": 50},
          "unit": {"enum": ["C", "F"]}}),
    _obj({"words": {"type": "array", "items": _STR8, "minItems": 2, "maxItems": 3}}),
    _obj({"flag": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0,
                                                 "maximum": 3}}, required=["flag"]),  # fmt: skip
    _obj({"meta": _obj({"version": {"type": "integer", "minimum": 1, "maximum": 9},
                        "stable": {"type": "boolean"}})}),
    {"$defs": {"leaf": _obj({"v": {"type": "integer", "minimum": 0, "maximum": 9}})},
     **_obj({"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}})},
    _obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    _obj({"lang": {"enum": ["en", "fr", "de", "es"]}, "text": _STR8}),
    _obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5},
          "comment": {"type": "string", "maxLength": 20}}, required=["rating"]),
    _obj({"pair": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                              "maximum": 99}, "minItems": 2,
                   "maxItems": 2}}),  # fmt: skip
    _obj({"event": _obj({"name": _STR8, "when": {"type": "string",
                                                 "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}),
          "attendees": {"type": "integer", "minimum": 0, "maximum": 50}}),
]
# fmt: on
REGEXES: list[str] = [
    r"\d{3}-\d{4}",
    r"(yes|no), because [a-z ]{1,20}\.",
    r"[A-Z][a-z]{2,8}",
    r"[a-z]+@[a-z]+\.(com|org)",
    r"(0|[1-9][0-9]?)\.[0-9]{2}",
    r"#[0-9a-f]{6}",
    r"(Mon|Tue|Wed|Thu|Fri), [0-2][0-9]:[0-5][0-9]",
    r"[A-Z]{2}-[0-9]{3}",
    r"The answer is (true|false)\.",
    r"\((-?[0-9]), (-?[0-9])\)",
]
CHOICES: list[list[str]] = [
    ["positive", "negative", "neutral"],
    ["Paris", "London", "Rome", "Madrid"],
    ["yes", "no"],
    ["red", "green", "blue", "yellow"],
    ["cat", "dog", "bird"],
    ["low", "medium", "high"],
    ["north", "south", "east", "west"],
    ["1", "2", "3", "4", "5"],
    ["spring", "summer", "autumn", "winter"],
    ["Python", "Rust", "Go", "C++", "Java"],
]
CASES: list[tuple[str, dict]] = (
    [("json", {"json": s}) for s in JSON_SCHEMAS]
    + [("regex", {"regex": r}) for r in REGEXES]
    + [("choice", {"choice": c}) for c in CHOICES]
)
PROMPT = "Answer in the requested format. Describe a person, a color or a city: "


def valid(kind: str, spec: dict, text: str) -> bool:
    """Whether ``text`` satisfies the case: the full schema with ``jsonschema`` where it
    is installed (not a pagedjax dependency), else parsing plus the required keys."""
    if kind == "regex":
        return re.fullmatch(spec["regex"], text) is not None
    if kind == "choice":
        return text in spec["choice"]
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    schema = spec["json"]
    try:
        import jsonschema
    except ImportError:
        return isinstance(doc, dict) and all(k in doc for k in schema.get("required", []))
    return jsonschema.Draft202012Validator(schema).is_valid(doc)


def case_outputs(llm: LLM, max_tokens: int) -> list[tuple[list[int], bool]]:
    """Every case of ``CASES`` once, greedy: (output token ids, valid and finished)."""
    from pagedjax.sampling import SamplingParams, StructuredOutputsParams

    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(**spec))
              for _, spec in CASES]  # fmt: skip
    outs = llm.generate([PROMPT] * len(CASES), params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             valid(k, s, o.outputs[0].text) and o.outputs[0].finish_reason == "stop")
            for (k, s), o in zip(CASES, outs, strict=True)]  # fmt: skip


def validity(llm: LLM, max_tokens: int) -> float:
    ok = [v for _, v in case_outputs(llm, max_tokens)]
    return sum(ok) / len(ok)


# The step-time tables' constraints: every row runs exactly max_tokens steps either way (a
# constrained row finishing early would leave fewer rows per step), so each is longer
# than any output (EOS ignored): a regex, or a JSON schema of at least 40 {"x", "y"}
# points (keys, integers, punctuation and, by default, any whitespace; >= 120 tokens).
STEP_CONSTRAINTS = {
    "regex": {"regex": "[a-z ]{400}"},
    "json": {"json": _obj({"points": {"type": "array", "minItems": 40, "items": _obj(
        {"x": {"type": "integer", "minimum": 0, "maximum": 9},
         "y": {"type": "integer", "minimum": 0, "maximum": 9}})}})},
}  # fmt: skip


def step_time(llm: LLM, batch: int, max_tokens: int, constrained: bool,
              kind: str = "regex") -> float:  # fmt: skip
    """Seconds per engine step over ``batch`` requests, one run (``STEP_CONSTRAINTS[kind]``
    when constrained)."""
    from pagedjax.sampling import SamplingParams, StructuredOutputsParams

    engine = llm.llm_engine
    so = StructuredOutputsParams(**STEP_CONSTRAINTS[kind]) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            structured_outputs=so)  # fmt: skip
    tag = f"{constrained}-{time.perf_counter_ns()}"
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", PROMPT, params)
    # Engine iterations, not step() calls: a fused K-step loop runs several per call.
    steps, t0 = engine.core.num_steps, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - t0) / max(engine.core.num_steps - steps, 1)


def step_times(llm: LLM, batch: int, max_tokens: int, rounds: int,
               kind: str = "regex") -> tuple[float, float]:  # fmt: skip
    """(unconstrained, constrained) seconds per step: a first pair compiles, then
    ``rounds`` interleaved pairs; the fastest of each (the box is shared: load drifts)."""
    step_time(llm, batch, max_tokens, False)
    step_time(llm, batch, max_tokens, True, kind)
    pairs = [(step_time(llm, batch, max_tokens, False),
              step_time(llm, batch, max_tokens, True, kind)) for _ in range(rounds)]  # fmt: skip
    return min(p[0] for p in pairs), min(p[1] for p in pairs)


def one_request(llm: LLM, spec: dict, max_tokens: int) -> dict:
    """One constrained greedy request alone on ``llm``'s engine: its text and finish
    reason, engine steps, wall seconds and the tokens jump-forward appended."""
    from pagedjax.sampling import SamplingParams, StructuredOutputsParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(**spec))  # fmt: skip
    forced0, steps, out = engine.stats()["jump_forward_tokens"], 0, None
    t0 = time.perf_counter()
    engine.add_request(f"jf-{time.perf_counter_ns()}", PROMPT, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o.outputs[0] if o.finished else out
        steps += 1
    wall = time.perf_counter() - t0
    return dict(text=out.text, finish=out.finish_reason, steps=steps, wall=wall,
                tokens=len(out.token_ids),
                forced=engine.stats()["jump_forward_tokens"] - forced0)  # fmt: skip


def jump_forward_compare(model: str, backend: str, max_tokens: int, rounds: int,
                         compact: bool = False) -> float:  # fmt: skip
    """Jump-forward off vs on over the JSON schemas (module docstring); prints the table,
    returns total wall off / total wall on."""
    from pagedjax import LLM

    llms = {jf: LLM(model, max_model_len=256, max_num_seqs=1,
                    structured_outputs_config={"backend": backend, "jump_forward": jf,
                                               "disable_any_whitespace": compact})
            for jf in (False, True)}  # fmt: skip
    cases = [s for k, s in CASES if k == "json"]
    print("| schema | tokens off | tokens on | steps off | steps on | forced tokens | ms off"
          " | ms on | valid off | valid on | text equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    tot = {False: [0, 0.0, 0, 0], True: [0, 0.0, 0, 0]}  # steps, wall, valid, tokens
    equal = forced = 0
    for i, spec in enumerate(cases):
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(1 + rounds):  # the first compiles what this case needs
            for jf, llm in llms.items():
                runs[jf].append(one_request(llm, spec, max_tokens))
        row = {}
        for jf, rs in runs.items():
            first = rs[0]
            ok = valid("json", spec, first["text"]) and first["finish"] == "stop"
            wall = min(r["wall"] for r in rs[1:]) if rounds else first["wall"]
            row[jf] = (first, wall, ok)
            tot[jf][0] += first["steps"]
            tot[jf][1] += wall
            tot[jf][2] += ok
            tot[jf][3] += first["tokens"]
        same = row[False][0]["text"] == row[True][0]["text"]
        equal += same
        forced += row[True][0]["forced"]
        print(f"| {i} | {row[False][0]['tokens']} | {row[True][0]['tokens']} |"
              f" {row[False][0]['steps']} | {row[True][0]['steps']} |"
              f" {row[True][0]['forced']} | {row[False][1] * 1e3:.0f} | {row[True][1] * 1e3:.0f} |"
              f" {row[False][2]} | {row[True][2]} | {same} |")  # fmt: skip
    n = len(cases)
    print(f"| total | {tot[False][3]} | {tot[True][3]} | {tot[False][0]} | {tot[True][0]} |"
          f" {forced} | {tot[False][1] * 1e3:.0f} |"
          f" {tot[True][1] * 1e3:.0f} | {tot[False][2]}/{n} | {tot[True][2]}/{n} |"
          f" {equal}/{n} |")  # fmt: skip
    return tot[False][1] / tot[True][1]


def speculative_compare(model: str, backend: str, max_tokens: int, rounds: int, k: int,
                        device_fsm: bool = False) -> float:  # fmt: skip
    """Constrained rows without and with n-gram speculation (module docstring); prints the
    table, returns total wall without / with. device_fsm: both engines with
    ``structured_outputs_config["device_fsm"]`` (the schemas it takes run as device
    FSMs, their drafts verified along the FSM)."""
    from pagedjax import LLM
    from pagedjax.sampling import SamplingParams, StructuredOutputsParams

    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}  # fmt: skip
    llms = {on: LLM(model, max_model_len=512, max_num_seqs=1,
                    speculative_config=spec if on else None,
                    structured_outputs_config={"backend": backend, "device_fsm": device_fsm})
            for on in (False, True)}  # fmt: skip
    paths: dict[str, int] = {}
    cases = [s for kind, s in CASES if kind == "json"]
    totals = {on: [0, 0, 0.0] for on in llms}  # tokens, steps, wall
    valid_n, equal = {False: 0, True: 0}, 0
    for spec_case in cases:
        schema = spec_case["json"]
        prompt = (f"Answer with one JSON object that follows this schema:\n"
                  f"{json.dumps(schema)}\nJSON: ")  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                structured_outputs=StructuredOutputsParams(**spec_case))
        outs, path_of = {}, {}
        for r in range(1 + rounds):  # the first compiles what this case needs
            for on, llm in llms.items():
                engine, steps = llm.llm_engine, 0
                t0 = time.perf_counter()
                engine.add_request(f"sp-{time.perf_counter_ns()}", prompt, params)
                while engine.has_unfinished_requests():
                    for o in engine.step():
                        out = o.outputs[0] if o.finished else None
                        if out is not None:
                            outs.setdefault(on, [out, steps, []])
                            path_of[on] = o.structured_output_path or ""
                    steps += 1
                outs[on][2].append(time.perf_counter() - t0)
                if r == 0:
                    outs[on][1] = steps
        path = path_of[True].split(":")[0]
        paths[path] = paths.get(path, 0) + 1
        for on, (out, steps, walls) in outs.items():
            totals[on][0] += len(out.token_ids)
            totals[on][1] += steps
            totals[on][2] += min(walls[1:]) if rounds else walls[0]
            valid_n[on] += out.finish_reason == "stop" and valid("json", spec_case, out.text)
        equal += outs[False][0].token_ids == outs[True][0].token_ids
    st = llms[True].llm_engine.stats()
    n = len(cases)
    print(f"mask paths (speculating engine): {paths}")
    print("| speculation | output tokens | engine steps | wall (s) | valid | token ids equal |"
          " drafts proposed / accepted |")
    print("|---|---|---|---|---|---|---|")
    for on in (False, True):
        drafts = (f"{st['spec_proposed_tokens']} / {st['spec_accepted_tokens']}"
                  if on else "-")  # fmt: skip
        print(f"| {'n-gram k=' + str(k) if on else 'off'} | {totals[on][0]} | {totals[on][1]} |"
              f" {totals[on][2]:.2f} | {valid_n[on]}/{n} | {equal}/{n} | {drafts} |")
    return totals[False][2] / totals[True][2]


def device_fsm_compare(model: str, args: argparse.Namespace) -> None:
    """Per num_scheduler_steps K and batch B: unconstrained vs constrained ms per engine
    iteration with host masks, then with the device FSM (one engine each)."""
    from pagedjax import LLM

    print("| K | constraint | masks | B | unconstrained ms/step | constrained ms/step | ratio"
          " | loop iterations / steps (constrained runs) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    tokenizer = None
    for k in args.steps:
        for fsm in (False, True):
            cfg = {"backend": args.backends[0], "device_fsm": fsm}
            llm = LLM(model, max_model_len=256, max_num_seqs=max(args.batch_sizes),
                      num_scheduler_steps=k, structured_outputs_config=cfg)  # fmt: skip
            e = llm.llm_engine
            tokenizer, vocab_size = e.tokenizer, e.arch.vocab_size
            for kind in args.constraints:
                for b in args.batch_sizes:
                    plain, cons = step_times(llm, b, args.max_tokens, args.rounds, kind)
                    e.multi_step.reset_stats()
                    n0 = e.core.num_steps
                    step_time(llm, b, args.max_tokens, True, kind)
                    it, n = e.multi_step.stats.iterations, e.core.num_steps - n0
                    print(f"| {k} | {kind} | {'device FSM' if fsm else 'host'} | {b} |"
                          f" {plain * 1e3:.1f} | {cons * 1e3:.1f} | {cons / plain:.3f} |"
                          f" {it} / {n} |", flush=True)  # fmt: skip
            s = e.stats()
            print(f"<!-- device_fsm {s['structured_device_fsm']}, host_masks"
                  f" {s['structured_host_masks']}, build {s['structured_fsm_build_s']:.1f} s,"
                  f" load {os.getloadavg()} -->", flush=True)  # fmt: skip
            del llm, e
    if args.mask_time:
        mask_times(tokenizer, vocab_size, args.backends, sorted({1, max(args.batch_sizes)}))
    print(f"load after: {os.getloadavg()}")


def overlap_compare(model: str, args: argparse.Namespace) -> dict[str, float]:
    """Per backend, two engines at the CPU defaults (K = 1): grammar masks filled while the
    forward runs (``overlap_mask_fill``, the default) and filled before a fused step; per
    batch B the step-time pair of ``step_times`` under ``--constraints``' first
    constraint, then the engine's own counters over one more constrained run: host mask
    fills, microseconds per fill (one row's mask for one token, with its row write),
    the share of fill time spent while the forward had been dispatched (overlapped) and
    the share that ended before the forward did (hidden; a lower bound). Returns
    {backend: hidden share at the largest B}."""
    from pagedjax import LLM

    kind = args.constraints[0]
    print(f"constraint {kind}, max_tokens {args.max_tokens}, fastest of {args.rounds} pairs")
    print("| backend | masks | B | unconstrained ms/step | constrained ms/step | ratio"
          " | fills | us per fill | overlapped | hidden |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    hidden: dict[str, float] = {}
    cases: dict[tuple[str, bool], list] = {}
    for backend in args.backends:
        for overlap in (True, False):
            cfg = {"backend": backend, "overlap_mask_fill": overlap}
            llm = LLM(model, max_model_len=256, max_num_seqs=max(args.batch_sizes),
                      structured_outputs_config=cfg)  # fmt: skip
            e = llm.llm_engine
            if args.cases_max_tokens:
                cases[backend, overlap] = case_outputs(llm, args.cases_max_tokens)
            for b in args.batch_sizes:
                plain, cons = step_times(llm, b, args.max_tokens, args.rounds, kind)
                before = e.stats()
                step_time(llm, b, args.max_tokens, True, kind)
                after = e.stats()
                d = {k: after[k] - before[k] for k in (
                    "structured_mask_fills", "structured_mask_fill_s",
                    "structured_mask_fill_overlapped_s", "structured_mask_fill_hidden_s")}
                fill_s = d["structured_mask_fill_s"]
                share = d["structured_mask_fill_hidden_s"] / fill_s if fill_s else 0.0
                if overlap:
                    hidden[backend] = share
                print(f"| {backend} | {'overlapped' if overlap else 'before the step'} | {b} |"
                      f" {plain * 1e3:.1f} | {cons * 1e3:.1f} | {cons / plain:.3f} |"
                      f" {d['structured_mask_fills']} |"
                      f" {fill_s / max(d['structured_mask_fills'], 1) * 1e6:.1f} |"
                      f" {d['structured_mask_fill_overlapped_s'] / fill_s if fill_s else 0:.0%} |"
                      f" {share:.0%} |", flush=True)  # fmt: skip
            del llm, e
    for backend in args.backends if cases else ():
        a, b = cases[backend, True], cases[backend, False]
        equal = sum(x[0] == y[0] for x, y in zip(a, b, strict=True))
        print(f"{backend}, CASES greedy (max_tokens {args.cases_max_tokens}): valid"
              f" {sum(v for _, v in a)} / {len(a)} overlapped, {sum(v for _, v in b)} / {len(b)}"
              f" before the step; outputs equal token for token on {equal} / {len(a)}")
    print(f"load after: {os.getloadavg()}")
    return hidden


def mask_times(tokenizer: object, vocab_size: int, backends: list[str],
               rows_list: list[int]) -> None:  # fmt: skip
    """Host cost per token and row of each mask path, outside the engine: R matchers walk
    the same valid prefix of ``STEP_CONSTRAINTS["json"]`` (10 points, vLLM's default
    whitespace), each step filling the row's packed mask and accepting the token; the
    device FSM's host work is its state mirror (one table lookup per token). The fastest
    of 3 walks. What a host-masked step pays serially for its rows before the upload."""
    import numpy as np

    from pagedjax.config import StructuredOutputsConfig
    from pagedjax.sampling import StructuredOutputsParams
    from pagedjax.structured import StructuredOutputManager

    so = StructuredOutputsParams(**STEP_CONSTRAINTS["json"])
    text = '{"points": [' + ", ".join(f'{{"x": {i % 10}, "y": {(3 * i) % 10}}}'
                                      for i in range(10))  # fmt: skip
    toks = list(tokenizer.encode(text, add_special_tokens=False))
    eos = [tokenizer.eos_token_id]
    words = (vocab_size + 31) // 32
    print(f"\nmask time per token and row, {len(toks)} tokens of the JSON step constraint:")
    print("| path | rows | us per token per row |")
    print("|---|---|---|")
    for backend in [*backends, "device FSM"]:
        name = "xgrammar" if backend == "device FSM" else backend
        cfg = StructuredOutputsConfig(backend=name, device_fsm=backend == "device FSM")
        mgr = StructuredOutputManager(cfg, tokenizer, vocab_size, eos)
        compiled = mgr.compile(so)
        fsm = mgr.device_fsm(so, name) if backend == "device FSM" else None
        for rows in rows_list:
            best = float("inf")
            for _ in range(3):
                masks = np.zeros((rows, words), np.int32)
                if fsm is not None:
                    states = [fsm.initial] * rows
                    t0 = time.perf_counter()
                    for t in toks:
                        for r in range(rows):
                            states[r] = fsm.next_state(states[r], t)
                else:
                    guides = [mgr.guide(compiled) for _ in range(rows)]
                    t0 = time.perf_counter()
                    for t in toks:
                        for r, g in enumerate(guides):
                            g.fill_mask(masks[r])
                            if not g.accept(t):
                                raise RuntimeError(f"{backend} refused token {t} of {text!r}")
                best = min(best, time.perf_counter() - t0)
            print(f"| {backend} | {rows} | {best / (rows * len(toks)) * 1e6:.1f} |", flush=True)
        mgr.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tiny", action="store_true", help="the random tiny-llama preset")
    ap.add_argument("--backends", nargs="+", default=["xgrammar", "guidance"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed pairs")
    ap.add_argument("--jump-forward", action="store_true",
                    help="measure jump-forward decoding on vs off instead")  # fmt: skip
    ap.add_argument("--disable-any-whitespace", action="store_true",
                    help="--jump-forward: compact JSON (no free whitespace)")  # fmt: skip
    ap.add_argument("--device-fsm", action="store_true",
                    help="host masks vs the device FSM instead, per --steps")  # fmt: skip
    ap.add_argument("--steps", nargs="+", type=int, default=[1, 8],
                    help="--device-fsm: num_scheduler_steps values")  # fmt: skip
    ap.add_argument("--mask-time", action="store_true",
                    help="--device-fsm: also the host mask time per token per backend")
    ap.add_argument("--constraints", nargs="+", choices=["regex", "json"],
                    default=["regex", "json"],
                    help="--device-fsm: the constrained rows' STEP_CONSTRAINTS")  # fmt: skip
    ap.add_argument("--speculative", action="store_true",
                    help="constrained rows without vs with n-gram speculation instead")
    ap.add_argument("--k", type=int, default=4, help="--speculative: num_speculative_tokens")
    ap.add_argument("--overlap", action="store_true",
                    help="mask filling overlapped with the forward vs before the step instead")
    ap.add_argument("--cases-max-tokens", type=int, default=96,
                    help="--overlap: also run CASES greedy on both engines and compare"
                         " (0: skip)")  # fmt: skip
    args = ap.parse_args()
    from pagedjax import LLM

    model = "tiny-llama" if args.tiny else args.model
    print(f"load before: {os.getloadavg()}")
    if args.jump_forward:
        for backend in args.backends:
            print(f"{backend}, max_tokens {args.max_tokens}:")
            speedup = jump_forward_compare(model, backend, args.max_tokens, args.rounds,
                                           args.disable_any_whitespace)  # fmt: skip
        print(f"load after: {os.getloadavg()}")
        print(f"jump_forward_speedup: {speedup:.3f}")
        return
    if args.speculative:  # --device-fsm with it: both engines with the device FSM on
        for backend in args.backends:
            print(f"{backend}, max_tokens {args.max_tokens}:")
            speedup = speculative_compare(model, backend, args.max_tokens, args.rounds, args.k,
                                          args.device_fsm)  # fmt: skip
        print(f"load after: {os.getloadavg()}")
        print(f"constrained_speculation_speedup: {speedup:.3f}")
        return
    if args.device_fsm:
        device_fsm_compare(model, args)
        return
    if args.overlap:
        for backend, share in overlap_compare(model, args).items():
            print(f"mask_fill_hidden_share[{backend}]: {share:.3f}")
        return
    ratio = 0.0
    for backend in args.backends:
        llm = LLM(model, max_model_len=256, max_num_seqs=max(args.batch_sizes),
                  structured_outputs_config={"backend": backend})  # fmt: skip
        print(f"{backend}: valid {validity(llm, args.max_tokens):.0%} of {len(CASES)} cases")
        for b in args.batch_sizes:
            plain, cons = step_times(llm, b, args.max_tokens, args.rounds)
            ratio = cons / plain
            print(f"{backend} B={b}: {plain * 1e3:.2f} ms/step unconstrained,"
                  f" {cons * 1e3:.2f} constrained ({ratio:.2f}x)")  # fmt: skip
    print(f"load after: {os.getloadavg()}")
    print(f"constrained_step_ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
