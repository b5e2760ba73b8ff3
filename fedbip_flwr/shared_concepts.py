"""What a client's learned concepts are once they leave it: S, V and what places them in the
prompt, the one type synthesis conditions on whichever method's upload carried them, and the
check that V's rows follow the prompt layout.

Kept apart from :mod:`fedbip_flwr.concepts` (which learns them, with diffusers and transformers)
so that decoding and validating an upload imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .upload import PayloadError


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors with == is not a bool
class Concepts:
    """A client's learned concepts as a server conditions on them: S, V, and what places them
    in the prompt. What synthesis takes, whichever method's upload carried them."""

    domain: torch.Tensor  # S (n_s, d) float32
    classes: torch.Tensor  # V (len(concept_names), n_v, d) float32
    template: str  # the prompt they were learned in: {S} and {V} once each
    domain_phrase: str  # the words S started from
    concept_names: tuple[str, ...]  # the class each row of V is a concept of (class-major)
    space: str  # "token" or "hidden"
    owner: str  # whose they are (a client id), named in errors


def check_concept_rows(
    class_concepts: torch.Tensor, lengths: Sequence[int], class_names: Sequence[str]
) -> None:
    """V is one (C, n_v, d) tensor but V_y uses only its first ``lengths[y]`` rows: those must
    be non-zero and the rest exactly zero, or client and server disagree on the prompt layout."""
    for name, rows, length in zip(class_names, class_concepts, lengths, strict=True):
        used = rows[:length].abs().amax(dim=-1) > 0
        if length > len(rows) or not bool(used.all()) or bool(rows[length:].any()):
            raise PayloadError(
                f"class concept of {name!r} does not use exactly its first {length} of "
                f"{len(rows)} vectors (the rest zero), as the server's prompt layout does "
                "(clients and server must share run config data.n-v and the base model's tokenizer)"
            )
