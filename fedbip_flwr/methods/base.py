"""The shape every one-shot method has, and the registry that creates one by name.

A method is three steps, each plain library code that ``flwr run``, the benchmark and the
tests call alike:

1. :meth:`Method.upload` runs once on a client: its private images (and its own randomness)
   -> the bytes of one safetensors upload, and metrics sent beside it.
2. :meth:`Method.accept` runs on the server for every reply: untrusted bytes -> a validated
   :class:`Upload`, or :class:`~fedbip_flwr.upload.PayloadError` with the reason.
3. :meth:`Method.train_set` turns all accepted uploads into the classifier's training set,
   written as uint8 shards (one or more per client), which the shared classifier recipe
   (:func:`fedbip_flwr.server.train_global`) reads back; :meth:`Method.teacher` optionally
   adds soft targets (FedLMG's distillation variants) to that same recipe.
   :meth:`Method.work_units` and :meth:`Method.make_unit` cut that work into pieces other
   processes can make (`fedbip synthesize`); by default one per client, through ``train_set``.

Methods are registered by name with :func:`register` and created with :func:`create`, as in
timm. Their names, and the model of each one's own table, are listed once, below the run
config, in :data:`fedbip_flwr.method_settings.METHOD_SETTINGS` (what the run config's
``method`` key accepts, checked without importing a method); a new method is its entry there,
one module here and its import in ``methods/__init__.py``.
A method trained over several rounds on one of Flower's own strategies instead (FedAvg, the
multi-round reference) is a :class:`MultiRound`, in the same registry: its three hooks stand
where a one-shot method uploads, is scored by an institution and runs the one-round strategy
(:mod:`fedbip_flwr.apps` chooses the path, in one place), so the apps name no method.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from torch import nn

from ..classifier import Distillation, Teacher
from ..config import FedBiPConfig, NodeConfig
from ..dataset import ClientSet
from ..ldm import LDM
from ..method_settings import METHOD_SETTINGS, FreshNoiseSettings, MethodSettings
from ..mixture import LatentMixture, draw
from ..policy import UploadKind
from ..results import Accuracy, RunResults
from ..seeds import client_seed
from ..server import RunFolder, ShardMode, WorkUnit, keyed_shard, shard_key
from ..synthesis import SynthesisSettings, ZSampling, iter_denoised, iter_from_noise
from ..upload import (
    SCHEMA_VERSION,
    M,
    PayloadError,
    UploadMeta,
    check_dtype_shape,
    check_index,
    meta_strings,
    parse_meta,
    refuse_mismatch,
)
from ..upload import encode_tensors as _encode_tensors
from ..upload import read_header as _read_header
from ..upload import read_tensors as _read_tensors

__all__ = [
    "ClientJob",
    "Distillation",
    "Method",
    "MultiRound",
    "ServerJob",
    "Teacher",
    "Upload",
    "MethodSettings",
    "WorkUnit",
    "create",
    "create_for",
    "create_one_shot",
    "decode_upload",
    "encode_upload",
    "names",
    "one_shot_for",
    "register",
    "upload_kinds",
]


@dataclass(frozen=True)
class ClientJob:
    """What one client's one upload is computed from."""

    cfg: FedBiPConfig
    data: ClientSet  # private images (N, 3, s, s) in [-1, 1] at data.image-size, labels, id, domain
    generator: torch.Generator  # the client's only randomness (fedbip_flwr.client.client_generator)
    ldm: Callable[[], LDM]  # the frozen LDM, loaded on first call: not every method needs it
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(frozen=True)
class ServerJob:
    """What the server holds while it accepts uploads and builds the training set."""

    cfg: FedBiPConfig
    class_names: list[str]
    ldm: Callable[[], LDM]  # loaded once, on first call (central and local never load it)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # What making the training set does with a missing shard: make it, or (CHECK) only find
    # out whether every shard is on disk (fedbip_flwr.distributed)
    shard_mode: ShardMode = ShardMode.MAKE

    @property
    def max_bytes(self) -> int:
        return int(self.cfg.federation.max_payload_mb * 2**20)


