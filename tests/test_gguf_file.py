"""pagedjax's GGUF header reader (pagedjax/gguf_file.py) against gguf-py's own
reader, on files gguf-py's writer made: every metadata value type, nested arrays, both
byte orders, the tensor table and the tensor views; refusals; and the GGUF tokenizer
built from the parsed metadata against transformers' AutoTokenizer on the same file.
The real SmolLM2 file, when cached, is checked field by field in the second tier."""

from __future__ import annotations

import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from pagedjax.gguf_file import GGUFFile, parse_gguf  # noqa: E402

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType

# Scalar value type -> (strategy of its values).
_INT_RANGES = {
    VT.UINT8: (0, 2**8 - 1), VT.INT8: (-(2**7), 2**7 - 1),
    VT.UINT16: (0, 2**16 - 1), VT.INT16: (-(2**15), 2**15 - 1),
    VT.UINT32: (0, 2**32 - 1), VT.INT32: (-(2**31), 2**31 - 1),
    VT.UINT64: (0, 2**64 - 1), VT.INT64: (-(2**63), 2**63 - 1),
}  # fmt: skip
_TEXT = st.text(st.characters(codec="utf-8"), max_size=12)


def _scalar(vtype: VT) -> st.SearchStrategy:
    if vtype in _INT_RANGES:
        return st.integers(*_INT_RANGES[vtype])
    if vtype == VT.FLOAT32:
        return st.floats(width=32, allow_nan=False)
    if vtype == VT.FLOAT64:
        return st.floats(allow_nan=False)
    if vtype == VT.BOOL:
        return st.booleans()
    return _TEXT


_SCALAR_TYPES = [*_INT_RANGES, VT.FLOAT32, VT.FLOAT64, VT.BOOL, VT.STRING]


@st.composite
def _kv(draw) -> tuple[object, VT, VT | None]:
    """(value, type, array element type) covering scalars, typed arrays and nested arrays
    (the writer types an inner array by its first item: int -> i32, float -> f32)."""
    kind = draw(st.sampled_from(["scalar", "array", "nested"]))
    if kind == "scalar":
        vtype = draw(st.sampled_from(_SCALAR_TYPES))
        return draw(_scalar(vtype)), vtype, None
    if kind == "array":
        sub = draw(st.sampled_from(_SCALAR_TYPES))
        return draw(st.lists(_scalar(sub), min_size=1, max_size=20)), VT.ARRAY, sub
    inner = draw(st.sampled_from([VT.INT32, VT.FLOAT32, VT.STRING]))
    rows = st.lists(_scalar(inner), min_size=1, max_size=4)
    return draw(st.lists(rows, min_size=1, max_size=4)), VT.ARRAY, VT.ARRAY


_TENSOR_TYPES = [QT.F32, QT.F16, QT.Q8_0, QT.Q4_1]


