"""A client's side once the round is over: scoring the classifier it gets back, and where it
keeps it.

Plain library code. Which method's upload a client computes is
:func:`fedbip_flwr.methods.institution_upload`; FedBiP's is
:func:`fedbip_flwr.methods.fedbip.personalize`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .classifier import evaluate
from .paths import resolve
from .results import PRIVATE_ACCURACY_DIGITS, SENT_ACCURACY, SENT_CORRECT, SENT_IMAGES, SENT_TOTAL
from .shapes import ImageSet


def score_classifier(
    model: torch.nn.Module, test: ImageSet, image_size: int, private: bool = False
) -> dict:
    """What an institution reports about the classifier it got back: metrics only, no images.

    ``private`` (a DP upload): the accuracy alone, to :data:`PRIVATE_ACCURACY_DIGITS` decimals,
    since the held-out counts per class would give back what the release adds noise to, and a
    full-precision ratio names its denominator."""
    result = evaluate(model, test.images, test.labels, image_size)
    if private:
        return {SENT_ACCURACY: round(result.accuracy, PRIVATE_ACCURACY_DIGITS)}
    classes = len(test.classes)
    correct = torch.bincount(test.labels[result.predictions == test.labels], minlength=classes)
    total = torch.bincount(test.labels, minlength=classes)
    return {
        SENT_ACCURACY: result.accuracy,
        SENT_IMAGES: len(test.labels),
        SENT_CORRECT: correct.tolist(),
        SENT_TOTAL: total.tolist(),
    }


def kept_classifier_path(output_dir: str, run_folder: str, client_id: str) -> Path:
    """Where an institution keeps the classifier sent back: its own output folder, per run.

    The run folder's name comes from the server, so it must be a plain name, never a path.
    """
    if not re.fullmatch(r"\w[\w.-]{0,127}", run_folder):
        raise ValueError(
            f"the server named the run folder {run_folder!r}, which is not a plain name"
        )
    return resolve(output_dir) / run_folder / "institutions" / client_id / "classifier.safetensors"