@dataclass(frozen=True, eq=False)
class Upload:
    """One client's validated upload as the server keeps it."""

    meta: UploadMeta  # client_id, domain, class_names, num_examples and the method's own fields
    tensors: dict[str, torch.Tensor]
    content: Any = None  # the method's own decoded form (FedBiP: its Payload)

    @property
    def client_id(self) -> str:
        return self.meta.client_id

    @property
    def domain(self) -> str:
        return self.meta.domain


class Registered:
    """What every registered method has: its name, the kinds of what its clients upload (what
    an institution's upload policy allows or refuses, :mod:`fedbip_flwr.policy`) and its own
    run-config settings, of the model :data:`~fedbip_flwr.method_settings.METHOD_SETTINGS`
    lists under its name."""

    name: ClassVar[str]
    uploads: ClassVar[frozenset[UploadKind]]

    def __init__(self, settings: MethodSettings | None = None) -> None:
        self.settings = METHOD_SETTINGS[self.name]() if settings is None else settings


class Method(Registered, ABC):
    """One one-shot FL method: what a client uploads once and what the server makes of it."""

    meta_model: ClassVar[type[UploadMeta]]  # its upload's metadata, ``method`` fixed to name
    tensor_names: ClassVar[tuple[str, ...]]  # exactly the tensors its upload holds

    @abstractmethod
    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        """The client's one upload (safetensors bytes) and the metrics sent beside it."""

    def accept(self, blob: bytes, server: ServerJob) -> Upload:
        """Untrusted bytes -> a validated :class:`Upload`; :class:`PayloadError` and nothing
        else otherwise: the shared decode (size cap, header, exact tensor names, finite floats,
        metadata schema), the server's class list, then the method's own :meth:`check_alone`
        and :meth:`check`."""
        names = functools.partial(self.tensor_names_of, server)
        upload = decode_upload(blob, self.meta_model, names, server.max_bytes)
        refuse_mismatch(
            [
                (
                    "class names",
                    tuple(upload.meta.class_names),
                    tuple(server.class_names),
                    "labels index the class list, so order matters",
                )
            ]
        )
        return self.check(self.check_alone(upload), server)

    def audit(self, blob: bytes, max_bytes: int) -> Upload:
        """The upload checked on its own, without a server's model or run config: the shared
        decode for the class list its header names, then :meth:`check_alone`. What ``fedbip
        inspect`` shows."""
        _, metadata = _read_header(bytes(blob))
        classes = parse_meta(metadata, self.meta_model).class_names
        server = ServerJob(FedBiPConfig(method=self.name), list(classes), _no_model)
        names = functools.partial(self.tensor_names_of, server)
        return self.check_alone(decode_upload(blob, self.meta_model, names, max_bytes))

    def expected_tensors(self, server: ServerJob) -> tuple[str, ...]:
        """Exactly the tensor names an upload must hold under this server's run config."""
        return self.tensor_names

    def tensor_names_of(self, server: ServerJob, metadata: Mapping[str, str]) -> tuple[str, ...]:
        """The tensor names this upload must hold, read from its own metadata where the
        method's layout depends on it (FedBiP's sub-clusters); by default
        :meth:`expected_tensors`. A value the server refuses is refused by :meth:`check`."""
        return self.expected_tensors(server)

    def check_alone(self, upload: Upload) -> Upload:
        """The method's checks that need no server: its tensors agree with its own metadata."""
        return upload

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        """The method's own schema (shapes, dtypes, ranges); returns the upload to keep."""
        return upload

    def upload_floor(self, cfg: FedBiPConfig, images: int) -> int:
        """The fewest bytes a client's upload of ``images`` private images can take, known
        before computing it (an institution's byte cap refuses early with it); 0 where the
        method's upload does not grow with the images."""
        return 0

    @abstractmethod
    def train_set(
        self,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> dict[str, list[Path]]:
        """The classifier's training data per client id, as uint8 shards (``images``,
        ``labels``) at ``shard_path(client_id, index)``; shards already there under the same
        key are reused, so a restarted server resumes."""

    def work_units(self, uploads: Mapping[str, Upload], server: ServerJob) -> list[WorkUnit]:
        """The pieces of :meth:`train_set` that processes can make independently (`fedbip
        synthesize`). By default one per client, weighed by the images the method makes from
        it (its images-per-class per class, else images-per-image x the client's images): a
        weight for balancing the split, which the shards' own keys never depend on."""
        own = self.settings
        sized = isinstance(own, FreshNoiseSettings)
        per_class, per_image = (own.images_per_class, own.images_per_image) if sized else (0, 1)
        return [
            WorkUnit(
                client_id,
                0,
                per_class * len(server.class_names) or per_image * upload.meta.num_examples,
            )
            for client_id, upload in sorted(uploads.items())
        ]

    def make_unit(
        self,
        unit: WorkUnit,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> list[Path]:
        """Make (or reuse) one of :meth:`work_units`' shards. By default :meth:`train_set` on
        that client's upload alone, which is its part of the whole set when shards are per
        client and keyed; a method whose shards depend on other clients' uploads overrides
        both."""
        one = {unit.client_id: uploads[unit.client_id]}
        return self.train_set(one, server, shard_path).get(unit.client_id, [])

    def teacher(self, uploads: Mapping[str, Upload], server: ServerJob) -> Distillation | None:
        """Soft targets for the global classifier (a :data:`Teacher` and how its divergence
        joins the cross-entropy), or None for plain cross-entropy."""
        return None

    def final_models(
        self, uploads: Mapping[str, Upload], server: ServerJob
    ) -> dict[str, nn.Module] | None:
        """Models to score instead of one global classifier (Local: each client's own), or
        None: the server trains one classifier on :meth:`train_set`."""
        return None


class MultiRound(Registered, ABC):
    """A method trained over several rounds on one of Flower's strategies, not from one upload."""

    @abstractmethod
    def client_round(
        self, msg: Message, cfg: FedBiPConfig, node: NodeConfig, device: torch.device
    ) -> RecordDict:
        """A client's reply to one round's ``train`` message."""

    @abstractmethod
    def client_evaluate(self, msg: Message, cfg: FedBiPConfig, node: NodeConfig) -> RecordDict:
        """A client's reply to one round's ``evaluate`` message (its own held-out images)."""

    @abstractmethod
    def run_server(
        self,
        grid: Grid,
        cfg: FedBiPConfig,
        folder: RunFolder,
        evaluate: Callable[[nn.Module], Accuracy],
    ) -> RunResults:
        """Every round, the final model saved in ``folder`` and scored by ``evaluate`` (the
        server's test sets; empty where it holds none); returns the run's results, also
        written to metrics.json."""


def _no_model() -> LDM:
    raise PayloadError("auditing an upload on its own loads no model")


AnyMethod = Method | MultiRound
_REGISTRY: dict[str, type[AnyMethod]] = {}
T = TypeVar("T", bound=type[AnyMethod])


def register(cls: T) -> T:
    """Class decorator: make a method creatable by its ``name`` (the run config's ``method``),
    a name :data:`~fedbip_flwr.method_settings.METHOD_SETTINGS` lists with its settings."""
    if cls.name not in METHOD_SETTINGS:
        raise ValueError(f"method {cls.name!r} has no settings in method_settings.METHOD_SETTINGS")
    if not getattr(cls, "uploads", None):
        raise ValueError(f"method {cls.name!r} declares no upload kinds (its class's uploads)")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method {cls.name!r} is registered already, by {_REGISTRY[cls.name]}")
    _REGISTRY[cls.name] = cls
    return cls


def create(name: str, settings: MethodSettings | Mapping[str, Any] | None = None) -> AnyMethod:
    """The method registered under ``name`` (the run config's ``method``) with its own
    settings: a validated model, its table's kebab-case keys, or None for its defaults."""
    cls = _registered(name)
    model = METHOD_SETTINGS[name]
    if isinstance(settings, Mapping):
        settings = model.from_flat(settings)
    if settings is not None and not isinstance(settings, model):
        raise ValueError(f"method {name!r} takes {model.__name__}, got {type(settings).__name__}")
    return cls(settings)


def upload_kinds(name: str) -> frozenset[UploadKind]:
    """The kinds of what the method registered under ``name`` uploads."""
    return _registered(name).uploads


def _registered(name: str) -> type[AnyMethod]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown method {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


def create_for(cfg: FedBiPConfig) -> AnyMethod:
    """The run's method with the run's settings of it."""
    return create(cfg.method, cfg.settings_of(cfg.method))


def create_one_shot(
    name: str, settings: MethodSettings | Mapping[str, Any] | None = None
) -> Method:
    """The one-shot method registered under ``name``; ValueError for a multi-round one, which
    makes no single upload."""
    method = create(name, settings)
    if not isinstance(method, Method):
        raise ValueError(f"method {name!r} trains over several rounds and makes no one upload")
    return method


def one_shot_for(cfg: FedBiPConfig) -> Method:
    """The run's one-shot method with the run's settings of it."""
    return create_one_shot(cfg.method, cfg.settings_of(cfg.method))


def names() -> list[str]:
    return sorted(_REGISTRY)


def encode_upload(meta: UploadMeta, tensors: Mapping[str, torch.Tensor]) -> bytes:
    """One upload's bytes: the tensors plus ``fedbip.*`` metadata, deterministic."""
    return _encode_tensors(tensors, meta_strings(meta))


def decode_upload(
    blob: bytes,
    meta_model: type[M],
    tensor_names: tuple[str, ...] | Callable[[dict[str, str]], tuple[str, ...]],
    max_bytes: int,
) -> Upload:
    """Size cap, header, exact tensor names and layout, finite floats, metadata schema."""
    tensors, metadata = _read_tensors(
        blob, tensor_names, max_bytes, meta_model.model_fields["method"].default
    )
    return Upload(meta=parse_meta(metadata, meta_model), tensors=tensors)


def common_meta(job: ClientJob) -> dict[str, Any]:
    """The :class:`UploadMeta` fields every method fills the same way."""
    return {
        "schema_version": SCHEMA_VERSION,
        "client_id": job.data.client_id,
        "domain": job.data.domain,
        "class_names": list(job.data.classes),
        "num_examples": len(job.data.labels),
    }


def check_tensor(
    upload: Upload, name: str, dtype: torch.dtype, shape: tuple[int, ...], why: str = ""
) -> torch.Tensor:
    """One of an upload's tensors with exactly this dtype and shape, or :class:`PayloadError`
    saying ``why`` (:func:`~fedbip_flwr.upload.check_dtype_shape`)."""
    return check_dtype_shape(name, upload.tensors[name], dtype, shape, why)


def check_labels(upload: Upload, name: str = "labels") -> torch.Tensor:
    """(num_examples,) int64 labels within the class list."""
    labels = check_tensor(upload, name, torch.int64, (upload.meta.num_examples,))
    return check_index(name, labels, len(upload.meta.class_names), "one per class name")


def check_counts(upload: Upload, name: str = "class_counts") -> torch.Tensor:
    """(C,) int64 per-class counts of the upload's own classes, non-negative, summing to its
    num_examples: what counts are whatever the server (``fedbip inspect`` checks them alone)."""
    counts = check_tensor(upload, name, torch.int64, (len(upload.meta.class_names),))
    values = counts.tolist()  # Python ints: their sum cannot wrap around as int64's can
    if min(values, default=0) < 0:
        raise PayloadError(f"{name} {values} must be non-negative")
    if sum(values) != upload.meta.num_examples:
        raise PayloadError(f"{name} {values} must sum to num_examples {upload.meta.num_examples}")
    return counts


def check_class_counts(
    upload: Upload, server: ServerJob, name: str = "class_counts"
) -> torch.Tensor:
    """:func:`check_counts`, each and their sum within the server's run config
    federation.max-images-per-client (it synthesizes as many images as they claim)."""
    cap = server.cfg.federation.max_images_per_client
    counts = check_counts(upload, name)
    for class_name, count in zip(upload.meta.class_names, counts.tolist(), strict=True):
        check_image_count(count, cap, f"{name} of class {class_name!r}")
    check_image_count(upload.meta.num_examples, cap, f"{name} in all")
    return counts


def check_image_count(images: int, cap: int, what: str) -> None:
    """Refuse a claim of more private images than ``cap`` (run config
    federation.max-images-per-client): the server's synthesis grows with the claim, so an unbounded
    claim is unbounded work."""
    if images > cap:
        raise PayloadError(
            f"{what} claims {images} images, above run config "
            f"federation.max-images-per-client {cap} "
            "(raise it on the server if a client legitimately holds that many)"
        )


def check_class_rows(
    labels: torch.Tensor, class_names: Sequence[str], class_cap: int, per_image: int
) -> None:
    """Refuse z(T) of one class beyond ``class_cap`` (the run's resolved
    federation.max-images-per-class, :attr:`~fedbip_flwr.config.FedBiPConfig.class_cap`) x
    ``per_image`` (the method's latents-per-image): each row is synthesized from, so extra rows
    would buy their sender a larger share."""
    cap = class_cap * per_image
    rows = torch.bincount(labels.to(torch.int64), minlength=len(class_names)).tolist()
    for class_name, count in zip(class_names, rows, strict=True):
        if count > cap:
            raise PayloadError(
                f"{count} z(T) of class {class_name!r}, above {cap} (run config "
                f"federation.max-images-per-class {class_cap} x latents-per-image {per_image})"
            )


def class_counts(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(C,) int64: how many private images a client holds per class (what it may tell)."""
    return torch.bincount(labels.to(torch.int64), minlength=num_classes)


def fresh_noise_labels(
    counts: torch.Tensor, own: FreshNoiseSettings, class_cap: int
) -> torch.Tensor:
    """Labels of a client's sampled synthetic set, class by class: the method's
    images-per-class each, or its images-per-image x the client's count clipped to
    ``class_cap`` (the run's resolved federation.max-images-per-class): the server, not the
    claim, bounds what a client's set holds."""
    per_class = (
        torch.full_like(counts, own.images_per_class)
        if own.images_per_class
        else counts.clamp(max=class_cap) * own.images_per_image
    )
    return torch.repeat_interleave(torch.arange(len(counts)), per_class)


def fresh_noise_set(
    server: ServerJob,
    stream: str,
    cond_table: torch.Tensor,
    labels: torch.Tensor,
    path: Path,
    conditions: torch.Tensor | None = None,
) -> Path:
    """A training shard sampled from fresh noise toward row ``conditions[i]`` of
    ``cond_table`` (default: the label's row; :func:`fedbip_flwr.synthesis.iter_from_noise`);
    the noise is seeded by the server's seed and ``stream`` (a client id, or a client's pass),
    so every shard has noise of its own."""
    settings = SynthesisSettings.from_config(server.cfg)
    seed = client_seed(server.cfg.seed, stream)
    extra = () if conditions is None else (conditions,)
    key = shard_key((seed, *settings.sampling_knobs()), cond_table, labels, *extra)
    batches = functools.partial(
        iter_from_noise,
        server.ldm(),
        cond_table,
        labels,
        settings,
        torch.Generator().manual_seed(seed),
        conditions,
    )
    return keyed_shard(path, key, labels, batches, mode=server.shard_mode)


def mixture_set(
    server: ServerJob,
    stream: str,
    cond_table: torch.Tensor,
    labels: torch.Tensor,
    mixture: LatentMixture,
    timestep: int,
    path: Path,
    conditions: torch.Tensor | None = None,
    zigzag: ZSampling | None = None,
) -> Path:
    """A training shard denoised from z(T) drawn from a client's latent mixture (one per
    label, from its class's mixture) toward row ``conditions[i]`` of ``cond_table`` (default:
    the label's row), with Z-Sampling's zigzag when given; the draws are seeded by the
    server's seed and ``stream``, as :func:`fresh_noise_set`'s noise is."""
    settings = SynthesisSettings.from_config(server.cfg)
    seed = client_seed(server.cfg.seed, stream)
    extra = () if conditions is None else (conditions,)
    knobs = (seed, timestep, *settings.sampling_knobs(), *(zigzag.knobs() if zigzag else ()))
    key = shard_key(knobs, cond_table, labels, *mixture.to_tensors().values(), *extra)

    def batches() -> Iterator[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        start = functools.partial(draw, mixture, generator=generator)
        return iter_denoised(
            server.ldm(), cond_table, labels, settings, timestep, start, conditions, zigzag
        )

    return keyed_shard(path, key, labels, batches, mode=server.shard_mode)
