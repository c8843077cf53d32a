"""Could a layer-skip draft pay on this model? Early-exit agreement per depth, and the
batch-1 speed-up it would give under a simple cost model.

For each N, the target's first N layers followed by its final norm and LM head (exactly
what ``{"method": "draft_model", "model": "self", "draft_num_layers": N}`` drafts with)
predict the next token of the repository's fixed text (teacher forcing); the agreement
with the full model's top-1 estimates the per-token acceptance a of a greedy draft.
The expected speed-up at batch 1 with k drafts is E[tokens per step] / cost per step
= ((1 - a^(k+1)) / (1 - a)) / (1 + k * c), where c = the draft's cost over the target's,
estimated from parameter counts (decode on a CPU streams the weights: N layers plus the
LM head, over 30 layers plus the head); the verification step is taken to cost one
plain step (its overhead is measured in benchmarks/speculative.py, not here), so the
printed figure is an upper bound.

    python benchmarks/layer_exit_agreement.py [--window 512] [--windows 4]

Runs transformers on the real model's GGUF file (the ``test`` extra); prints a table.
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def speedup_bound(acceptance: float, k: int, cost: float) -> float:
    """Expected tokens per step over the step's cost (one plain step + k drafts of
    relative cost ``cost``), drafts accepted independently with probability acceptance."""
    tokens = k + 1 if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
    return tokens / (1 + k * cost)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--max-k", type=int, default=8)
    a = ap.parse_args()
    import torch

    from pagedjax.eval.hf_reference import load_hf_gguf
    from pagedjax.eval.texts import load_text, text_source
    from pagedjax.model.catalog import cached_model_path

    model, tok = load_hf_gguf(cached_model_path(a.model))
    ids = tok(load_text(), add_special_tokens=False)["input_ids"]
    ids = ids[: a.window * a.windows]
    inner = model.model
    n_layers = len(inner.layers)
    agree = np.zeros(n_layers + 1)
    count = 0
    with torch.no_grad():
        for w in range(0, len(ids), a.window):
            x = torch.tensor([ids[w : w + a.window]])
            out = model(x, output_hidden_states=True)
            full = out.logits[0].argmax(-1)
            # hidden_states[N] is the output of layer N (0 = embeddings), before the norm,
            # except the last, which transformers returns normed (the full model itself).
            for n, h in enumerate(out.hidden_states[:-1]):
                pred = model.lm_head(inner.norm(h))[0].argmax(-1)
                agree[n] += (pred == full).sum().item()
            agree[n_layers] += x.shape[1]
            count += x.shape[1]
    agree /= count
    layer_params = sum(p.numel() for p in inner.layers[0].parameters())
    head_params = model.lm_head.weight.numel()
    full_cost = n_layers * layer_params + head_params
    print(f"{a.model}: {count} positions of {text_source()}; load {os.getloadavg()[0]:.1f}")
    print("| draft layers N | agreement with the full model | cost c | best k | speed-up bound |")
    print("|---|---|---|---|---|")
    for n in range(1, n_layers + 1):
        acc = float(agree[n])
        c = (n * layer_params + head_params) / full_cost
        best = max((speedup_bound(acc, k, c), k) for k in range(1, a.max_k + 1))
        print(f"| {n} | {acc:.3f} | {c:.2f} | {best[1]} | {best[0]:.2f} |")


if __name__ == "__main__":
    main()