def _tensor(rng: np.random.Generator, qtype: QT, dims: tuple[int, ...]) -> np.ndarray:
    """A tensor as GGUFWriter.add_tensor takes it: values, or raw uint8 blocks."""
    if qtype in (QT.F32, QT.F16):
        return rng.standard_normal(dims).astype(np.float32 if qtype == QT.F32 else np.float16)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    byte_dims = (*dims[:-1], dims[-1] // block * size)
    return rng.integers(0, 256, byte_dims, dtype=np.uint8)


def write_gguf(path: Path, kvs: dict, tensors: dict, endian=None, alignment=None) -> None:
    """kvs: key -> (value, type, sub type); tensors: name -> (qtype, torch-order dims)."""
    kwargs = {} if endian is None else {"endianess": endian}
    w = gguf.GGUFWriter(str(path), "llama", **kwargs)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (value, vtype, sub) in kvs.items():
        w.add_key_value(key, value, vtype, sub_type=None if sub == VT.ARRAY else sub)
    rng = np.random.default_rng(0)
    for name, (qtype, dims) in tensors.items():
        raw = _tensor(rng, qtype, dims)
        w.add_tensor(name, raw, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_equals_gguf_py(gf: GGUFFile, path: Path) -> None:
    """Every field's contents and types, and the tensor table and data, as gguf-py reads them."""
    ref = gguf.GGUFReader(str(path))
    assert list(gf.metadata) == list(ref.fields)
    for key, field in ref.fields.items():
        got, want = gf.metadata[key], field.contents()
        assert got == want and type(got) is type(want), key
        if isinstance(want, list):
            assert [type(v) for v in got] == [type(v) for v in want], key
        assert gf.value_types[key] == tuple(int(t) for t in field.types), key
    assert gf.data_offset == ref.data_offset and gf.alignment == ref.alignment
    assert [t.name for t in gf.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(gf.tensors, ref.tensors, strict=True):
        assert t.dims == tuple(r.shape.tolist()) and t.type_id == int(r.tensor_type)
        assert t.data_offset == r.data_offset and t.n_bytes == r.n_bytes
        assert t.n_elements == r.n_elements and t.type_name == r.tensor_type.name
        data = gf.tensor_data(t)
        assert data.dtype == r.data.dtype and data.shape == r.data.shape
        assert np.array_equal(data, r.data)


_KEY = st.text(st.characters(codec="utf-8"), min_size=1, max_size=10).map(lambda k: f"x.{k}")


@settings(max_examples=25)
@given(
    kvs=st.dictionaries(_KEY, _kv(), max_size=8),
    tensors=st.lists(
        st.tuples(st.sampled_from(_TENSOR_TYPES), st.integers(1, 3), st.integers(1, 2)),
        max_size=3,
    ),
    big_endian=st.booleans(),
    alignment=st.sampled_from([None, 64]),
)
def test_metadata_and_tensor_table_equal_gguf_py(kvs, tensors, big_endian, alignment):
    specs = {
        f"t{i}": (qtype, (rows,) * (ndim - 1) + (64,))
        for i, (qtype, rows, ndim) in enumerate(tensors)
    }
    endian = gguf.GGUFEndian.BIG if big_endian else None
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.gguf"
        write_gguf(path, kvs, specs, endian, alignment)
        gf = parse_gguf(path)
        assert gf.byte_order == (">" if big_endian else "<")
        assert_equals_gguf_py(gf, path)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_blocks_equals_gguf_py(qtype):
    """gguf_blocks.dequantize_blocks (what read_gguf uses for these types) is bit for bit
    gguf-py's dequantize on random blocks, float16 fields any finite value."""
    from pagedjax.model.quant.gguf_blocks import dequantize_blocks

    rng = np.random.default_rng(1)
    block, size = gguf.GGML_QUANT_SIZES[QT[qtype]]
    raw = rng.integers(0, 256, (8, size), dtype=np.uint8)
    # Every block size is even and every float16 field (d, dmin / m) sits at an even
    # offset: viewing the bytes as float16 and replacing inf / nan keeps them all finite.
    f16 = raw.view(np.float16)
    f16[~np.isfinite(f16)] = np.float16(0.5)
    want = gguf.quants.dequantize(raw, QT[qtype]).reshape(-1)
    got = dequantize_blocks(qtype, raw)
    assert got.dtype == np.float32 and got.shape == (8 * block,)
    np.testing.assert_array_equal(got, want)


def _raw_file(kv_bytes: bytes, kv_count: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, 0, kv_count) + kv_bytes


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def test_arrays_the_writer_cannot_make_equal_gguf_py(tmp_path):
    """Empty arrays, u64 inner arrays, and nested arrays whose inner types differ from the
    first one's (gguf-py shows every leaf by the first leaf's type)."""
    s = lambda b: struct.pack("<Q", len(b)) + b  # noqa: E731
    arr = lambda itype, items, payload: struct.pack("<IIQ", 9, itype, items) + payload  # noqa: E731
    inner = lambda itype, items, payload: struct.pack("<IQ", itype, items) + payload  # noqa: E731
    kvs = [
        _key("empty") + arr(4, 0, b""),
        _key("empty.strings") + arr(8, 0, b""),
        _key("nested.u64") + arr(9, 2, inner(10, 1, struct.pack("<Q", 7)) + inner(10, 0, b"")),
        _key("nested.first.empty") + arr(9, 2, inner(8, 0, b"") + inner(8, 1, s(b"ab"))),
        _key("nested.str.then.int") + arr(9, 2, inner(8, 1, s(b"hi")) + inner(0, 2, b"AB")),
        _key("nested.int.then.str") + arr(9, 2, inner(0, 1, b"\x05") + inner(8, 1, s(b"xy"))),
        _key("general.alignment") + struct.pack("<II", 4, 16),
    ]
    path = tmp_path / "raw.gguf"
    path.write_bytes(_raw_file(b"".join(kvs), len(kvs)))
    gf = parse_gguf(path)
    assert gf.metadata["nested.int.then.str"] == [5, ord("x"), ord("y")]
    assert gf.metadata["nested.str.then.int"] == ["hi", "A", "B"]
    assert_equals_gguf_py(gf, path)


def test_refusals(tmp_path):
    with pytest.raises(FileNotFoundError):
        parse_gguf(tmp_path / "missing.gguf")
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="magic"):
        parse_gguf(tmp_path / "magic.gguf")
    (tmp_path / "v1.gguf").write_bytes(_raw_file(b"", 0, version=1))
    with pytest.raises(ValueError, match="version 1"):
        parse_gguf(tmp_path / "v1.gguf")
    whole = _raw_file(_key("k") + struct.pack("<I", 8) + struct.pack("<Q", 5) + b"hello", 1)
    (tmp_path / "short.gguf").write_bytes(whole[:-2])
    with pytest.raises(ValueError, match="truncated"):
        parse_gguf(tmp_path / "short.gguf")
    (tmp_path / "type.gguf").write_bytes(_raw_file(_key("k") + struct.pack("<I", 13), 1))
    with pytest.raises(ValueError, match="value type 13"):
        parse_gguf(tmp_path / "type.gguf")
    (tmp_path / "align.gguf").write_bytes(_raw_file(_key("general.alignment")
                                                    + struct.pack("<II", 4, 24), 1))  # fmt: skip
    with pytest.raises(ValueError, match="power of two"):
        parse_gguf(tmp_path / "align.gguf")


def test_long_header_is_read_past_the_first_chunk(tmp_path, monkeypatch):
    """A header longer than the first read (lowered here to 64 bytes) is read again whole."""
    import pagedjax.gguf_file as gguf_file

    monkeypatch.setattr(gguf_file, "_FIRST_READ", 64)
    path = tmp_path / "long.gguf"
    kvs = {"x.tokens": ([f"token{i}" for i in range(200)], VT.ARRAY, VT.STRING)}
    write_gguf(path, kvs, {"w": (QT.F32, (4, 32))})
    assert_equals_gguf_py(parse_gguf(path), path)


# --- the tokenizer built from the parsed metadata ---------------------------------------


def _byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """A small byte-level BPE: the 256 byte symbols, a few merges, and three control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "hell o"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [1] * len(tokens) + [3, 3, 3]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return tokens, merges, types


def _sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece vocabulary (llama tokenizer): specials, bytes, pieces + scores."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "▁he", "▁hell", "▁hello",
              "or", "▁w", "▁wor", "ld", "▁world"]  # fmt: skip
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer_gguf(path: Path, kind: str) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    # The llama keys transformers' GGUF config reader needs (AutoTokenizer reads the config).
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_block_count(1)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    if kind == "gpt2":
        tokens, merges, types = _byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_unk_token_id(tokens.index("<|endoftext|>"))
        w.add_pad_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(False)
    else:
        tokens, scores, types = _sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_chat_template(_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_TEXTS = ["hello world", " hello  world\n", "héllo wörld ✓", "<|im_start|>hello<|im_end|>", ""]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_gguf_tokenizer_equals_auto_tokenizer(tmp_path, monkeypatch, kind):
    """gguf_tokenizer (from parse_gguf's metadata) is the tokenizer AutoTokenizer builds from
    the same file: the same backend (vocabulary, merges, pre-tokenizer, added tokens), special
    tokens, chat template, encodings and decodings; converted once, then (a second build)
    from the tokenizer cache without converting, and still the same."""
    from transformers import AutoTokenizer

    import pagedjax.tokenizer as tokenizer_mod

    cache = tmp_path / "cache"
    monkeypatch.setenv(tokenizer_mod.TOKENIZER_CACHE_ENV, str(cache))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    path = model_dir / f"{kind}.gguf"
    _tokenizer_gguf(path, kind)
    meta = parse_gguf(path).metadata
    ref = AutoTokenizer.from_pretrained(str(model_dir), gguf_file=path.name, local_files_only=True)
    conversation = [{"role": "user", "content": "hello"}]
    want_prompt = ref.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)

    converted = tokenizer_mod.gguf_tokenizer(path, meta)
    assert len(list(cache.glob("gguf-*.json"))) == 1  # the conversion was kept

    def no_conversion(*args):
        raise AssertionError("a cached tokenizer was converted again")

    monkeypatch.setattr(tokenizer_mod, "_convert_gguf_tokenizer", no_conversion)
    cached = tokenizer_mod.gguf_tokenizer(path, meta)
    for ours in (converted, cached):
        assert_same_tokenizer(ours.hf_tokenizer, ref)
        assert ours.apply_chat_template(conversation) == want_prompt
    # Other tokenizer metadata (here: the chat template) is another cache entry.
    monkeypatch.undo()
    monkeypatch.setenv(tokenizer_mod.TOKENIZER_CACHE_ENV, str(cache))
    template = "{{ messages[0]['content'] }}"
    other = {**meta, "tokenizer.chat_template": template}
    assert tokenizer_mod.gguf_tokenizer(path, other).chat_template == template
    assert len(list(cache.glob("gguf-*.json"))) == 2


def assert_same_tokenizer(tok, ref, texts=_TEXTS) -> None:
    assert type(tok) is type(ref)
    assert tok.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert tok.special_tokens_map == ref.special_tokens_map
    assert tok.all_special_ids == ref.all_special_ids
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.unk_token_id)  # fmt: skip
    assert tok.added_tokens_decoder == ref.added_tokens_decoder
    assert tok.chat_template == ref.chat_template
    assert len(tok) == len(ref)
    for text in texts:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
                    ids, skip_special_tokens=skip)  # fmt: skip


def test_gguf_tokenizer_defers_to_auto_tokenizer_beside_tokenizer_files(tmp_path):
    """A GGUF file next to tokenizer files: AutoTokenizer reads those too, so the metadata
    path steps aside (None) and gguf_tokenizer goes through AutoTokenizer."""
    from pagedjax.tokenizer import gguf_metadata_tokenizer

    path = tmp_path / "gpt2.gguf"
    _tokenizer_gguf(path, "gpt2")
    meta = parse_gguf(path).metadata
    assert gguf_metadata_tokenizer(path, meta, cache_dir=None) is not None
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert gguf_metadata_tokenizer(path, meta, cache_dir=None) is None
    other_arch = {**meta, "general.architecture": "qwen2"}
    assert gguf_metadata_tokenizer(path, other_arch, cache_dir=None) is None


# --- the real file -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cached_smollm2() -> Path:
    from pagedjax.model.catalog import cached_model_path

    path = cached_model_path("smollm2-135m-instruct")
    if not path.is_file():
        pytest.skip(f"the real model is not cached at {path}")
    return path


@pytest.mark.tier2
def test_real_file_equals_gguf_py_and_auto_tokenizer(cached_smollm2, tmp_path):
    """SmolLM2-135M-Instruct's GGUF: every field (49k tokens, 48k merges) and the tensor
    table as gguf-py reads them, and its tokenizer, converted and then from the tokenizer
    cache, as transformers builds it from the file. The reference is
    TokenizersBackend.from_pretrained, the class AutoTokenizer picks for a llama GGUF (the
    tiny-file test above checks that pick): AutoTokenizer itself would also run gguf-py's
    reader over the file again for its config (~10 s more)."""
    from transformers import TokenizersBackend

    from pagedjax.tokenizer import gguf_metadata_tokenizer

    gf = parse_gguf(cached_smollm2)
    assert_equals_gguf_py(gf, cached_smollm2)
    ref = TokenizersBackend.from_pretrained(
        str(cached_smollm2.parent), gguf_file=cached_smollm2.name, local_files_only=True
    )
    texts = [*_TEXTS, "The capital of France is Paris. 1234567 tokens!\n\tdef f(x): return x"]
    for _ in ("converted", "cached"):
        ours = gguf_metadata_tokenizer(cached_smollm2, gf.metadata, cache_dir=tmp_path)
        assert_same_tokenizer(ours, ref, texts)
    assert len(list(tmp_path.glob("gguf-*.json"))) == 1
