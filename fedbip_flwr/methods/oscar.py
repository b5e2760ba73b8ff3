"""OSCAR (One-Shot FL with Classifier-Free Diffusion Models, ICME'25), a peer of FedBiP.

Client (eqs. 6-7): a frozen captioner (:mod:`fedbip_flwr.captioner`; the paper's BLIP, or the
miniature stand-in) captions every private image ``oscar.captions-per-image`` times, sampling from
the client's own generator; the LDM's text encoder turns each caption into its full hidden
states (L x d), and these are averaged per class. The upload is that per-class conditioning
``conditioning`` (C, L, d) float32 plus ``class_counts`` (C,) int64; a class the client lacks
has a zero row and a zero count. The captions never leave the client. The official code
averages the full 1 x 77 x 768 hidden states (59,136 floats per class on SD v1-4), not the 512
floats the paper counts; this module uploads what the code does, so its size is the real one.

Server (eq. 8): fresh Gaussian noise, classifier-free guidance toward each held class's
conditioning, ``images-per-class`` images per class (the paper: 10) or as many as FedBiP makes
from the same client. OSCAR writes the guided noise as (1 + s) eps(c) - s eps(empty), which is
standard CFG with w = 1 + s: the paper's s = 7.5 is w = 8.5, the official code's effective
s = 6.5 is w = 7.5. The run's ``synthesis.guidance-scale`` is w and is shared by every
fresh-noise method, so a benchmark compares them at one guidance (the miniature LDM is trained
for w about 4); set ``synthesis.guidance-scale = 8.5`` for the paper's value. The sampler is the
project's PNDM (which the official code also ends up using: it builds a DDIM scheduler but never
attaches it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from ..captioner import Captioner, load_captioner
from ..ldm import LDM
from ..method_settings import OSCARSettings
from ..policy import UploadKind
from ..synthesis import encode_texts
from ..upload import PayloadError, UploadMeta
from .base import (
    ClientJob,
    Method,
    ServerJob,
    Upload,
    check_class_counts,
    check_tensor,
    class_counts,
    common_meta,
    encode_upload,
    fresh_noise_labels,
    fresh_noise_set,
    register,
)

ENCODE_BATCH = 64  # captions per text-encoder call
NORM_TOLERANCE = 1.01  # fp16 text encoders round; a lie is orders of magnitude off


class OscarMeta(UploadMeta):
    method: Literal["oscar"] = "oscar"
    captioner: str = Field(min_length=1)  # the hub id or folder name of the captioner used
    captioner_fingerprint: str = Field(min_length=1)
    captions_per_image: int = Field(ge=1)
    base_model: str = Field(min_length=1)  # the LDM whose text encoder made the conditioning


@register
class OSCAR(Method):
    name = "oscar"
    # uploads: per class the mean encoding of its captions, and class counts
    uploads = frozenset({UploadKind.TEXT, UploadKind.COUNTS})
    settings: OSCARSettings
    meta_model = OscarMeta
    tensor_names = ("class_counts", "conditioning")

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        own, data = self.settings, job.data
        captioner = load_captioner(own.captioner, job.device)
        started = time.perf_counter()
        captions = caption_images(captioner, data.images, own.captions_per_image, job.generator)
        captioned = time.perf_counter()
        ldm = job.ldm()
        encoding = time.perf_counter()
        labels = data.labels.repeat(own.captions_per_image)  # captions are pass-major
        conditioning = class_conditioning(ldm, captions, labels, len(data.classes))
        meta = OscarMeta(
            **common_meta(job),
            captioner=captioner.name,
            captioner_fingerprint=captioner.fingerprint,
            captions_per_image=own.captions_per_image,
            base_model=ldm.fingerprint,
        )
        tensors = {
            "class_counts": class_counts(data.labels, len(data.classes)),
            "conditioning": conditioning,
        }
        return encode_upload(meta, tensors), {
            "num-captions": len(captions),
            "seconds-caption": captioned - started,
            "seconds-encode": time.perf_counter() - encoding,
        }

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        """Conditioning from the server's text encoder: its (C, L, d) shape, within the range
        its final LayerNorm can output, zero exactly for the classes the client lacks."""
        ldm = server.ldm()
        if upload.meta.base_model != ldm.fingerprint:
            raise PayloadError(
                f"conditioning was encoded by base model {upload.meta.base_model}, the server's "
                f"is {ldm.fingerprint}: client and server must load the same LDM"
            )
        counts = check_class_counts(upload, server)
        shape = (len(server.class_names), int(ldm.tokenizer.model_max_length), ldm.concept_dim)
        conditioning = check_tensor(upload, "conditioning", torch.float32, shape)
        empty = conditioning.flatten(1).abs().amax(1) == 0
        if bool((empty != (counts == 0)).any()):
            raise PayloadError(
                f"conditioning rows must be zero exactly for the classes with no images "
                f"(class_counts {counts.tolist()}, zero rows {empty.nonzero().flatten().tolist()})"
            )
        bound = hidden_state_bound(ldm.text_encoder)
        if (largest := float(conditioning.norm(dim=-1).max())) > bound:
            raise PayloadError(
                f"conditioning has a token vector of norm {largest:.4g}, above {bound:.4g}, the "
                "most the server's text encoder can output (its final LayerNorm bounds it)"
            )
        return upload

    def train_set(
        self,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> dict[str, list[Path]]:
        out = {}
        for client_id, upload in sorted(uploads.items()):
            counts = upload.tensors["class_counts"]
            labels = fresh_noise_labels(counts, self.settings, server.cfg.class_cap)
            labels = labels[counts[labels] > 0]  # a class the client lacks has no conditioning
            cond = upload.tensors["conditioning"]
            out[client_id] = [
                fresh_noise_set(server, client_id, cond, labels, shard_path(client_id, 0))
            ]
        return out


def caption_images(
    captioner: Captioner, images: torch.Tensor, per_image: int, generator: torch.Generator
) -> list[str]:
    """``per_image`` sampled captions of every image, pass by pass (image order within)."""
    return [caption for _ in range(per_image) for caption in captioner.caption(images, generator)]


@torch.no_grad()
def class_conditioning(
    ldm: LDM, captions: list[str], labels: torch.Tensor, num_classes: int
) -> torch.Tensor:
    """Eq. 7: the mean text-encoder hidden states (C, L, d) float32 of each class's captions;
    zero for a class without captions. Encoded a batch at a time, so memory stays flat."""
    sums = torch.zeros(num_classes, int(ldm.tokenizer.model_max_length), ldm.concept_dim)
    for start in range(0, len(captions), ENCODE_BATCH):
        hidden = encode_texts(ldm, captions[start : start + ENCODE_BATCH]).float().cpu()
        sums.index_add_(0, labels[start : start + ENCODE_BATCH], hidden)
    counts = torch.bincount(labels, minlength=num_classes).clamp(min=1)
    return sums / counts[:, None, None]


def hidden_state_bound(text_encoder: nn.Module) -> float:
    """The largest norm any token vector of the encoder's output (and so any average of them)
    can have: its final LayerNorm gives gamma * x_hat + beta with ||x_hat|| <= sqrt(d)."""
    norm = getattr(text_encoder, "text_model", text_encoder).final_layer_norm  # transformers 4 / 5
    gamma, beta = norm.weight.float(), norm.bias.float()
    return NORM_TOLERANCE * float(gamma.abs().max() * gamma.numel() ** 0.5 + beta.norm())
