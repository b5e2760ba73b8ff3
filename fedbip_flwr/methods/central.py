"""Central (reference, NOT private): every client uploads its images and the server trains on
the pooled real data. The upper bound a one-shot method is measured against; its upload is
the raw images, which is exactly what the other methods exist to avoid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from ..policy import UploadKind
from ..server import keyed_shard, shard_key
from ..upload import UploadMeta
from ..viz import dequantize, quantize
from .base import (
    ClientJob,
    Method,
    ServerJob,
    Upload,
    check_labels,
    check_tensor,
    common_meta,
    encode_upload,
    register,
)


class CentralMeta(UploadMeta):
    method: Literal["central"] = "central"


@register
class Central(Method):
    name = "central"
    # uploads: the images themselves, with their labels
    uploads = frozenset({UploadKind.IMAGES, UploadKind.COUNTS})
    meta_model = CentralMeta
    tensor_names = ("images", "labels")

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        tensors = {"images": quantize(job.data.images), "labels": job.data.labels.to(torch.int64)}
        return encode_upload(CentralMeta(**common_meta(job)), tensors), {}

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        size = server.cfg.data.image_size
        check_tensor(upload, "images", torch.uint8, (upload.meta.num_examples, 3, size, size))
        check_labels(upload)
        return upload

    def train_set(
        self,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> dict[str, list[Path]]:
        out = {}
        for client_id, upload in sorted(uploads.items()):
            images, labels = upload.tensors["images"], upload.tensors["labels"]
            key = shard_key((self.name,), images, labels)
            out[client_id] = [
                keyed_shard(
                    shard_path(client_id, 0),
                    key,
                    labels,
                    lambda i=images: [dequantize(i)],
                    mode=server.shard_mode,
                )
            ]
        return out
