"""Structured outputs: validity per backend, and decode-step time constrained vs not.

    python benchmarks/structured_outputs.py [--model smollm2-135m-instruct | --tiny]
        [--backends xgrammar guidance] [--batch-sizes 1 16] [--max-tokens 48]

A skeleton of issue 33's benchmark (docs/structured_outputs.md): a fixed set of JSON
schemas, regexes and choice lists (``CASES``; the issue asks for 30 / 10 / 10, this holds
fewer), greedy. For each backend: every case once, the share of outputs that are valid
(JSON parsing plus the schema's required keys, checked here without jsonschema;
regexes with ``re.fullmatch``; choices by membership; an output cut by max_tokens counts
as invalid). Then, per batch size B, B requests under a regex no output can finish vs
B unconstrained requests, all running exactly max_tokens steps, stepped to completion
once to compile, then ``--rounds`` interleaved pairs; the fastest wall time per engine
step of each is reported (the box is shared).
``--tiny``: the random tiny-llama preset with the byte tokenizer
(smoke runs; its outputs are not meaningful text). Prints the load before and after; the
last line is ``constrained_step_ratio: R`` at the largest B.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

from pagedjax import LLM
from pagedjax.sampling import SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
}  # fmt: skip
CASES: list[tuple[str, dict]] = [
    ("json", {"json": PERSON}),
    ("json", {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                       "required": ["ok"]}}),  # fmt: skip
    ("json", {"json": {"type": "object", "properties": {"color": {"enum": ["red", "green",
              "blue"]}}, "required": ["color"]}}),  # fmt: skip
    ("json", {"json": {"type": "object", "properties": {"tags": {"type": "array", "items":
              {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["tags"]}}),  # fmt: skip
    ("json", {"json": {"$defs": {"p": PERSON}, "type": "object",
                       "properties": {"owner": {"$ref": "#/$defs/p"}}, "required": ["owner"]}}),
    ("regex", {"regex": r"\d{3}-\d{4}"}),
    ("regex", {"regex": r"(yes|no), because [a-z ]{1,20}\."}),
    ("regex", {"regex": r"[A-Z][a-z]{2,8}"}),
    ("choice", {"choice": ["positive", "negative", "neutral"]}),
    ("choice", {"choice": ["Paris", "London", "Rome", "Madrid"]}),
]
PROMPT = "Answer in the requested format. Describe a person, a color or a city: "


def _valid(kind: str, spec: dict, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(spec["regex"], text) is not None
    if kind == "choice":
        return text in spec["choice"]
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    schema = spec["json"]
    return isinstance(doc, dict) and all(k in doc for k in schema.get("required", []))


def validity(llm: LLM, max_tokens: int) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(**spec))
              for _, spec in CASES]  # fmt: skip
    outs = llm.generate([PROMPT] * len(CASES), params, use_tqdm=False)
    ok = [_valid(k, s, o.outputs[0].text) and o.outputs[0].finish_reason == "stop"
          for (k, s), o in zip(CASES, outs, strict=True)]  # fmt: skip
    return sum(ok) / len(ok)


def step_time(llm: LLM, batch: int, max_tokens: int, constrained: bool) -> float:
    """Seconds per engine step over ``batch`` requests, one run."""
    engine = llm.llm_engine
    # Every row runs exactly max_tokens steps either way (a constrained row finishing
    # early would leave fewer rows per step): a regex longer than any output, EOS ignored.
    so = StructuredOutputsParams(regex="[a-z ]{400}") if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            structured_outputs=so)  # fmt: skip
    tag = f"{constrained}-{time.perf_counter_ns()}"
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", PROMPT, params)
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / max(steps, 1)


def step_times(llm: LLM, batch: int, max_tokens: int, rounds: int) -> tuple[float, float]:
    """(unconstrained, constrained) seconds per step: a first pair compiles, then
    ``rounds`` interleaved pairs; the fastest of each (the box is shared: load drifts)."""
    step_time(llm, batch, max_tokens, False)
    step_time(llm, batch, max_tokens, True)
    pairs = [(step_time(llm, batch, max_tokens, False), step_time(llm, batch, max_tokens, True))
             for _ in range(rounds)]  # fmt: skip
    return min(p[0] for p in pairs), min(p[1] for p in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tiny", action="store_true", help="the random tiny-llama preset")
    ap.add_argument("--backends", nargs="+", default=["xgrammar", "guidance"])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed pairs")
    args = ap.parse_args()
    model = "tiny-llama" if args.tiny else args.model
    print(f"load before: {os.getloadavg()}")
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
