"""A client's learned concepts as textual-inversion embeddings, for any diffusers pipeline.

In token space (the paper's ``concept-space = "token"``) S and every V_y are input token
embeddings of the base model's text encoder: exactly what textual inversion learns. Exported in
diffusers' own format (one safetensors file per token, holding one tensor under the token's
name), ``pipe.load_textual_inversion(file)`` adds them to a pipeline of the *same* base model,
and "a <sketch> of a <circle>" then samples the client's domain and class without this project.
A concept of n > 1 vectors is stored as an (n, d) tensor: diffusers adds the tokens ``<t>``,
``<t>_1`` ... ``<t>_{n-1}`` and expands ``<t>`` in prompts to all of them, which reproduces the
n consecutive slots the concept was learned in.

Concepts in ``hidden`` space replace text-encoder *outputs*, which no token embedding can
reproduce, so they are refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import safetensors.torch
import torch

from fedbip_flwr.config import CONCEPT_SLOT_S, CONCEPT_SLOT_V
from fedbip_flwr.payload import Payload
from fedbip_flwr.storage import atomic_write

INDEX_FILE = "concepts.json"
_UNSAFE = re.compile(r"[^\w.-]+")


class ExportError(ValueError):
    """The payload's concepts cannot be used as textual-inversion embeddings; says why."""


@dataclass(frozen=True)
class ExportedConcept:
    """One token written to disk: what to type in a prompt and which file defines it."""

    token: str  # e.g. "<sketch>"
    kind: str  # "domain" or "class"
    name: str  # the domain or class name the concept was learned for
    vectors: int  # n_s or n_v: how many token embeddings the concept spans
    file: str  # file name inside the export folder


def token_for(name: str) -> str:
    """``<name>`` with whitespace as hyphens: one prompt word, unlike any vocabulary entry."""
    return "<" + "-".join(name.split()) + ">"


def file_for(kind: str, name: str) -> str:
    """A portable file name: brackets and path separators are not welcome in every shell."""
    return f"{kind}-{_UNSAFE.sub('_', '-'.join(name.split()))}.safetensors"


def concept_embeddings(payload: Payload) -> list[tuple[ExportedConcept, torch.Tensor]]:
    """Each concept of a token-space payload (S, then every V_y) with its (n, d) embedding."""
    meta = payload.meta
    if meta.concept_space != "token":
        raise ExportError(
            f"this payload's concepts live in the text encoder's '{meta.concept_space}' output "
            "space, which textual inversion cannot express; export one made with "
            'fedbip.concept-space = "token"'
        )
    named = [("domain", meta.domain, payload.domain_concept)]
    classes = zip(meta.class_names, payload.class_concepts, strict=True)
    named += [("class", name, _used_rows(vectors)) for name, vectors in classes]
    concepts = [
        (ExportedConcept(token_for(name), kind, name, int(emb.shape[0]), file_for(kind, name)), emb)
        for kind, name, emb in named
    ]
    for field in ("token", "file"):
        values = [getattr(concept, field) for concept, _ in concepts]
        if len(set(values)) < len(values):
            raise ExportError(f"two concepts of this payload would share a {field}: {values}")
    return concepts


def _used_rows(vectors: torch.Tensor) -> torch.Tensor:
    """V_y's own vectors: one per token of its class name (at least data.n-v), then zero rows that
    pad V to the longest class name and that its prompt never uses (payload validation checks
    the used rows are non-zero)."""
    return vectors[: int((vectors.abs().amax(dim=-1) > 0).sum())]


def export_concepts(payload: Payload, out_dir: Path) -> list[ExportedConcept]:
    """Write one diffusers textual-inversion file per concept and an index, ``concepts.json``.

    Each file also carries the base model's fingerprint in its metadata: the embeddings mean
    something only under the text encoder they were learned with.
    """
    out_dir = Path(out_dir)
    concepts = concept_embeddings(payload)
    for concept, embedding in concepts:
        metadata = {"fedbip.base_model": payload.meta.base_model, "fedbip.kind": concept.kind}
        tensors = {concept.token: embedding.float().contiguous()}
        atomic_write(out_dir / concept.file, safetensors.torch.save(tensors, metadata=metadata))
    exported = [concept for concept, _ in concepts]
    index = {
        "base_model": payload.meta.base_model,
        "client_id": payload.meta.client_id,
        "example_prompt": example_prompt(payload),
        "concepts": [asdict(concept) for concept in exported],
    }
    atomic_write(out_dir / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
    return exported


def example_prompt(payload: Payload) -> str:
    """The client's prompt template with its domain token and its first class token."""
    meta = payload.meta
    return meta.prompt_template.replace(CONCEPT_SLOT_S, token_for(meta.domain)).replace(
        CONCEPT_SLOT_V, token_for(meta.class_names[0])
    )
