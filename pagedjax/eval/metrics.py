"""Quality metrics between a reference and a candidate scored on the same tokens.

top-1 agreement: the fraction of positions where both put the same token first; the
measure quantization, KV-cache quantization and speculative decoding bound (a greedy
continuation starts to differ where it fails).

KL divergence KL(reference || candidate), from top-k lists: per position the tokens in
the reference's top-k whose candidate log-prob is also known (in the candidate's top-k,
or the actual next token, known on both sides) are kept as their own bins and every
other token is pooled into one "rest" bin on each side; the KL of these coarse
distributions is computed exactly. By the data-processing inequality it is a lower bound
on the full-vocabulary KL, equal to it when the bins hold all the mass; ``kl_mass`` is
the mean reference mass the kept bins hold (near 1 for similar models with k = 20), so a
reader sees how tight the bound is.
"""

from __future__ import annotations

import numpy as np

from pagedjax.eval.scoring import TokenScores


def _check_same_tokens(ref: TokenScores, cand: TokenScores) -> None:
    if ref.num_positions != cand.num_positions or not np.array_equal(
        ref.target_ids, cand.target_ids
    ):
        raise ValueError("reference and candidate were scored on different tokens")


def top1_agreement(ref: TokenScores, cand: TokenScores) -> float:
    """Fraction of positions whose most likely token is the same for both."""
    _check_same_tokens(ref, cand)
    return float(np.mean(ref.top_ids[:, 0] == cand.top_ids[:, 0]))


def binned_kl(ref: TokenScores, cand: TokenScores) -> tuple[np.ndarray, np.ndarray]:
    """(kl float64[M], mass float64[M]): per-position KL(ref || cand) over the shared
    top-k bins plus a rest bin (a lower bound on the full KL), and the reference mass of
    the shared bins. See the module docstring."""
    _check_same_tokens(ref, cand)
    m = ref.num_positions
    kl = np.zeros(m)
    mass = np.zeros(m)
    for i in range(m):
        cand_lp = dict(zip(cand.top_ids[i].tolist(), cand.top_logprobs[i].tolist(), strict=True))
        cand_lp[int(cand.target_ids[i])] = float(cand.target_logprobs[i])
        ref_lp = dict(zip(ref.top_ids[i].tolist(), ref.top_logprobs[i].tolist(), strict=True))
        ref_lp[int(ref.target_ids[i])] = float(ref.target_logprobs[i])
        shared = [t for t in ref_lp if t in cand_lp]
        lp = np.array([ref_lp[t] for t in shared])
        lq = np.array([cand_lp[t] for t in shared])
        p, q = np.exp(lp), np.exp(lq)
        p_rest = max(1.0 - p.sum(), 0.0)
        q_rest = max(1.0 - q.sum(), 1e-30)
        kl[i] = float(np.sum(p * (lp - lq)))
        if p_rest > 0.0:
            kl[i] += p_rest * np.log(p_rest / q_rest)
        mass[i] = p.sum()
    return kl, mass


def quality_report(ref: TokenScores, cand: TokenScores) -> dict[str, float]:
    """Every metric of a candidate against a reference on the same tokens.

    Keys: num_tokens (scored positions), ppl_reference, ppl_candidate, ppl_rel_diff
    ((cand - ref) / ref), nll_diff (nats per token), top1_agreement, kl (mean binned
    KL(ref || cand), nats), kl_max, kl_mass (mean reference mass in the kept bins).
    """
    kl, mass = binned_kl(ref, cand)
    return {
        "num_tokens": ref.num_positions,
        "ppl_reference": ref.perplexity,
        "ppl_candidate": cand.perplexity,
        "ppl_rel_diff": (cand.perplexity - ref.perplexity) / ref.perplexity,
        "nll_diff": cand.nll - ref.nll,
        "top1_agreement": top1_agreement(ref, cand),
        "kl": float(kl.mean()),
        "kl_max": float(kl.max()),
        "kl_mass": float(mass.mean()),
    }
