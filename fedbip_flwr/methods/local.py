"""Local (reference): every client trains a classifier on its own images only; each is scored
on every domain and the scores averaged. What a client gets without any federation.

The client's classifier and its upload (ResNet-18 weights and BatchNorm statistics as
safetensors, checked name by name against the architecture) are also FedLMG's client step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ..classifier import build_classifier, train_classifier
from ..method_settings import LocalSettings
from ..policy import UploadKind
from ..server import train_settings
from ..upload import UploadMeta
from .base import (
    ClientJob,
    Method,
    ServerJob,
    Upload,
    check_tensor,
    common_meta,
    encode_upload,
    register,
)


class LocalMeta(UploadMeta):
    method: Literal["local"] = "local"


def train_local_classifier(job: ClientJob, epochs: int) -> nn.Module:
    """ResNet-18 trained on the client's private images (seeded from the client's own noise)."""
    seed = int(torch.randint(2**31 - 1, (1,), generator=job.generator))
    torch.manual_seed(seed)
    model = build_classifier(len(job.data.classes), job.cfg.classifier.init, job.cfg.ldm.model)
    return train_classifier(
        model,
        job.data.images,
        job.data.labels,
        train_settings(job.cfg.classifier, epochs),
        seed=seed,
        device=job.device,
    ).cpu()


def classifier_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Weights and BatchNorm statistics (running means, variances, counts), as uploaded."""
    return {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}


def classifier_names(num_classes: int) -> tuple[str, ...]:
    return tuple(build_classifier(num_classes, "random").state_dict())


def check_classifier(upload: Upload, prefix: str = "") -> nn.Module:
    """The uploaded tensors (under ``prefix``) as a ResNet-18 for the run's classes: every
    name, shape and dtype must be the architecture's own, or :class:`PayloadError`."""
    model = build_classifier(len(upload.meta.class_names), "random")
    for name, want in model.state_dict().items():
        check_tensor(upload, prefix + name, want.dtype, tuple(want.shape), "the architecture's")
    model.load_state_dict({name: upload.tensors[prefix + name] for name in model.state_dict()})
    return model.eval()


@register
class Local(Method):
    name = "local"
    # uploads: its own classifier
    uploads = frozenset({UploadKind.CLASSIFIER})
    settings: LocalSettings
    meta_model = LocalMeta
    tensor_names = ()  # the classifier's own names, for the run's classes

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        model = train_local_classifier(job, self.settings.epochs)
        return encode_upload(LocalMeta(**common_meta(job)), classifier_tensors(model)), {}

    def expected_tensors(self, server: ServerJob) -> tuple[str, ...]:
        return classifier_names(len(server.class_names))

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        return Upload(upload.meta, upload.tensors, content=check_classifier(upload))

    def train_set(
        self,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> dict[str, list[Path]]:
        return {}

    def final_models(
        self, uploads: Mapping[str, Upload], server: ServerJob
    ) -> dict[str, nn.Module]:
        return {client_id: upload.content for client_id, upload in sorted(uploads.items())}
