"""The transformers reference for a GGUF model: the same file loaded by transformers'
own GGUF loader (dequantized to fp32), so pagedjax and the reference share weights bit
for bit and differ only in their arithmetic.

Needs transformers, torch, gguf and accelerate (the ``test`` extra); nothing is fetched
from a hub (local files only).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While transformers loads one GGUF file, build gguf-py's reader once per path and its
    tensor-name map once per (architecture, depth).

    transformers parses the whole file's metadata three times (config, tokenizer, weights:
    ~8-10 s each for SmolLM2's 49k-token vocabulary, element by element through numpy
    memmaps) and rebuilds gguf's tensor-name map for every tensor (~37 ms x 272). Both are
    pure: the reader is a read-only view of the file, the map a table of constants. Caching
    them changes no byte of what transformers builds and takes ~30 s off each load (the
    real-model tests load it in the default tier). The originals are restored on exit."""
    try:
        import gguf
    except ImportError:  # transformers reports the missing package itself
        yield
        return
    reader_cls, name_map_fn = gguf.GGUFReader, gguf.get_tensor_name_map

    @functools.cache
    def reader(path: str, mode: str = "r") -> Any:
        return reader_cls(path, mode)

    gguf.GGUFReader = lambda path, mode="r": reader(str(path), mode)
    gguf.get_tensor_name_map = functools.cache(name_map_fn)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map_fn


def load_hf_gguf(path: str | Path) -> tuple[Any, Any]:
    """(model in fp32, eval mode; tokenizer) built by transformers from a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    kwargs = dict(gguf_file=path.name, local_files_only=True)
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    return model.eval(), tokenizer


def load_hf_gguf_tokenizer(path: str | Path) -> Any:
    """transformers' tokenizer alone, from a GGUF file (no weights read)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with _gguf_parsed_once():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
