"""What the engine returns: vLLM's RequestOutput / CompletionOutput / Logprob shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the raw model distribution, its rank (1 = the
    most likely token) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated position: {token_id: Logprob} holding the sampled token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One of a request's n samples.

    index: the sample's index in [0, n). text: detokenized output (stop string removed).
    token_ids: every generated id (including an EOS or stop token that ended it).
    cumulative_logprob: sum of the sampled tokens' raw logprobs.
    logprobs: per-position top logprobs when SamplingParams.logprobs is set, else None.
    finish_reason: None while running, else "stop" (EOS, stop token or string) or
        "length" (max_tokens / max_model_len / the KV pool cannot hold it) or "abort".
    stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    sampled_logprobs: each generated token's raw logprob, only from an engine that does
        not detokenize (the engine core process): its client cuts the output at a stop
        string itself and sums the kept tokens' logprobs into cumulative_logprob, in the
        engine's order, so the sum equals the in-process one. None otherwise.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sampled_logprobs: list[float] | None = field(default=None, repr=False, compare=False)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's timeline on ``time.monotonic()``'s clock (vLLM's RequestMetrics subset).

    arrival_time: add_request. first_scheduled_time: its first sample got a scheduler
    slot (None while queued on the host). first_token_time: the step that produced its
    first output token was read back (None before).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None


@dataclass
class RequestOutput:
    """A request's state after a step (cumulative, as vLLM's default output kind).

    prompt: the prompt text (None when given as token ids). prompt_logprobs: when
    SamplingParams.prompt_logprobs is set, one entry per prompt token: None for the first,
    then {token_id: Logprob} with the actual token and the top-k (raw model logprobs).
    finished: every sample has finished. metrics: the request's timeline (serving
    metrics: queue time, time to first token). structured_output_backend: the backend
    that compiled the request's structured_outputs constraint ("xgrammar" or
    "guidance"; None without one): pagedjax's extension, vLLM does not report it.
    structured_output_path: where its mask was applied (pagedjax's too): "device_fsm",
    "host_masks", or with ``device_fsm`` on and the constraint refused for it,
    "host_masks: <why>" (e.g. a table over ``device_fsm_max_bytes``); None without one.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    structured_output_backend: str | None = None
    structured_output_path: str | None = None
