"""CLIP's real BPE tokenizer (Stable Diffusion v1-x), built offline from CLIP's merges file.

The Hub copy of ``openai/clip-vit-large-patch14``'s tokenizer cannot be fetched here, but its
merges file ships inside PyPI packages (``open_clip_torch`` holds
``open_clip/bpe_simple_vocab_16e6.txt.gz``). The vocabulary is rebuilt the way CLIP's own
``SimpleTokenizer`` does, so ids are CLIP's: the 256 byte-level characters, the same with
``</w>``, one token per merge, then ``<|startoftext|>`` and ``<|endoftext|>`` (49,408 in all).
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

from transformers import CLIPTokenizer

CLIP_VOCAB_SIZE = 49408
CLIP_MAX_LENGTH = 77
_NUM_MERGES = CLIP_VOCAB_SIZE - 2 * 256 - 2  # 48,894: CLIP reads lines 1 .. 48,894
MERGES_FILE = "bpe_simple_vocab_16e6.txt.gz"


def bytes_to_unicode() -> dict[int, str]:
    """CLIP's byte -> printable character table, in CLIP's order (printable bytes first).

    The order matters: it is the order of the first 512 token ids.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + i) for i, b in enumerate(others)})
    return table


def find_merges_file() -> Path:
    """CLIP's merges file from the installed ``open_clip_torch`` package (without importing it)."""
    spec = importlib.util.find_spec("open_clip")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / MERGES_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"CLIP's merges file {MERGES_FILE} was not found: pip install open_clip_torch "
        "(it ships inside the package), or pass its path"
    )


def clip_tokenizer(
    merges_file: str | Path | None = None, max_length: int = CLIP_MAX_LENGTH
) -> CLIPTokenizer:
    """CLIP ViT-L/14's tokenizer (SD v1-x's), ids identical to CLIP's own."""
    path = Path(merges_file) if merges_file is not None else find_merges_file()
    lines = gzip.open(path, "rt", encoding="utf-8").read().split("\n")
    merges = [tuple(line.split()) for line in lines[1 : _NUM_MERGES + 1]]
    chars = list(bytes_to_unicode().values())
    tokens = [
        *chars,
        *(c + "</w>" for c in chars),
        *("".join(m) for m in merges),
        "<|startoftext|>",
        "<|endoftext|>",
    ]
    vocab = {token: index for index, token in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)
