"""Host-side request bookkeeping: each sample's ids, text, logprobs and finish state."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedjax.engine.detokenizer import IncrementalDetokenizer
from pagedjax.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedjax.sampling import SamplingParams
from pagedjax.structured import DEAD_END_REASON


@dataclass
class MaskFills:
    """Grammar mask fills on the host and their seconds (one per engine, owned by
    ``LogitControls``; each constrained sample adds to it)."""

    fills: int = 0
    seconds: float = 0.0


@dataclass
class SequenceState:
    """One of a request's n samples.

    target: output length at which it finishes by length (min(max_tokens, max_model_len -
    prompt), >= 1: the scheduler's output_target, so host and device agree).
    arrival: FCFS order key given to the scheduler. slot: its scheduler slot, None while
    queued on the host or after it finished.
    """

    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    target: int
    arrival: int
    slot: int | None = None
    cumulative_logprob: float = 0.0
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Chained hashes of the full blocks of prompt + output so far (prefix caching).
    hashes: list[int] = field(default_factory=list)
    # Each token's raw logprob, kept when the engine does not detokenize (see
    # CompletionOutput.sampled_logprobs); None otherwise.
    sampled_logprobs: list[float] | None = None
    # Structured outputs: the grammar matcher (pagedjax/structured Guide; None: no
    # constraint) and its packed mask of the tokens allowed next, int32[ceil(V / 32)]
    # (read through ``grammar_mask``: filled when first read after a token, so the
    # one-step path can fill it while the device runs the forward, llm_engine._run).
    guide: Any = None
    _mask: np.ndarray | None = None
    _mask_pending: bool = False
    _fills: MaskFills | None = None
    # The last fill found no allowed token: the next recorded token is not appended, it
    # finishes the sample (DEAD_END_REASON) instead.
    dead_end: bool = False
    # Or the device FSM (structured/token_fsm.TokenFsm; StructuredOutputsConfig.device_fsm):
    # the device applies its mask; this host mirror of its state advances with each
    # recorded token, and is what the slot's sampling row is written from between programs.
    fsm: Any = None
    fsm_state: int = -1
    # The device FSM's reasoning gate (structured/reasoning.ReasoningGate; None: the FSM
    # applies from the first token). Host-mask rows keep theirs inside the guide.
    reasoning: Any = None

    @property
    def in_reasoning(self) -> bool:
        """A device FSM row whose constraint waits for the end of the reasoning."""
        return self.reasoning is not None and self.reasoning.open

    def start_guide(self, guide: Any, words: int, fills: MaskFills | None = None) -> None:
        """Constrain this sample by ``guide`` (at its start state): the first mask, filled
        now; fills: the engine's counter, which every fill of this sample adds to."""
        self.guide = guide
        self._mask = np.zeros(words, np.int32)
        self._mask_pending = True
        self._fills = fills
        self.fill_pending_mask()

    @property
    def grammar_mask(self) -> np.ndarray | None:
        """int32[W]: the tokens the grammar allows next (None: no grammar); filled now if
        a token was accepted since the last fill."""
        self.fill_pending_mask()
        return self._mask

    @property
    def mask_pending(self) -> bool:
        """True when the grammar took a token and its mask is not filled yet."""
        return self._mask_pending

    def fill_pending_mask(self) -> bool:
        """Fill the grammar's mask if a token was accepted since the last fill. An empty
        mask (a dead end: no token allowed) marks ``dead_end``. Returns True when it
        filled (the host's grammar work: what the one-step path overlaps)."""
        if not self._mask_pending:
            return False
        t0 = time.perf_counter()
        self._mask_pending = False
        mask = self._mask
        mask.fill(0)
        self.guide.fill_mask(mask)
        self.dead_end = not mask.any()
        if self._fills is not None:
            self._fills.fills += 1
            self._fills.seconds += time.perf_counter() - t0
        return True

    def record(
        self,
        tok: int,
        logprob: float,
        top: tuple[int, np.ndarray, np.ndarray] | None,
        eos_ids: set[int],
    ) -> bool:
        """Append a sampled token (its raw logprob; top = (rank, top ids, top logprobs)
        when logprobs were fetched) and check the stop rules in vLLM's order: EOS, stop
        token ids, stop strings, length. Returns True when the sequence finished. After
        a dead end (the grammar's last fill allowed no token, so the row sampled under an
        empty mask) the token is not appended: the sample finishes with DEAD_END_REASON.
        """
        if self.dead_end:
            self.finish_reason, self.stop_reason = "stop", DEAD_END_REASON
            return True
        self.cumulative_logprob += logprob
        if self.sampled_logprobs is not None:
            self.sampled_logprobs.append(logprob)
        stop_str = self.detok.append(tok)
        if self.logprobs is not None and top is not None:
            self.logprobs.append(self._logprob_entry(tok, logprob, top))
        self._check_stop(tok, stop_str, eos_ids)
        if self.guide is not None and self.finish_reason is None:
            self._advance_guide(tok)
        if self.in_reasoning and self.finish_reason is None:
            if self.reasoning.feed(tok):  # the end tag: the FSM applies from the next token
                self.fsm_state = self.fsm.initial
        elif self.fsm is not None and self.finish_reason is None:
            # EOS here (ignore_eos) ends the grammar: nothing is allowed after it; a
            # refused token is never sampled under the mask. The host path's dead end.
            self.fsm_state = -1 if tok in eos_ids else self.fsm.next_state(self.fsm_state, tok)
            if self.fsm_state < 0:
                self.finish_reason, self.stop_reason = "stop", DEAD_END_REASON
        return self.finish_reason is not None

    def _check_stop(self, tok: int, stop_str: str | None, eos_ids: set[int]) -> None:
        if tok in eos_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
        elif tok in self.params.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", tok
        elif stop_str is not None:
            self.finish_reason, self.stop_reason = "stop", stop_str
        elif len(self.detok.ids) >= self.target:
            self.finish_reason = "length"

    def record_forced(self, tokens: list[int], eos_ids: set[int]) -> int:
        """Append tokens the grammar forced after the last sampled one (jump-forward
        decoding, engine/jump_forward.py); the guide has already accepted them. Each is
        an output token like a sampled one (text, stop strings, stop ids, length checked
        after each, in ``record``'s order) with logprob 0.0: it was not sampled, the
        constraint left no choice (cumulative_logprob unchanged; with logprobs asked for,
        its entry holds only itself, rank 1). The grammar mask is refilled once, after
        the last (now: a dead end there finishes the sample at once). Returns how many
        were appended (fewer when one finished the sample)."""
        n = 0
        for tok in tokens:
            n += 1
            if self.sampled_logprobs is not None:
                self.sampled_logprobs.append(0.0)
            stop_str = self.detok.append(tok)
            if self.logprobs is not None:
                self.logprobs.append({tok: Logprob(0.0, 1, self.detok.tokenizer.decode([tok]))})
            self._check_stop(tok, stop_str, eos_ids)
            if self.finish_reason is not None:
                return n
        self._mask_pending = True
        self.fill_pending_mask()
        if self.dead_end:
            self.finish_reason, self.stop_reason = "stop", DEAD_END_REASON
        return n

    def _advance_guide(self, tok: int) -> None:
        """The grammar takes the token; its next mask is filled when first read
        (``grammar_mask``). A refused token (never sampled under the mask) finishes the
        sample (DEAD_END_REASON); so does, one step later, a state with no allowed next
        token (``record``), instead of keeping a token sampled from an empty
        distribution."""
        if self.guide.accept(tok):
            self._mask_pending = True
        else:
            self.finish_reason, self.stop_reason = "stop", DEAD_END_REASON

    def _logprob_entry(self, tok: int, logprob: float, top: tuple) -> dict[int, Logprob]:
        rank, top_ids, top_lps = top
        decode = self.detok.tokenizer.decode
        entry = {tok: Logprob(logprob, int(rank), decode([tok]))}
        for j in range(self.params.logprobs or 0):
            tid = int(top_ids[j])
            if tid not in entry:
                entry[tid] = Logprob(float(top_lps[j]), j + 1, decode([tid]))
        return entry

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detok.text,
            token_ids=list(self.detok.ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            sampled_logprobs=(
                list(self.sampled_logprobs) if self.sampled_logprobs is not None else None
            ),
        )


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SequenceState] = field(default_factory=list)
    # [prompt_len] entries when asked for: None for token 0, then {id: Logprob}.
    prompt_logprobs: list | None = None
    num_prompt_logprobs: int = 0
    # n > 1: samples 1..n-1 waiting for sample 0's prompt, to fork from its blocks.
    pending: list[SequenceState] = field(default_factory=list)
    # Beam search (engine/beams.py): the host picks every step's tokens, so the K-step
    # decode loop must not run while such a request holds slots.
    host_driven: bool = False
    # bad_words as token id sequences (logit_controls.bad_words_token_ids).
    bad_words_ids: list[list[int]] = field(default_factory=list)
    # The structured-output backend that compiled the request's constraint (None: none).
    structured_backend: str | None = None
    # Where its mask is applied (RequestOutput.structured_output_path).
    structured_path: str | None = None
    # LoRA (docs/lora.md): the request's adapter (a pagedjax.lora.LoRARequest; None: the
    # base model).
    lora_request: Any = None
    # Timeline for serving metrics (time.monotonic()); see outputs.RequestMetrics.
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    # Images (engine/multimodal.py's MultiModalPrompt): prompt_token_ids then hold
    # identity ids (negative, from each image's content hash) at placeholder positions,
    # for the token buffer and the prefix-cache hashes; outputs show the real ids.
    multi_modal: Any = None

    @classmethod
    def new(
        cls,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        target: int,
        tokenizer: Any,
        next_arrival: Callable[[], int],
        detokenize: bool = True,
    ) -> RequestState:
        """A request of ``params.n`` samples, each with its detokenizer and FCFS key
        (``next_arrival()``), finishing by length at ``target`` output tokens.
        detokenize=False: ids only, no text or stop strings, each token's logprob kept
        (the engine core process; its client detokenizes)."""
        req = cls(request_id, text, ids)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
            req.num_prompt_logprobs = params.prompt_logprobs
        for i in range(params.n):
            seq = SequenceState(
                index=i,
                params=params,
                detok=IncrementalDetokenizer(
                    tokenizer, params.stop, text=detokenize, min_tokens=params.min_tokens
                ),
                target=target,
                arrival=next_arrival(),
                logprobs=[] if params.logprobs is not None else None,
                sampled_logprobs=None if detokenize else [],
            )
            req.seqs.append(seq)
        return req

    @property
    def cache_salt(self) -> bytes | None:
        """The salt of this request's prefix-cache block hashes (block_hashes.py): its
        adapter's (the same prompt under two adapters has different KV); None: none."""
        return None if self.lora_request is None else self.lora_request.cache_salt

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def output(self) -> RequestOutput:
        """Cumulative output so far (vLLM's default output kind)."""
        m = self.metrics
        if m.first_token_time is None and any(s.detok.ids for s in self.seqs):
            m.first_token_time = time.monotonic()  # called right after the step's read-back
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids if self.multi_modal is None
                                  else self.multi_modal.token_ids),
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs else None,
            outputs=[s.completion() for s in self.seqs],
            finished=self.finished,
            metrics=RequestMetrics(m.arrival_time, m.first_scheduled_time, m.first_token_time),
            structured_output_backend=self.structured_backend,
            structured_output_path=self.structured_path,
        )
