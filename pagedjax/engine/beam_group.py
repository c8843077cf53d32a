"""Hugging Face's beam search rules for one prompt (host side), and the returned outputs.

``BeamGroup.advance`` is transformers' ``generate(num_beams=k, do_sample=False)`` step for
one batch item: given each live beam's top candidates it keeps the best finished
hypotheses (length-normalised) and the next live beams, and decides when the search
ends. It knows nothing of the engine: ``beams.py`` runs the beams on engine slots and
feeds it each step's candidates. The outputs use vLLM's ``BeamSearchOutput`` /
``BeamSearchSequence`` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedjax.engine.outputs import Logprob
from pagedjax.engine.sequence import RequestState
from pagedjax.sampling import SAMPLING_EPS, BeamSearchParams

NEG = -1.0e9  # Hugging Face's "impossible" score offset


@dataclass
class BeamSearchSequence:
    """One returned hypothesis (vLLM's fields, plus ``score``).

    tokens: prompt + generated ids (an EOS that ended it included). logprobs: per
    generated position, {token_id: Logprob} of the candidates ranked there (2 *
    beam_width, more with several EOS ids). cum_logprob: sum of the chosen tokens'
    (temperature-scaled) log-probs.
    text: tokens decoded (prompt included, as vLLM). finish_reason: "stop" (EOS) or
    "length". score: Hugging Face's ``sequences_scores`` value,
    cum_logprob / generated_len ** length_penalty.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """The beam_width best hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class Beam:
    tokens: list[int]  # generated ids
    score: np.float32  # cumulative log-prob, accumulated in float32 as transformers does
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


@dataclass
class FinishedHypothesis:
    score: float  # normalised (length penalty); NEG-offset entries are placeholders
    beam: Beam | None
    done: bool


class BeamGroup:
    """One prompt's search state: Hugging Face's beam search for one batch item.

    ``running`` holds the live beams best first (beam i lives in ``slots[i]``);
    ``finished`` the beam_width best finished hypotheses, best first, padded with
    placeholders as transformers pads with -1e9.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], max_new: int, p: BeamSearchParams,
                 eos: set[int]):  # fmt: skip
        self.request_id, self.prompt_ids, self.max_new = request_id, prompt_ids, max_new
        self.k, self.lp, self.early = p.beam_width, p.length_penalty, p.early_stopping
        self.temperature = p.temperature if p.temperature >= SAMPLING_EPS else 1.0
        self.eos = eos
        # transformers keeps max(2, 1 + #EOS ids) * k candidates per step, so that k of
        # them do not end in EOS; each beam's own top that many are enough to find them.
        self.num_candidates = max(2, 1 + len(eos)) * self.k
        self.running = [Beam([], np.float32(0.0))]
        self.finished = [FinishedHypothesis(NEG, None, False) for _ in range(self.k)]
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.slots: list[int] = []
        self.block_bound = 0  # group_block_bound, set by beam_search
        self.steps = 0  # tokens generated so far by every running beam
        self.req: RequestState | None = None
        self.done = False

    def advance(self, cands: list[list[tuple[int, float, dict]]]) -> list[tuple[int, int]]:
        """One step given each running beam's top-2k (token, logprob, step's logprobs)
        candidates.

        Returns the new running beams as (parent beam index, token) best first, or []
        when the search ended (``self.done``).
        """
        k = self.k
        flat = []
        for b, beam in enumerate(self.running):
            for rank, (tok, lp, _) in enumerate(cands[b]):
                flat.append((np.float32(beam.score + np.float32(lp)), b, rank, tok))
        flat.sort(key=lambda c: (-float(c[0]), c[1], c[2]))
        top = flat[: self.num_candidates]
        last = self.steps + 1 >= self.max_new
        hits = [last or c[3] in self.eos for c in top]

        def child(c) -> Beam:
            score, b, rank, tok = c
            parent = self.running[b]
            return Beam(parent.tokens + [tok], score, parent.logprobs + [cands[b][rank][2]])

        # Finished hypotheses: only the top k candidates may be finalised.
        all_done = all(f.done for f in self.finished)
        norm = float((self.steps + 1) ** self.lp)
        new = []
        for j, c in enumerate(top):
            just = hits[j] and j < k
            s = float(c[0]) / norm
            if all_done and self.early is True:
                s += NEG
            if not self.improvable:
                s += NEG
            if not just:
                s += NEG
            new.append(FinishedHypothesis(s, child(c) if just else None, just))
        merged = self.finished + new
        order = sorted(range(len(merged)), key=lambda i: -merged[i].score)  # stable
        self.finished = [merged[i] for i in order[:k]]

        # Running beams for the next step: the best non-finishing candidates.
        keep = [j for j in range(len(top)) if not hits[j]][:k]
        self.steps += 1
        if not keep:
            self.done = True
            return []
        self.running = [child(top[j]) for j in keep]

        # transformers' _check_early_stop_heuristic and stopping condition.
        if self.early == "never" and self.lp > 0.0:
            best_len = self.max_new
        else:
            best_len = self.steps
        best = float(self.running[0].score) / float(best_len**self.lp)
        worst = min(f.score for f in self.finished)
        self.improvable = self.improvable and any(
            best > (worst if f.done else NEG) for f in self.finished
        )
        all_done = all(f.done for f in self.finished)
        if not self.improvable or (all_done and self.early is True) or all(hits):
            self.done = True
            return []
        return [(top[j][1], top[j][3]) for j in keep]

    def results(self, decode) -> BeamSearchOutput:
        out = []
        for f in self.finished:
            if not f.done or f.beam is None:
                continue
            b = f.beam
            tokens = self.prompt_ids + b.tokens
            stop = bool(b.tokens) and b.tokens[-1] in self.eos
            out.append(
                BeamSearchSequence(
                    tokens=tokens,
                    logprobs=b.logprobs,
                    cum_logprob=float(b.score),
                    text=decode(tokens),
                    finish_reason="stop" if stop else "length",
                    score=f.score,
                )
            )
        return BeamSearchOutput(out)


__all__ = [
    "NEG",
    "Beam",
    "BeamGroup",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "FinishedHypothesis",
]
