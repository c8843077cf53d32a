"""Synthetic ShareGPT-like and Alpaca-like prompt/output lengths (see docs/workloads.md).

Independent lognormals, rounded, filtered by vLLM's sampling rules (rejection), with the
log-means calibrated so the filtered means equal the paper's (Fig. 11).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

# vLLM's benchmark sampler rules (benchmark_serving.py / ShareGPTDataset).
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

_CALIBRATION_SAMPLES = 200_000
_CALIBRATION_SEED = 20230912
_CHUNK = 8192  # fixed draw size, so the first K requests do not depend on how many are asked


@dataclass(frozen=True)
class LengthSpec:
    """A dataset's target means (after filtering) and lognormal sigmas (before scaling)."""

    name: str
    mean_prompt: float
    mean_output: float
    sigma_prompt: float
    sigma_output: float


# Means: the paper's Fig. 11. Sigmas: our assumption, documented in docs/workloads.md.
LENGTH_SPECS: dict[str, LengthSpec] = {
    "sharegpt": LengthSpec("sharegpt", 161.31, 337.99, 1.3, 1.0),
    "alpaca": LengthSpec("alpaca", 19.31, 58.45, 0.6, 0.9),
}


def valid_pairs(prompt_len: np.ndarray, output_len: np.ndarray) -> np.ndarray:
    """bool[N]: vLLM's rules: prompt, output >= 4; prompt <= 1024; prompt + output <= 2048."""
    prompt_len = np.asarray(prompt_len)
    output_len = np.asarray(output_len)
    return (
        (prompt_len >= MIN_LEN)
        & (output_len >= MIN_LEN)
        & (prompt_len <= MAX_PROMPT_LEN)
        & (prompt_len + output_len <= MAX_TOTAL_LEN)
    )


def _lengths(mu: float, sigma: float, z: np.ndarray) -> np.ndarray:
    # Cap before exp: values past 2^20 are rejected anyway and must not overflow int64.
    return np.rint(np.exp(np.minimum(mu + sigma * z, 20.0))).astype(np.int64)


def _get_spec(dataset: str) -> LengthSpec:
    if dataset not in LENGTH_SPECS:
        raise ValueError(f"dataset must be one of {sorted(LENGTH_SPECS)}, got {dataset!r}")
    return LENGTH_SPECS[dataset]


def _check_spread(spread_scale: float) -> None:
    if not (np.isfinite(spread_scale) and spread_scale > 0):
        raise ValueError(f"spread_scale must be a positive finite number, got {spread_scale}")


@functools.lru_cache(maxsize=32)
def calibrate_mu(dataset: str, spread_scale: float = 1.0) -> tuple[float, float]:
    """(mu_prompt, mu_output) whose filtered, rounded lognormal means equal the targets.

    Fixed-point iteration mu <- mu + log(target / filtered_mean) over a fixed sample of
    standard-normal pairs (common random numbers: deterministic and smooth in mu).
    """
    spec = _get_spec(dataset)
    _check_spread(spread_scale)
    s_in, s_out = spec.sigma_prompt * spread_scale, spec.sigma_output * spread_scale
    z_in, z_out = np.random.default_rng(_CALIBRATION_SEED).standard_normal(
        (2, _CALIBRATION_SAMPLES)
    )
    # Start from the untruncated lognormal: mean = exp(mu + sigma^2 / 2).
    mu_in = np.log(spec.mean_prompt) - s_in**2 / 2
    mu_out = np.log(spec.mean_output) - s_out**2 / 2
    for _ in range(200):
        p, o = _lengths(mu_in, s_in, z_in), _lengths(mu_out, s_out, z_out)
        ok = valid_pairs(p, o)
        if ok.sum() < _CALIBRATION_SAMPLES // 100:
            raise ValueError(
                f"spread_scale={spread_scale} leaves too few valid {dataset} pairs to calibrate"
            )
        err_in = np.log(spec.mean_prompt / p[ok].mean())
        err_out = np.log(spec.mean_output / o[ok].mean())
        if max(abs(err_in), abs(err_out)) < 1e-5:
            break
        mu_in, mu_out = mu_in + err_in, mu_out + err_out
    else:
        raise ValueError(
            f"mu calibration for {dataset!r} at spread_scale={spread_scale} did not converge"
        )
    return float(mu_in), float(mu_out)


def sample_lengths(
    dataset: str,
    num_requests: int,
    rng: np.random.Generator | int,
    spread_scale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Draws `num_requests` (prompt_len, output_len) pairs that satisfy `valid_pairs`.

    Args:
        dataset: "sharegpt" or "alpaca".
        num_requests: how many pairs.
        rng: a numpy Generator or an integer seed.
        spread_scale: multiplies both lognormal sigmas (1.0 = documented default).

    Returns:
        (prompt_len int32[N], output_len int32[N]). Deterministic given the seed; the first
        K pairs are the same whatever `num_requests` >= K is asked.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    spec = _get_spec(dataset)
    mu_in, mu_out = calibrate_mu(dataset, float(spread_scale))
    s_in, s_out = spec.sigma_prompt * spread_scale, spec.sigma_output * spread_scale
    rng = np.random.default_rng(rng)
    prompts: list[np.ndarray] = []
    outputs: list[np.ndarray] = []
    have = 0
    while have < num_requests:
        z_in, z_out = rng.standard_normal((2, _CHUNK))
        p, o = _lengths(mu_in, s_in, z_in), _lengths(mu_out, s_out, z_out)
        ok = valid_pairs(p, o)
        prompts.append(p[ok])
        outputs.append(o[ok])
        have += int(ok.sum())
    if not prompts:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    prompt = np.concatenate(prompts)[:num_requests].astype(np.int32)
    output = np.concatenate(outputs)[:num_requests].astype(np.int32)
    return prompt, output
