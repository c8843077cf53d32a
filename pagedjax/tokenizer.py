"""Tokenizers: the checkpoint's own (local files only, never the network; or built from a
GGUF file's metadata), or a byte-level fallback when the directory has none (random/dummy
models, presets). Chat templates are rendered by the tokenizer that carries them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

# Any of these in a checkpoint directory means it ships a Hugging Face tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer(Protocol):
    eos_token_id: int | None
    bos_token_id: int | None
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


# tokenizer_config.json's tokenizer_class values that name transformers' generic fast
# tokenizer (one class: PreTrainedTokenizerFast is TokenizersBackend in transformers 5).
GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def names_the_generic_fast_class(directory: str | Path) -> bool:
    """True when ``directory`` has a tokenizer.json and its tokenizer_config.json names the
    generic fast class: loading that class directly is what AutoTokenizer would do."""
    d = Path(directory)
    cfg = d / "tokenizer_config.json"
    if not (d / "tokenizer.json").is_file() or not cfg.is_file():
        return False
    try:
        name = json.loads(cfg.read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return False
    return name in GENERIC_FAST_CLASSES


class HFTokenizer:
    """A transformers tokenizer loaded from local files: a checkpoint directory, or a GGUF
    file (``gguf_file``: its name inside ``directory``), whose metadata carries the
    vocabulary, merges, special tokens and chat template (transformers converts them;
    needs the ``gguf`` package)."""

    def __init__(self, directory: str | Path, gguf_file: str | None = None):
        if gguf_file is None and names_the_generic_fast_class(directory):
            # The class AutoTokenizer would pick, without its config resolution, which
            # imports torch (measured: 3.5 s -> 0.75 s to a ready tokenizer, most of a
            # warm start's remaining time outside compilation).
            from transformers import PreTrainedTokenizerFast as cls
        else:
            from transformers import AutoTokenizer as cls

        kwargs = {} if gguf_file is None else {"gguf_file": gguf_file}
        self._adopt(cls.from_pretrained(str(directory), local_files_only=True, **kwargs))

    @classmethod
    def wrapping(cls, tok: Any) -> HFTokenizer:
        """An HFTokenizer around a transformers tokenizer built elsewhere."""
        self = cls.__new__(cls)
        self._adopt(tok)
        return self

    def _adopt(self, tok: Any) -> None:
        self._tok = tok
        self._raw_decode = _backend_decode(self._tok)
        self.eos_token_id: int | None = self._tok.eos_token_id
        self.bos_token_id: int | None = self._tok.bos_token_id
        self.vocab_size: int = len(self._tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer itself: the grammar backends (pagedjax/structured)
        read its vocabulary from it."""
        return self._tok

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own Jinja chat template (tokenizer_config.json or GGUF), if any."""
        return getattr(self._tok, "chat_template", None)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """The conversation rendered as prompt text by the chat template (``chat_template``
        overrides the tokenizer's own), as transformers' ``apply_chat_template(...,
        tokenize=False)``. ValueError when there is no template."""
        if chat_template is None and self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template; pass chat_template= (a Jinja string)"
            )
        return self._tok.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **template_kwargs,
        )


def _backend_decode(tok: Any) -> Any:
    """The Rust tokenizer's own ``decode`` where transformers' ``decode`` would return
    exactly its result (a fast tokenizer whose ``_decode`` is the base one, with no
    clean-up of tokenization spaces), else None. Why: the engine decodes two short windows
    per generated token (detokenizer.py), and transformers' wrapper costs ~18 us a call
    against ~2 us for the Rust decode (a profile of 7,680 tokens: 0.28 s vs 0.04 s)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    backend = getattr(tok, "backend_tokenizer", None)
    if (
        backend is None
        or getattr(tok, "clean_up_tokenization_spaces", True)
        or getattr(type(tok), "_decode", None) is not PreTrainedTokenizerFast._decode
    ):
        return None
    return backend.decode


def gguf_tokenizer(path: str | Path, metadata: dict[str, Any] | None = None) -> HFTokenizer:
    """The tokenizer and chat template stored in a GGUF file's metadata.

    metadata: the file's metadata as ``pagedjax.gguf_file.parse_gguf(path).metadata``
    when the caller has parsed it already (the engine's loader: one parse per build),
    else parsed here. Built from it as transformers builds it (``gguf_metadata_tokenizer``)
    where that is exactly what ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` would
    give, else through AutoTokenizer itself (a directory that also holds tokenizer files,
    another architecture, a transformers without the GGUF tokenizer API)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if metadata is None:
        from pagedjax.gguf_file import parse_gguf

        metadata = parse_gguf(path).metadata
    tok = gguf_metadata_tokenizer(path, metadata)
    if tok is not None:
        return HFTokenizer.wrapping(tok)
    return HFTokenizer(path.parent, gguf_file=path.name)


# GGUF architectures whose AutoTokenizer class is the generic TokenizersBackend (transformers'
# TOKENIZER_MAPPING_NAMES has no "llama" entry). Not looked up at run time: importing that
# table imports torch (~5 s); the tests compare with AutoTokenizer instead.
_BACKEND_ARCHITECTURES = ("llama",)
# transformers' get_gguf_tokenizer: special-token attribute -> its id key in the metadata.
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


TOKENIZER_CACHE_ENV = "PAGEDJAX_TOKENIZER_CACHE"
_CACHE_OFF = {"", "0", "off", "none", "false", "no"}
_CACHE_FORMAT = 1  # bump when what a cache file holds, or how it is built, changes


def tokenizer_cache_dir() -> Path | None:
    """Where converted GGUF tokenizers are kept: ``$PAGEDJAX_TOKENIZER_CACHE`` (an "off"
    value disables the cache), else ``$XDG_CACHE_HOME/pagedjax/tokenizers``."""
    env = os.environ.get(TOKENIZER_CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in _CACHE_OFF else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedjax" / "tokenizers"


def gguf_metadata_tokenizer(
    path: Path, metadata: dict[str, Any], cache_dir: Path | None | bool = True
) -> Any | None:
    """The transformers tokenizer ``AutoTokenizer.from_pretrained(path.parent,
    gguf_file=path.name)`` builds, made from already parsed metadata; None where that
    equivalence is not established (see gguf_tokenizer). cache_dir: True for
    ``tokenizer_cache_dir()``, a directory, or None / False for no cache.

    Why: AutoTokenizer parses the file twice more for it (its config through gguf-py's
    GGUFReader, ~8-10 s on SmolLM2's vocabulary plus importing torch; the vocabulary and
    merges again with its own reader, ~1 s), then converts the vocabulary and merges to a
    ``tokenizers`` BPE. The conversion is transformers' own (``convert_gguf_tokenizer``);
    what is repeated here is get_gguf_tokenizer's selection of keys (its
    GGUF_TOKENIZER_MAPPING table, the llama / gemma4 add_bos defaults, the special tokens
    by id), pinned by tests against AutoTokenizer (tests/test_gguf_file.py, and on the
    real file).

    The cache: importing transformers' GGUF converter (it imports five model families'
    tokenizer modules) and converting cost ~2-3 s of a start under load, against ~0.9 s to
    rebuild the same backend from its JSON. So the converted backend (``to_str()``, the
    ``tokenizers`` library's own serialization) and the constructor's arguments are kept
    in one JSON file named by a SHA-256 of the metadata's ``tokenizer.*`` values, the
    architecture, the transformers and tokenizers versions and a format number; a hit
    builds the same ``TokenizersBackend(tokenizer_object=..., **arguments)`` call from
    them. An unreadable or unwritable cache is skipped (the conversion runs)."""
    arch = metadata.get("general.architecture")
    if arch not in _BACKEND_ARCHITECTURES or "tokenizer.ggml.tokens" not in metadata:
        return None
    if any((path.parent / f).is_file() for f in TOKENIZER_FILES):
        return None  # AutoTokenizer would read those files too
    try:
        import tokenizers
        import transformers
        from transformers import TokenizersBackend
    except ImportError:  # pragma: no cover - both are dependencies of the real extra
        return None
    if cache_dir is True:
        cache_dir = tokenizer_cache_dir()
    cache_file = None
    if cache_dir:
        key = json.dumps(
            [_CACHE_FORMAT, transformers.__version__, tokenizers.__version__, arch,
             {k: v for k, v in sorted(metadata.items()) if k.startswith("tokenizer.")}],
            ensure_ascii=False,
        )  # fmt: skip
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        cache_file = Path(cache_dir) / f"gguf-{digest[:32]}.json"
        try:
            cached = json.loads(cache_file.read_text(encoding="utf-8"))
            backend = tokenizers.Tokenizer.from_str(cached["backend"])
            return TokenizersBackend(
                tokenizer_object=backend, name_or_path=str(path.parent), **cached["arguments"]
            )
        except Exception:  # noqa: BLE001 - absent, unreadable or stale: convert instead
            pass
    converted = _convert_gguf_tokenizer(arch, metadata)
    if converted is None:
        return None
    backend, arguments = converted
    if cache_file is not None:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
            text = json.dumps({"backend": backend.to_str(), "arguments": arguments})
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, cache_file)  # atomic: a reader never sees half a file
        except (OSError, TypeError, ValueError) as e:
            log.info("GGUF tokenizer cache not written (%s): %s", cache_file, e)
    return TokenizersBackend(tokenizer_object=backend, name_or_path=str(path.parent), **arguments)


def _convert_gguf_tokenizer(arch: str, metadata: dict[str, Any]) -> tuple[Any, dict] | None:
    """(the ``tokenizers`` backend transformers converts the metadata to, the keyword
    arguments of TokenizersBackend), as transformers' get_gguf_tokenizer +
    convert_gguf_tokenizer; None for a transformers without that API."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # another transformers: its AutoTokenizer decides
        return None
    grouped = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }  # fmt: skip
    tokenizer_dict, arguments = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        arguments.setdefault("add_bos_token", True)  # llama.cpp's default for SentencePiece
    elif tokenizer_dict.get("tokenizer_type") == "gemma4":
        arguments["add_bos_token"] = False
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        arguments[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    return backend, {**arguments, **extra}


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; optional bos/eos ids (e.g. the model config's).

    decode skips ids outside 0..255 (specials, or ids a random model emits beyond the bytes)
    and replaces invalid UTF-8, so any id sequence decodes.

    added_tokens: {text: id >= 256}, as a Hugging Face tokenizer's ordinary added tokens
    (e.g. ``<think>``): encode gives the id for each occurrence of the text (longest
    first), decode gives the text back. Grammar backends see no bytes for them (never
    allowed by a grammar). ValueError for an id below 256 or an empty text.
    """

    def __init__(self, eos_token_id: int | None = None, bos_token_id: int | None = None,
                 added_tokens: dict[str, int] | None = None):  # fmt: skip
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.vocab_size = 256
        self.added_tokens = dict(added_tokens or {})
        bad = {t: i for t, i in self.added_tokens.items() if i < 256 or not t}
        if bad:
            raise ValueError(f"added_tokens need ids >= 256 and non-empty texts, got {bad}")
        self._added_text = {i: t.encode("utf-8") for t, i in self.added_tokens.items()}
        self._split = None
        if self.added_tokens:
            alternation = "|".join(map(re.escape, sorted(self.added_tokens, key=len, reverse=True)))
            self._split = re.compile(f"({alternation})")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._split is None:
            ids = list(text.encode("utf-8"))
        else:
            ids = []
            for i, part in enumerate(self._split.split(text)):  # odd parts: added tokens
                ids.extend([self.added_tokens[part]] if i % 2 else part.encode("utf-8"))
        if add_special_tokens and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        special = {self.bos_token_id, self.eos_token_id} if skip_special_tokens else set()
        added = self._added_text
        data = b"".join(added[i] if i in added else bytes([i]) for i in ids
                        if (0 <= i < 256 or i in added) and i not in special)  # fmt: skip
        return data.decode("utf-8", errors="replace")


def load_tokenizer(directory: str | Path | None) -> Tokenizer:
    """The directory's HF tokenizer if it has one, else a ByteTokenizer using the eos/bos
    ids of its config.json (if any). ``None`` gives a plain ByteTokenizer."""
    if directory is None:
        return ByteTokenizer()
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {directory}")
    if any((directory / f).is_file() for f in TOKENIZER_FILES):
        return HFTokenizer(directory)
    eos = bos = None
    config = directory / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        eos = cfg.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        bos = cfg.get("bos_token_id")
    return ByteTokenizer(eos_token_id=eos, bos_token_id=bos)
