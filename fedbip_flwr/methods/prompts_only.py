"""Prompts-only (the paper's reference without personalization): a client tells the server
only how many images it holds per class; the server samples "a {domain} of a {class}" from
fresh noise with the pretrained LDM. What text alone reaches, and the floor FedBiP must beat.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from ..concepts import plain_prompt
from ..method_settings import FreshNoiseSettings
from ..policy import UploadKind
from ..synthesis import encode_texts
from ..upload import UploadMeta
from .base import (
    ClientJob,
    Method,
    ServerJob,
    Upload,
    check_class_counts,
    class_counts,
    common_meta,
    encode_upload,
    fresh_noise_labels,
    fresh_noise_set,
    register,
)


class PromptsOnlyMeta(UploadMeta):
    method: Literal["prompts-only"] = "prompts-only"


@register
class PromptsOnly(Method):
    name = "prompts-only"
    # uploads: its class counts alone
    uploads = frozenset({UploadKind.COUNTS})
    settings: FreshNoiseSettings
    meta_model = PromptsOnlyMeta
    tensor_names = ("class_counts",)

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        counts = class_counts(job.data.labels, len(job.data.classes))
        return encode_upload(PromptsOnlyMeta(**common_meta(job)), {"class_counts": counts}), {}

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        check_class_counts(upload, server)
        return upload

    def train_set(
        self,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> dict[str, list[Path]]:
        template = server.cfg.data.prompt_template
        out = {}
        for client_id, upload in sorted(uploads.items()):
            prompts = [plain_prompt(template, upload.domain, name) for name in server.class_names]
            cond = encode_texts(server.ldm(), prompts)
            labels = fresh_noise_labels(
                upload.tensors["class_counts"], self.settings, server.cfg.class_cap
            )
            out[client_id] = [
                fresh_noise_set(server, client_id, cond, labels, shard_path(client_id, 0))
            ]
        return out
