"""``LLM``: vLLM's offline API (``LLM(model=...).generate(prompts, params)``) over LLMEngine."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

import jax

from pagedjax.attention import KV_CACHE_DTYPES
from pagedjax.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    MultiModalConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from pagedjax.engine.beams import BeamSearchOutput, beam_search
from pagedjax.engine.fronts.data_parallel import DataParallelEngine
from pagedjax.engine.fronts.multihost import MultiHostEngine
from pagedjax.engine.llm_engine import DEFAULT_MAX_LOGPROBS, LLMEngine
from pagedjax.engine.outputs import RequestOutput
from pagedjax.lora import LoRARequest
from pagedjax.model.pipeline import PARTITION_ENV, parse_partition
from pagedjax.sampling import BeamSearchParams, SamplingParams

PromptType = str | Sequence[int] | dict
# One chat message ({"role": "user", "content": "..."}); a conversation is a list of them.
ChatMessage = dict[str, Any]


class LLM:
    """An LLM for offline batched generation, with vLLM's argument names.

    model: a local Hugging Face checkpoint directory, a ``.gguf`` file, a catalog name
    (``smollm2-135m-instruct``: a real model fetched once into the user's cache) or a
    preset name (random weights).
    tensor_parallel_size: devices one model is split over (Megatron layout, KV pool by KV
    head; docs/parallelism.md); data_parallel_size: engine replicas over M x N devices,
    requests routed by ``data_parallel_routing`` ("least_tokens" or "prefix_affinity";
    beam search runs on the least-loaded replica). pipeline_parallel_size: stages the
    decoder layers are split into, each on tensor_parallel_size devices (its layers'
    weights and KV pool only), layers per stage from
    ``PAGEDJAX_PP_LAYER_PARTITION`` ("2,1", as vLLM's VLLM_PP_LAYER_PARTITION) or vLLM's
    even split (docs/parallelism.md); pipeline_microbatches: split each step's tokens into
    that many micro-batches that flow through the stages together (GPipe inside the
    step; 1, the default, one batch at a time). swap_space (GiB) sizes
    the host pool for preemption by swap (preemption_mode "swap", or None: swap groups of
    several samples, recompute single sequences; docs/engine.md). kv_offloading_size (GiB,
    vLLM's name; 0 = off) adds a host tier to that pool: prefix-cache blocks evicted from
    the device are kept there and loaded back on a hit; kv_offloading_backend: "native"
    only; kv_offloading_disk_path / kv_offloading_disk_size (pagedjax's own; GiB) add a
    disk tier under it that a restarted engine reads (docs/kv_tiers.md). Unknown keyword
    arguments raise TypeError. On CPU the KV pool size comes from num_gpu_blocks_override or
    kv_cache_memory_bytes (else 4 GiB, at most a quarter of free memory); see docs/engine.md.
    enable_prefix_caching: automatic prefix caching, on by default as in vLLM today.
    prefix_index (pagedjax's own): the host hint that proposes cached blocks, "hash" (the
    chained block hashes, default) or "radix" (SGLang's radix tree); the device verifies
    either's proposals, so outputs are the same (docs/kv_tiers.md). eviction_policy
    (pagedjax's own): which free cached block a new allocation takes, "lru" (least
    recently freed, default), "lfu" (fewest hits) or "cost" (cheapest to recompute);
    outputs are the same with each.
    kv_cache_dtype: the KV pool's storage, vLLM's names: "auto" (the model's dtype),
    "float32" / "bfloat16" / "float16", or 8-bit: "fp8" (= "fp8_e4m3"), "fp8_e5m2",
    "int8_per_token_head" (docs/kv_quantization.md): about twice the blocks of a 16-bit
    pool in the same memory. kv_scales (pagedjax's own, fp8 only): "default" (1.0, as
    vLLM) or "calibrate" (per layer and KV head from the first prompts' max |K|, |V|).
    num_scheduler_steps (pagedjax's own: vLLM V0's name, vLLM 0.32 has no such option;
    ``SchedulerConfig.num_multi_steps``): K, the most decode iterations run in one
    on-device loop; "auto" picks K per device kind.
    warmup: "auto" (every step program at start-up, or ``$PAGEDJAX_WARMUP``), "decode",
    "all" or "none". enforce_eager (vLLM's name, its JAX meaning here): nothing compiled
    ahead of time (warmup "none": each program compiles when a step first needs it) and
    no fused K-step program (num_scheduler_steps 1); docs/serving.md.
    compilation_cache: JAX's persistent compilation cache directory
    (default ``$PAGEDJAX_COMPILATION_CACHE``, else ~/.cache/pagedjax/jax), or "off".
    quantization: vLLM's name; None takes the checkpoint's own (config.json's
    quantization_config: awq, gptq, compressed-tensors), "gguf" keeps a GGUF file's
    weights packed, or an in-flight mode ("int8_per_channel_weight_only",
    "fp8_per_tensor", "fp8_per_channel", "int4", "nf4"); docs/quantization.md.
    speculative_config: vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens":
    4, "prompt_lookup_max": 4} (``config.SpeculativeConfig``; docs/speculative_decoding.md).
    structured_outputs_config: vLLM's dict, e.g. {"backend": "auto" | "xgrammar" |
    "guidance", "disable_any_whitespace": False} (``config.StructuredOutputsConfig``;
    docs/structured_outputs.md).
    enable_lora, max_loras, max_lora_rank, max_cpu_loras: multi-LoRA serving, vLLM's
    names and defaults (1, 16, None = max_loras); lora_memory: "static" (default: the
    fixed slot table's bytes out of the KV budget), "unified" (S-LoRA paging: adapters
    in KV blocks, lent and returned as they load and evict) or "separate" (the table
    beside the KV budget, the ablation);
    ``generate(..., lora_request=...)``
    picks each prompt's adapter (docs/lora.md). Llama family, one device, no speculation.
    limit_mm_per_prompt: vLLM's dict, most images per prompt ({"image": 2}; default 999);
    mm_encoder_cache_size (pagedjax's own): image-embedding rows the encoder cache keeps;
    max_num_encoder_input_tokens (vLLM's scheduler name; None: no budget): image tokens
    encoded per step for queued requests (``config.MultiModalConfig``; docs/multimodal.md).
    A LLaVA or Idefics3 directory takes prompts {"prompt": ..., "multi_modal_data":
    {"image": img or [imgs]}}.
    """

    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        *,
        dtype: str = "auto",
        load_format: str = "auto",
        seed: int = 0,
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        swap_space: float = 4.0,
        kv_offloading_size: float = 0.0,
        kv_offloading_backend: str | None = None,
        kv_offloading_disk_path: str | None = None,
        kv_offloading_disk_size: float = 8.0,
        enable_prefix_caching: bool = True,
        prefix_index: str = "hash",
        eviction_policy: str = "lru",
        kv_cache_dtype: str = "auto",
        kv_scales: str = "default",
        preemption_mode: str | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        data_parallel_routing: str = "least_tokens",
    pipeline_parallel_size: int = 1,
        pipeline_microbatches: int = 1,
        scheduling_mode: str = "default",
        watermark: float = 0.01,
        attention_backend: str = "auto",
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        num_scheduler_steps: int | str = "auto",
        warmup: str = "auto",
        compilation_cache: str | None = None,
        quantization: str | None = None,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        structured_outputs_config: dict[str, Any] | StructuredOutputsConfig | None = None,
        enforce_eager: bool = False,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        lora_memory: str = "static",
        limit_mm_per_prompt: dict[str, int] | None = None,
        mm_encoder_cache_size: int | None = None,
        max_num_encoder_input_tokens: int | None = None,
        **unknown: Any,
    ):
        if unknown:
            raise TypeError(
                f"LLM() got unknown keyword argument(s) {sorted(unknown)}; see"
                " help(pagedjax.LLM) for the supported options"
            )
        args = {k: v for k, v in locals().items() if k not in ("self", "unknown", "__class__")}
        config = engine_config(**args)
        multi_process = jax.process_count() > 1  # after multihost.initialize
        if enable_lora and (multi_process or data_parallel_size > 1):
            raise ValueError("enable_lora with data_parallel_size > 1 or several processes:"
                             " not built in LLM (the server's engine core processes serve"
                             " LoRA with --data-parallel-size; docs/lora.md)")  # fmt: skip
        if multi_process:
            if preemption_mode == "swap":
                raise ValueError("preemption_mode='swap' is not available over several"
                                 " processes (multihost.py): use 'recompute'")  # fmt: skip
            if data_parallel_size > 1:
                raise ValueError("data_parallel_size > 1 over several processes is not built")
            # KV blocks of other processes cannot be read to this host: no swap pool.
            config = dataclasses.replace(
                config, cache=dataclasses.replace(config.cache, swap_space=0.0)
            )
        engine_cls = DataParallelEngine if data_parallel_size > 1 else LLMEngine
        self.llm_engine = engine_cls.from_config(config, max_logprobs=max_logprobs)
        if multi_process:  # process 0 takes requests, the others follow (multihost.py)
            self.llm_engine = MultiHostEngine(self.llm_engine)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order.

        prompts: a str, a list of token ids, a {"prompt_token_ids": ...} dict, or a list
        of these. sampling_params: one for all, or one per prompt (default SamplingParams()).
        lora_request (``enable_lora=True``): one LoRARequest for all prompts, or one per
        prompt (None: the base model), as vLLM's; one batch mixes adapters (docs/lora.md).
        If any prompt or option is invalid, nothing of this call is left in the engine and
        the error is raised.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams | BeamSearchParams):
            params = [sampling_params] * len(prompts)  # add_request points beam search here
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        loras = _per_prompt_loras(lora_request, len(prompts))
        engine = self.llm_engine
        ids = [f"{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p, lora in zip(ids, prompts, params, loras, strict=True):
                if lora is None:  # engines without LoRA keep their add_request signature
                    engine.add_request(rid, prompt, p)
                else:
                    engine.add_request(rid, prompt, p, lora_request=lora)
                added.append(rid)
        except Exception:
            engine.abort_request(added)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (vLLM's ``LLM.chat``); outputs in input order.

        messages: one conversation (a list of {"role", "content"} dicts) or a list of
        them. Each is rendered to text by the tokenizer's chat template (``chat_template``
        overrides it; ``add_generation_prompt`` opens the assistant's turn,
        ``continue_final_message`` leaves the last message open instead, as in
        transformers) and tokenized without adding special tokens, since the template
        writes them itself (vLLM does the same). Everything else is ``generate``.
        """
        conversations = _as_conversation_list(messages)
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message exclude each other")
        tokenizer = self.get_tokenizer()
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError(
                f"the model's tokenizer ({type(tokenizer).__name__}) has no chat template;"
                " chat needs a Hugging Face tokenizer (a checkpoint directory or a GGUF file)"
            )
        prompts = []
        for conversation in conversations:
            conversation, images = self._chat_images(conversation)
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompt: dict = {"prompt": text, "prompt_token_ids": ids}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_images(self, conversation: list[ChatMessage]) -> tuple[list[ChatMessage], list]:
        """Messages whose content is a list of parts (``{"type": "text", "text": ...}``,
        ``{"type": "image_url", "image_url": {"url": "data:..."}}`` or ``{"type":
        "image_pil", "image_pil": <PIL image>}``, vLLM's chat forms) become text led by
        the model's image placeholder per image (as the server does); returns them and
        the images in order. ValueError for images to a text-only model, another part
        type, or a URL that is not a data: URL (nothing is fetched)."""
        from pagedjax.engine.vision_models import image_prompt_info
        from pagedjax.entrypoints.openai.protocol import OpenAIError, image_url_bytes

        out, images = [], []
        for i, m in enumerate(conversation):
            parts = m.get("content")
            if not isinstance(parts, list):
                out.append(m)
                continue
            texts, found = [], []
            for part in parts:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    texts.append(part["text"])
                elif kind == "image_pil":
                    found.append(part["image_pil"])
                elif kind == "image_url":
                    try:
                        found.append(image_url_bytes(part.get("image_url"), i))
                    except OpenAIError as e:
                        raise ValueError(e.message) from None
                else:
                    raise ValueError(f"messages[{i}]: unsupported content part {part!r}")
            info = None
            if found:
                info = image_prompt_info(self.llm_engine.config.model.model, self.get_tokenizer())
                if info is None:
                    raise ValueError("this model takes no images (image content parts)")
            marks = [info[0]] * len(found) if info else []
            out.append({**m, "content": "\n".join(marks + texts)})
            images.extend(found)
        return out, images

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's ``LLM.beam_search``); outputs in input order.

        Each output holds the beam_width best hypotheses, best first; a hypothesis'
        ``tokens`` are prompt + output and ``text`` decodes them, as vLLM. The search
        follows Hugging Face's ``generate(num_beams=beam_width, do_sample=False)``
        (length_penalty, early_stopping); the beams of a prompt share KV blocks by
        reference count (pagedjax/engine/beams.py, docs/engine.md). concurrency_limit:
        most prompts searched at once (default: as many as the KV pool and slots hold).
        """
        engine = self.llm_engine
        if isinstance(engine, MultiHostEngine):
            raise NotImplementedError("beam search over several processes is not built")
        if isinstance(engine, DataParallelEngine):
            engine = engine.least_loaded_replica()
        return beam_search(
            engine, _as_prompt_list(prompts), params, use_tqdm, concurrency_limit
        )

    def follow(self) -> int:
        """On a process other than 0 of a multi-process run: serve process 0's steps until
        it calls ``shutdown()`` (pagedjax/engine/fronts/multihost.py). Returns the steps run."""
        if not isinstance(self.llm_engine, MultiHostEngine):
            raise RuntimeError("follow() is for multi-process runs (multihost.initialize)")
        return self.llm_engine.follow()

    def shutdown(self) -> None:
        """On process 0 of a multi-process run: release the followers. A no-op otherwise."""
        if isinstance(self.llm_engine, MultiHostEngine):
            self.llm_engine.shutdown()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            rate = out_tokens / max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
                            bar.update(1)
                if not engine.has_unfinished_requests() and len(done) < len(ids):
                    missing = sorted(wanted - set(done))
                    raise RuntimeError(f"requests {missing[:5]} vanished without finishing")
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])  # e.g. KeyboardInterrupt
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def engine_config(
    model: str,
    tokenizer: str | None = None,
    *,
    dtype: str = "auto",
    load_format: str = "auto",
    seed: int = 0,
    block_size: int = 16,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    gpu_memory_utilization: float = 0.9,
    num_gpu_blocks_override: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    swap_space: float = 4.0,
    kv_offloading_size: float = 0.0,
    kv_offloading_backend: str | None = None,
    kv_offloading_disk_path: str | None = None,
    kv_offloading_disk_size: float = 8.0,
    enable_prefix_caching: bool = True,
    prefix_index: str = "hash",
    eviction_policy: str = "lru",
    kv_cache_dtype: str = "auto",
    kv_scales: str = "default",
    preemption_mode: str | None = None,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    data_parallel_routing: str = "least_tokens",
    pipeline_parallel_size: int = 1,
    pipeline_microbatches: int = 1,
    scheduling_mode: str = "default",
    watermark: float = 0.01,
    attention_backend: str = "auto",
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
    num_scheduler_steps: int | str = "auto",
    warmup: str = "auto",
    compilation_cache: str | None = None,
    quantization: str | None = None,
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
    structured_outputs_config: dict[str, Any] | StructuredOutputsConfig | None = None,
    enforce_eager: bool = False,
    enable_lora: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    max_cpu_loras: int | None = None,
    lora_memory: str = "static",
    limit_mm_per_prompt: dict[str, int] | None = None,
    mm_encoder_cache_size: int | None = None,
    max_num_encoder_input_tokens: int | None = None,
    **unknown: Any,
) -> EngineConfig:
    """The EngineConfig of ``LLM(model, ...)``'s arguments (see ``LLM``), built without
    loading anything or starting JAX's backend: the server hands it to engine core
    processes (pagedjax/engine/core_client.py). Raises as ``LLM`` does on bad arguments."""
    if unknown:
        raise TypeError(
            f"engine_config() got unknown keyword argument(s) {sorted(unknown)}; see"
            " help(pagedjax.LLM) for the supported options"
        )
    if enforce_eager:
        warmup, num_scheduler_steps = eager_settings(warmup, num_scheduler_steps)
    if not isinstance(enable_lora, bool):
        raise TypeError(f"enable_lora must be True or False, got {enable_lora!r}")
    # Checked whether or not LoRA is on (a bad value is an error either way).
    lora = LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank,
                      max_cpu_loras=max_cpu_loras, memory=lora_memory)  # fmt: skip
    if preemption_mode not in (None, "recompute", "swap"):
        raise ValueError(
            f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}"
        )
    config = EngineConfig(
        model=ModelConfig(
            model=model,
            dtype=dtype,  # type: ignore[arg-type]
            load_format=load_format,  # type: ignore[arg-type]
            max_model_len=max_model_len,
            tokenizer=tokenizer,
            seed=seed,
            quantization=quantization,
        ),
        cache=CacheConfig(
            block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            swap_space=swap_space,
            kv_offloading_size=kv_offloading_size,
            kv_offloading_backend=kv_offloading_backend,
            kv_offloading_disk_path=kv_offloading_disk_path,
            kv_offloading_disk_size=kv_offloading_disk_size,
            enable_prefix_caching=enable_prefix_caching,
            prefix_index=prefix_index,  # type: ignore[arg-type]
            eviction_policy=eviction_policy,  # type: ignore[arg-type]
            cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
            kv_scales=kv_scales,  # type: ignore[arg-type]
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            scheduling_mode=scheduling_mode,  # type: ignore[arg-type]
            watermark=watermark,
            preemption_mode=preemption_mode,  # type: ignore[arg-type]
            num_multi_steps=num_scheduler_steps,
        ),
        parallel=ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            data_parallel_routing=data_parallel_routing,  # type: ignore[arg-type]
            pipeline_parallel_size=pipeline_parallel_size,
            pipeline_layer_partition=(parse_partition(os.environ.get(PARTITION_ENV))
                                      if pipeline_parallel_size > 1 else None),
            pipeline_microbatches=pipeline_microbatches,
        ),
        attention_backend=attention_backend,  # type: ignore[arg-type]
        warmup=warmup,  # type: ignore[arg-type]
        compilation_cache=compilation_cache,
        speculative=_speculative(speculative_config),
        structured_outputs=_structured_outputs(structured_outputs_config),
        lora=lora if enable_lora else None,
        multimodal=MultiModalConfig(limit_mm_per_prompt=dict(limit_mm_per_prompt or {}),
                                    encoder_cache_size=mm_encoder_cache_size,
                                    max_num_encoder_input_tokens=max_num_encoder_input_tokens),
    )
    _check_literals(config)
    return config


def _per_prompt_loras(value: Any, n: int) -> list[LoRARequest | None]:
    """generate's lora_request: None, one LoRARequest for all, or a list of n (each a
    LoRARequest or None)."""
    if value is None or isinstance(value, LoRARequest):
        return [value] * n
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        loras = list(value)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} lora_requests for {n} prompts")
        for x in loras:
            if x is not None and not isinstance(x, LoRARequest):
                raise TypeError(f"lora_request entries must be LoRARequest or None, got {x!r}")
        return loras
    raise TypeError(f"lora_request must be a LoRARequest or a list of them, got {value!r}")


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if (
        isinstance(prompts, Sequence)
        and prompts
        and all(isinstance(i, int) and not isinstance(i, bool) for i in prompts)
    ):
        return [list(prompts)]  # one tokenized prompt
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise TypeError(f"prompts must be a str, token ids or a list of them, got {prompts!r}")


def _as_conversation_list(messages: Any) -> list[list[ChatMessage]]:
    """One conversation or a list of them -> a list of conversations, each checked."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise TypeError(f"messages must be a non-empty list of chat messages, got {messages!r}")
    conversations = [messages] if isinstance(messages[0], dict) else list(messages)
    for conv in conversations:
        if (
            isinstance(conv, str)
            or not isinstance(conv, Sequence)
            or not conv
            or not all(isinstance(m, dict) and "role" in m for m in conv)
        ):
            raise TypeError(
                'each conversation must be a non-empty list of {"role": ..., "content": ...}'
                f" dicts, got {conv!r}"
            )
    return [list(c) for c in conversations]


def _check_literals(config: EngineConfig) -> None:
    """The config dataclasses type their choices as Literal but only YAML loading checks
    them; check the ones reachable from LLM's keywords here."""
    choices = {
        "dtype": (config.model.dtype, ("auto", "float32", "bfloat16", "float16")),
        "load_format": (config.model.load_format, ("auto", "dummy", "safetensors")),
        "kv_cache_dtype": (config.cache.cache_dtype, KV_CACHE_DTYPES),
        "scheduling_mode": (config.scheduler.scheduling_mode, ("default", "paper", "static")),
        "attention_backend": (
            config.attention_backend,
            ("reference", "pallas", "native_cpu", "triton", "auto"),
        ),
        "warmup": (config.warmup, ("auto", "all", "decode", "none")),
    }
    for name, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _speculative(value: Any) -> SpeculativeConfig | None:
    """vLLM's ``speculative_config`` (a dict, e.g. {"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4}) as a checked dataclass."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
    return SpeculativeConfig.from_dict(value)


def _structured_outputs(value: Any) -> StructuredOutputsConfig:
    """vLLM's ``structured_outputs_config`` (a dict, e.g. {"backend": "guidance"}) as a
    checked dataclass (None: the defaults)."""
    if value is None:
        return StructuredOutputsConfig()
    if isinstance(value, StructuredOutputsConfig):
        return value
    if not isinstance(value, dict):
        raise TypeError(
            f"structured_outputs_config must be a dict, got {type(value).__name__}"
        )
    return StructuredOutputsConfig.from_dict(value)


def eager_settings(warmup: str, num_scheduler_steps: int | str) -> tuple[str, int]:
    """(warmup, num_scheduler_steps) under ``enforce_eager=True``: vLLM's switch means no
    CUDA graphs, captured ahead of time for whole decode steps; the JAX counterparts are
    the ahead-of-time warm-up and the fused K-step decode program, so both are off
    ("none", 1). ValueError if the caller asked for either explicitly."""
    if warmup not in ("auto", "none"):
        raise ValueError(f"enforce_eager=True compiles nothing ahead of time: warmup={warmup!r}"
                         " contradicts it (leave warmup at 'auto' or pass 'none')")  # fmt: skip
    if num_scheduler_steps not in ("auto", 1):
        n = num_scheduler_steps
        raise ValueError(f"enforce_eager=True runs no fused K-step program:"
                         f" num_scheduler_steps={n!r} contradicts it")  # fmt: skip
    return "none", 1
