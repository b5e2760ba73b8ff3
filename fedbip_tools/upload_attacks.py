"""The server's membership test on the upload a run actually received, one per upload kind.

The server holds every accepted upload (the run folder's ``payloads/``), the base model and public
images of each domain. For each client it asks: which of these candidate images did the client
hold? Candidates are the client's private images (members) and as many unseen images of its
domain and classes (non-members); each kind of upload gets the strongest test
:mod:`fedbip_tools.privacy` has for it, computed by the server from what it holds:

* z(T) rows (FedBiP and its ablations): the whitened likelihood ratio of the candidate's latent
  against the rows of its class, rows as uploaded (:func:`~fedbip_tools.privacy.zT_membership_scores`);
* a mixture over z(T) (fedbip-mixture, FedLD, Espresso, with or without DP): the matched filter on
  each class's mixture mean (:func:`~fedbip_tools.privacy.mixture_membership_scores`);
* a mean per class of what the server can compute itself (FedPFT's backbone features, OSCAR's
  caption states): :func:`~fedbip_tools.privacy.class_mean_scores`;
* a trained classifier (FedLMG, Local): its loss on the candidate (low loss = member);
* the images themselves (Central): the distance to the nearest uploaded image.

Prompts-only uploads class counts only: no test. FedAvg's replies are kept by no run folder: its
server test is a record (``scripts/server_attacks.py --kinds fedavg fedavg-head``), its rounds
simulated with its own client step and Flower's average.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from fedbip_flwr.captioner import load_captioner
from fedbip_flwr.classifier import evaluate
from fedbip_flwr.clusters import public_encoder
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.instance import encode_images
from fedbip_flwr.ldm import LDM
from fedbip_flwr.method_settings import PairSettings
from fedbip_flwr.methods.base import Upload
from fedbip_flwr.methods.oscar import caption_images, class_conditioning
from fedbip_flwr.mixture import LatentMixture
from fedbip_flwr.viz import dequantize

from .privacy import (
    AttackResult,
    LatentReference,
    class_mean_scores,
    membership_result,
    mixture_membership_scores,
    nearest_distances,
    zT_membership_scores,
)

# public images per class of a domain the server encodes as its reference (whitening, centres)
REFERENCE_PER_CLASS = 100


class Labelled(Protocol):
    images: torch.Tensor  # (N, 3, s, s) in [-1, 1]
    labels: torch.Tensor  # (N,) int64, the run's class order


@dataclass(frozen=True)
class Candidates:
    """Images the server tests against one client's upload."""

    members: Labelled  # the client's private images
    others: Labelled  # as many unseen images of its domain and classes


@dataclass(frozen=True)
class ServerView:
    """What the server holds besides the upload: the run config, the base model (loaded on
    first use), and public images of the candidates' domain (its base model's pretraining
    split: no member, no non-member)."""

    cfg: FedBiPConfig
    ldm: Callable[[], LDM]
    public: Labelled


Scores = tuple[torch.Tensor, torch.Tensor]  # members', non-members' (higher = member)
Test = Callable[[Upload, Candidates, ServerView], Scores]


@dataclass(frozen=True)
class UploadTest:
    statistic: str  # what the table's column names
    run: Test


def _latents(view: ServerView, images: torch.Tensor) -> torch.Tensor:
    return encode_images(view.ldm().vae, images, view.cfg.ldm.vae_batch_size)


def _signal_scale(view: ServerView, timestep: int) -> float:
    return float(view.ldm().scheduler.alphas_cumprod[timestep].sqrt())


def _mixing(view: ServerView) -> tuple[float, float]:
    """The run method's pair mixing, gamma ~ N(mean, std^2); (1, 0) for one that mixes no
    partner into an image (FedLD)."""
    own = view.cfg.settings_of(view.cfg.method)
    return (own.gamma_mean, own.gamma_std) if isinstance(own, PairSettings) else (1.0, 0.0)


