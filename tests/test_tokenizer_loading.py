"""The tokenizer loads the class AutoTokenizer would pick, without AutoTokenizer's config
resolution (which imports torch) when tokenizer_config.json names the generic fast class."""

from __future__ import annotations

import json

from pagedjax.tokenizer import HFTokenizer, names_the_generic_fast_class
from tests.model_helpers import save_tiny_tokenizer


def test_generic_fast_class_loads_directly_and_equals_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    save_tiny_tokenizer(tmp_path)
    assert names_the_generic_fast_class(tmp_path)
    ours = HFTokenizer(tmp_path)
    auto = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "hello world, hello again"
    for special in (True, False):
        assert ours.encode(text, special) == list(auto.encode(text, add_special_tokens=special))
    ids = auto.encode(text)
    assert ours.decode(ids) == auto.decode(ids, skip_special_tokens=True)
    conv = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(conv) == auto.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True
    )
    assert (ours.eos_token_id, ours.bos_token_id, ours.vocab_size) == (
        auto.eos_token_id, auto.bos_token_id, len(auto),
    )  # fmt: skip


def test_other_tokenizer_classes_go_through_autotokenizer(tmp_path):
    save_tiny_tokenizer(tmp_path)
    cfg = tmp_path / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data["tokenizer_class"] = "LlamaTokenizerFast"
    cfg.write_text(json.dumps(data))
    assert not names_the_generic_fast_class(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    assert not names_the_generic_fast_class(tmp_path)
    assert not names_the_generic_fast_class(tmp_path / "missing")


def test_decode_fast_path_equals_transformers_decode(tmp_path):
    """HFTokenizer.decode calls the Rust tokenizer directly where transformers' decode would
    return the same text: equal on every prefix window of a text's ids, specials kept and
    skipped; a tokenizer that cleans up spaces keeps transformers' path."""
    from transformers import AutoTokenizer

    save_tiny_tokenizer(tmp_path)
    ours = HFTokenizer(tmp_path)
    auto = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert ours._raw_decode is not None
    ids = auto.encode("hello world, hello again!  wide   spaces", add_special_tokens=True)
    ids = [*ids, auto.eos_token_id, *ids[:3]]
    for lo in range(len(ids)):
        for hi in range(lo, len(ids) + 1):
            for skip in (True, False):
                assert ours.decode(ids[lo:hi], skip) == auto.decode(
                    ids[lo:hi], skip_special_tokens=skip
                ), (lo, hi, skip)
    cfg = tmp_path / "tokenizer_config.json"
    data = json.loads(cfg.read_text())
    data["clean_up_tokenization_spaces"] = True
    cfg.write_text(json.dumps(data))
    assert HFTokenizer(tmp_path)._raw_decode is None
