"""Speculative decoding on the real small model (CPU): n-gram, layer-skip draft, EAGLE vs none.

    python benchmarks/speculative.py [--batch-sizes 1 8 64] [--max-tokens 64]
        [--methods none ngram draft eagle] [--workloads copy chat] [--k 4]
        [--draft-layers 8] [--eagle-dir DIR] [--medusa-dir DIR] [--draft-model NAME_OR_DIR]
        [--batch1-prompts N] [--rounds R] [--tree-budget N] [--tree-top-k K] [--eagle3-dir DIR]

Model: SmolLM2-135M-Instruct (``LLM(model="smollm2-135m-instruct")``), greedy.
Workloads, each rendered by the chat template:
- copy: "Repeat the following text exactly" over a ~60-word passage of the bundled
  Alice text (the output copies the prompt: n-gram lookup's favourable case, like
  summarisation / extraction / code edits);
- chat: the 20 eval questions (pagedjax/eval/chat.py).
Methods (NAME or NAME@K, e.g. eagle@3: that method with k = K; a "+sN" suffix, e.g.
ngram+s8 or none+s8, runs it with num_scheduler_steps N, the fused N-step program,
where the n-gram method drafts and verifies on device): none (the default
engine: K-step decode loop), ngram ({"method": "ngram",
"num_speculative_tokens": k, "prompt_lookup_max": 4}), ngramauto (the same with
"auto_num_speculative_tokens": true: k per row and step from the measured acceptance and
step cost, down to 0, engine/spec/k_schedule.py), ngramtree (the same with pagedjax's
"tree": {"budget": N, "top_k": K}: up to K earlier continuations merged into a trie of N
nodes, depth <= k, verified in one step with the tree mask, engine/spec/tree.py),
eagletree / eagle3tree (eagle / eagle3 with the same "tree" key: the head's top K first
tokens, each continued as a chain, K * min(k, N // K) nodes, engine/spec/eagle_tree.py),
eagledyntree (eagletree with "dynamic": true: EAGLE-2's dynamic tree, the same node
count, each level the K best of the previous level's K x K children by cumulative draft
log-probability), NAMEauto for any method NAME (eagleauto, eagletreeauto,
eagledyntreeauto, eagle3auto, medusaauto, ngramtreeauto, draftauto:
NAME with "auto_num_speculative_tokens": true; trees are cut by levels), draft
({"method": "draft_model", "model": "self", "draft_num_layers": N}: the model's own first
N layers), eagle
({"method": "eagle", "model": DIR}: a head trained by ``python -m
pagedjax.tools.train_eagle``; DIR defaults to where that writes it), eagle3
({"method": "eagle3", "model": DIR}: an EAGLE-3 head trained by ``python -m
pagedjax.tools.train_eagle3``, ``--eagle3-dir``, DIR likewise), medusa
({"method": "medusa", "model": DIR}: heads trained by ``python -m
pagedjax.tools.train_medusa``, DIR likewise), draftmodel
({"method": "draft_model", "model": NAME_OR_DIR}: a separate draft checkpoint with its own
KV pool; default the model itself, the upper bound of acceptance at the cost of a second
full model; no smaller real model with SmolLM2's vocabulary is available offline).

For each (workload, batch size B), every method in turn (engines built first, so the
ratios compare runs made under the same machine load; the first method listed is the
baseline): the first B prompts (cycled) are added at once and stepped to completion
twice, the first run compiling what the second uses; the second is timed
(``--rounds R``: R timed runs per method, interleaved across methods, summed; the
row lists each round's ratio too). At batch 1
``--batch1-prompts N`` runs the first N prompts one at a time (each alone in the
engine; tok/s over all of them), since a single short answer is a few steps.
Reported: output tokens/s, mean request latency (add -> finished), tokens per engine
step (all rows; at batch 1 the tokens each step emits),
the ratio to "none", the acceptance rate, the mean accepted length (tokens per
speculating row-step, bonus included) and whether the outputs equal "none"'s. Prints
the load (``os.getloadavg``) before and after; the box is shared, so compare ratios
from one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from pagedjax import LLM
from pagedjax.eval.chat import QUESTIONS, conversation
from pagedjax.eval.texts import load_text
from pagedjax.sampling import SamplingParams
from pagedjax.tools.train_eagle import default_out
from pagedjax.tools.train_eagle3 import default_out as eagle3_out
from pagedjax.tools.train_medusa import default_out as medusa_out

MODEL = "smollm2-135m-instruct"


def copy_prompts(count: int = 20, words: int = 60) -> list[str]:
    text = " ".join(load_text("alice").split())
    toks = text.split(" ")
    out = []
    for i in range(count):
        passage = " ".join(toks[2000 + i * words : 2000 + (i + 1) * words])
        out.append(f"Repeat the following text exactly, word for word:\n\n{passage}")
    return out


def prompt_ids(llm: LLM, questions: list[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    ids = []
    for q in questions:
        text = tok.apply_chat_template(conversation(q), add_generation_prompt=True)
        ids.append(tok.encode(text, add_special_tokens=False))
    return ids


def run_once(llm: LLM, prompts: list[list[int]], max_tokens: int, tag: str,
             waves: int = 1, reset: bool = True) -> dict:
    """Add the prompts in ``waves`` groups, each stepped to completion before the next
    is added (waves = len(prompts): one request at a time); times, tokens, outputs.
    A request's latency counts from its own wave's start."""
    eng = llm.llm_engine
    if reset:  # else the stats accumulate over calls (--rounds)
        eng.reset_stats()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    finish, outs = {}, {}
    wall, steps = 0.0, 0
    per = -(-len(prompts) // waves)
    for w in range(0, len(prompts), per):
        t0 = time.perf_counter()
        for i in range(w, min(w + per, len(prompts))):
            eng.add_request(f"{tag}-{i}", {"prompt_token_ids": prompts[i]}, sp)
        while eng.has_unfinished_requests():
            steps += 1
            for o in eng.step():
                if o.finished:
                    finish[o.request_id] = time.perf_counter() - t0
                    outs[o.request_id] = o.outputs[0].token_ids
        wall += time.perf_counter() - t0
    tokens = sum(len(v) for v in outs.values())
    order = [outs[f"{tag}-{i}"] for i in range(len(prompts))]
    return dict(seconds=wall, tokens=tokens, tok_s=tokens / wall, steps=steps,
                latency=sum(finish.values()) / len(finish), outputs=order,
                stats=eng.stats())  # fmt: skip


def compiled(llm: LLM) -> int:
    """Programs the engine has compiled (step, speculative): a method that compiles in a
    timed round pays seconds of compilation there (the table's "timed compiles")."""
    s = llm.llm_engine.stats()
    return int(s.get("compilations", 0)) + int(s.get("spec_compilations", 0))


def scheduler_steps(method: str) -> int | str:
    """num_scheduler_steps of a method: "...+sN" runs the fused N-step program (e.g.
    ngram+s8: n-gram drafts planned, scheduled and verified inside it); default "auto"."""
    _, _, steps = method.partition("+s")
    return int(steps) if steps else "auto"


def method_config(configs: dict, method: str) -> dict | None:
    """configs[method]; "NAME@K" is NAME with num_speculative_tokens K (e.g. eagle@3);
    a "+sN" suffix is ``scheduler_steps``'; "NAMEauto" (eagleauto, eagletreeauto, ...)
    is NAME with "auto_num_speculative_tokens": true (k, or a tree's levels, per row and
    step from the measured acceptance and step cost, engine/spec/k_schedule.py)."""
    name, _, k = method.split("+s")[0].partition("@")
    base = name.removesuffix("auto")
    if name not in configs and base != name and configs.get(base) is not None:
        configs = dict(configs, **{name: dict(configs[base], auto_num_speculative_tokens=True)})
    if name not in configs:
        raise SystemExit(f"unknown method {name!r}; known: {sorted(configs)}, each also as"
                         " NAMEauto (NAME or NAME@K)")  # fmt: skip
    cfg = configs[name]
    return cfg if not k or cfg is None else dict(cfg, num_speculative_tokens=int(k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--methods", nargs="+", default=["none", "ngram", "draft"])
    ap.add_argument("--workloads", nargs="+", default=["copy", "chat"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--eagle-dir", default=str(default_out(MODEL)))
    ap.add_argument("--eagle3-dir", default=str(eagle3_out(MODEL)))
    ap.add_argument("--medusa-dir", default=str(medusa_out(MODEL)))
    ap.add_argument("--draft-model", default=MODEL)
    ap.add_argument("--batch1-prompts", type=int, default=1,
                    help="at batch 1, run this many prompts one after another (default 1:"
                    " the first prompt only)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="timed rounds, the methods interleaved (round r starts at method r mod"
                    " M), summed: a shared box's load then weighs on every method alike")
    ap.add_argument("--tree-budget", type=int, default=16,
                    help="ngramtree / eagletree / eagledyntree: nodes per row")
    ap.add_argument("--tree-top-k", type=int, default=3,
                    help="ngramtree: continuations; eagletree / eagledyntree: branches")
    ap.add_argument("--warm-runs", type=int, default=1,
                    help="untimed runs per method first (compiling what they meet); with the"
                    " automatic rule a timed round can still meet a new program (the table's"
                    " timed compiles): 2 leaves fewer")
    ap.add_argument("--kv-cache-mib", type=int, default=1024,
                    help="each engine's KV pool (MiB); 512 is enough for batch 64 x 32 tokens"
                    " and lets a dozen engines fit in memory")
    ap.add_argument("--json", default=None, help="write the rows here too")
    a = ap.parse_args()
    print(f"load before: {os.getloadavg()}", flush=True)
    configs = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4},
        "ngramauto": {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4,
                      "auto_num_speculative_tokens": True},
        "ngramtree": {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_max": 4,
                      "tree": {"budget": a.tree_budget, "top_k": a.tree_top_k}},
        "eagletree": {"method": "eagle", "model": a.eagle_dir, "num_speculative_tokens": a.k,
                      "tree": {"budget": a.tree_budget, "top_k": a.tree_top_k}},
        "eagledyntree": {"method": "eagle", "model": a.eagle_dir, "num_speculative_tokens": a.k,
                         "tree": {"budget": a.tree_budget, "top_k": a.tree_top_k,
                                  "dynamic": True}},
        "draft": {"method": "draft_model", "model": "self", "num_speculative_tokens": a.k,
                  "draft_num_layers": a.draft_layers},
        "eagle": {"method": "eagle", "model": a.eagle_dir, "num_speculative_tokens": a.k},
        "eagle3": {"method": "eagle3", "model": a.eagle3_dir, "num_speculative_tokens": a.k},
        "eagle3tree": {"method": "eagle3", "model": a.eagle3_dir, "num_speculative_tokens": a.k,
                       "tree": {"budget": a.tree_budget, "top_k": a.tree_top_k}},
        "medusa": {"method": "medusa", "model": a.medusa_dir, "num_speculative_tokens": a.k},
        "draftmodel": {"method": "draft_model", "model": a.draft_model,
                       "num_speculative_tokens": a.k},
    }  # fmt: skip
    texts = {"copy": copy_prompts(), "chat": list(QUESTIONS)}
    # All engines first; then each (workload, batch) runs every method back to back, so
    # the ratios compare runs made under the same (shared, varying) machine load.
    llms = {
        m: LLM(model=MODEL, max_model_len=1024, max_num_seqs=max(a.batch_sizes),
               max_num_batched_tokens=1024, kv_cache_memory_bytes=a.kv_cache_mib << 20,
               warmup="none", speculative_config=method_config(configs, m),
               num_scheduler_steps=scheduler_steps(m))
        for m in a.methods
    }  # fmt: skip
    rows = []
    for wl in a.workloads:
        ids = prompt_ids(next(iter(llms.values())), texts[wl])
        for b in a.batch_sizes:
            n = a.batch1_prompts if b == 1 else b
            prompts = [ids[i % len(ids)] for i in range(n)]
            waves = len(prompts) // b
            compiled0 = {}
            for m, llm in llms.items():
                for w in range(a.warm_runs):
                    run_once(llm, prompts, a.max_tokens, f"warm{w}", waves=waves)
                compiled0[m] = compiled(llm)
            names = list(llms)
            runs: dict[str, list[dict]] = {m: [] for m in names}
            for rnd in range(a.rounds):
                for j in range(len(names)):
                    m = names[(rnd + j) % len(names)]
                    runs[m].append(run_once(llms[m], prompts, a.max_tokens, f"timed{rnd}",
                                            waves=waves, reset=rnd == 0))  # fmt: skip
            ref = None
            for method in names:
                rs = runs[method]
                secs = sum(x["seconds"] for x in rs)
                r = dict(rs[-1], tok_s=sum(x["tokens"] for x in rs) / secs,
                         latency=sum(x["latency"] for x in rs) / len(rs))  # fmt: skip
                ref = r if ref is None else ref  # the first method listed is the baseline
                base = runs[names[0]]
                per_round = [x["tok_s"] / y["tok_s"] for x, y in zip(rs, base, strict=True)]
                s = r["stats"]
                row = dict(
                    method=method, workload=wl, batch=b, tok_s=round(r["tok_s"], 1),
                    latency_s=round(r["latency"], 3),
                    ratio=round(r["tok_s"] / ref["tok_s"], 2),
                    median_ratio=round(float(np.median(per_round)), 2),
                    round_ratios=[round(x, 2) for x in per_round],
                    acceptance=round(s.get("spec_acceptance_rate", 0.0), 3),
                    mean_accepted_len=round(s.get("spec_mean_accepted_length", 0.0), 2),
                    tokens_per_step=round(sum(x["tokens"] for x in rs)
                                          / max(sum(x["steps"] for x in rs), 1), 2),
                    proposed_per_step=round(s.get("spec_proposals_per_step", 0.0), 1),
                    fused_steps=s.get("spec_fused_steps", 0),
                    same_as_none=r["outputs"] == ref["outputs"], tokens=r["tokens"],
                    timed_compiles=compiled(llms[method]) - compiled0[method],
                    load=round(os.getloadavg()[0], 1),
                )  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"load after: {os.getloadavg()}")
    print("| workload | batch | method | tok/s | mean latency s | vs none | median of rounds"
          " (rounds) | acceptance | mean accepted len | tokens per step | drafts per step |"
          " same outputs | timed compiles | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rounds = ", ".join(str(x) for x in r["round_ratios"])
        print(f"| {r['workload']} | {r['batch']} | {r['method']} | {r['tok_s']} |"
              f" {r['latency_s']} | {r['ratio']} | {r['median_ratio']} ({rounds}) |"
              f" {r['acceptance']} |"
              f" {r['mean_accepted_len']} | {r['tokens_per_step']} | {r['proposed_per_step']} |"
              f" {r['same_as_none']} | {r['timed_compiles']} | {r['load']} |")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
