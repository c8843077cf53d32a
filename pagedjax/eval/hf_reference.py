"""The transformers reference for a GGUF model: the same file loaded by transformers'
own GGUF loader (dequantized to fp32), so pagedjax and the reference share weights bit
for bit and differ only in their arithmetic.

Needs transformers, torch, gguf and accelerate (the ``test`` extra); nothing is fetched
from a hub (local files only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_hf_gguf(path: str | Path) -> tuple[Any, Any]:
    """(model in fp32, eval mode; tokenizer) built by transformers from a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    kwargs = dict(gguf_file=path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kwargs)
    return model.eval(), tokenizer