def zT_rows_test(upload: Upload, c: Candidates, view: ServerView) -> Scores:
    payload = upload.content
    reference = LatentReference.of(_latents(view, view.public.images), view.public.labels)
    gamma_mean, gamma_std = _mixing(view)
    kwargs = {
        "signal_scale": _signal_scale(view, payload.meta.timestep),
        "reference": reference,
        "latents_per_image": max(1, len(payload.latents) // max(1, upload.meta.num_examples)),
        "gamma_mean": gamma_mean,
        "gamma_std": gamma_std,
    }
    return tuple(
        zT_membership_scores(
            _latents(view, s.images), s.labels, payload.latents.float(), payload.labels, **kwargs
        )
        for s in (c.members, c.others)
    )


def _mixture(upload: Upload) -> LatentMixture:
    content = upload.content
    return content if isinstance(content, LatentMixture) else content.mixture


def mixture_mean_test(upload: Upload, c: Candidates, view: ServerView) -> Scores:
    reference = LatentReference.of(_latents(view, view.public.images), view.public.labels)
    gamma_mean, gamma_std = _mixing(view)
    return tuple(
        mixture_membership_scores(
            _latents(view, s.images),
            s.labels,
            _mixture(upload),
            signal_scale=_signal_scale(view, upload.meta.timestep),
            reference=reference,
            gamma_mean=gamma_mean,
            gamma_std=gamma_std,
            statistic="mean-filter",
        )
        for s in (c.members, c.others)
    )


def _class_mean_test(
    features: Callable[[ServerView], Callable[[torch.Tensor], torch.Tensor]],
    means: Callable[[Upload], torch.Tensor],
) -> Test:
    """The class-mean test with the server's own ``features`` of an image (made once per
    upload: its models load once) and the upload's per-class ``means`` of them."""

    def run(upload: Upload, c: Candidates, view: ServerView) -> Scores:
        encode, public = features(view), view.public
        centres = LatentReference.of(encode(public.images), public.labels).centres
        return tuple(
            class_mean_scores(encode(s.images), s.labels, means(upload), centres)
            for s in (c.members, c.others)
        )

    return run


def backbone_features(view: ServerView) -> Callable[[torch.Tensor], torch.Tensor]:
    return public_encoder(view.cfg.ldm.model, view.cfg.classifier.image_size)


def caption_states(view: ServerView) -> Callable[[torch.Tensor], torch.Tensor]:
    """Each image's mean text-encoder states over captions the server's copy of the captioner
    writes (its own draw, not the client's)."""
    own = view.cfg.settings_of("oscar")
    captioner = load_captioner(own.captioner)

    def states(images: torch.Tensor) -> torch.Tensor:
        captions = caption_images(captioner, images, own.captions_per_image, torch.Generator())
        per_image = torch.arange(len(images)).repeat(own.captions_per_image)  # pass-major
        return class_conditioning(view.ldm(), captions, per_image, len(images))

    return states


def mixture_class_means(upload: Upload) -> torch.Tensor:
    mixture = upload.content
    return torch.einsum("ck,ckd->cd", mixture.weights, mixture.means)


def classifier_loss_test(upload: Upload, c: Candidates, view: ServerView) -> Scores:
    size = view.cfg.classifier.image_size
    return tuple(
        -evaluate(upload.content, s.images, s.labels, size).losses for s in (c.members, c.others)
    )


def nearest_upload_test(upload: Upload, c: Candidates, view: ServerView) -> Scores:
    """Minus each candidate's RMS pixel distance to its nearest uploaded image (uint8, checked
    at acceptance)."""
    uploaded = dequantize(upload.tensors["images"]).flatten(1)
    scale = math.sqrt(uploaded.shape[1])
    return tuple(
        -nearest_distances(s.images.float(), uploaded) / scale for s in (c.members, c.others)
    )


MIXTURE = UploadTest("mixture mean, matched filter", mixture_mean_test)
CLASSIFIER = UploadTest("classifier loss", classifier_loss_test)
TESTS: Mapping[str, UploadTest] = {
    "fedbip": UploadTest("z(T) likelihood ratio", zT_rows_test),
    "fedbip-mixture": MIXTURE,
    "fedld": MIXTURE,
    "espresso": MIXTURE,
    "fedpft": UploadTest(
        "feature class mean", _class_mean_test(backbone_features, mixture_class_means)
    ),
    "oscar": UploadTest(
        "caption-state class mean",
        _class_mean_test(caption_states, lambda u: u.tensors["conditioning"]),
    ),
    "fedlmg": CLASSIFIER,
    "local": CLASSIFIER,
    "central": UploadTest("nearest uploaded image", nearest_upload_test),
}


def upload_test(method: str) -> UploadTest | None:
    """The server's test on ``method``'s upload; None where it uploads nothing of an image."""
    return TESTS.get(method)


def attack_upload(upload: Upload, candidates: Candidates, view: ServerView) -> AttackResult:
    """Membership AUC, its standard error and TPR at 1% FPR of the server's test on one upload."""
    test = TESTS[view.cfg.method]
    with torch.no_grad():
        members, others = test.run(upload, candidates, view)
    return membership_result(members, others, statistic=test.statistic)
