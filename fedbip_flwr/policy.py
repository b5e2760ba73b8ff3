"""What an institution lets leave it: the upload policy of its own node config.

The server's run config picks the method, and so what every institution uploads. An
institution answers with its node config (``--node-config``, which the server never sees):
which kinds of upload it allows, whether it requires a differential-privacy guarantee and how
strong, and caps on the images an upload may stand for and on its bytes. Its ClientApp checks
the run's request against that policy before it reads an image or loads a model
(:func:`fedbip_flwr.client_run.upload_reply`), and refuses with a reply the server records as
``refused by the institution's policy: <reason>``; the run goes on with the others.

Every method declares the kinds its upload holds (``uploads`` on its class in
:mod:`fedbip_flwr.methods`); this module is only the vocabulary and the checks, and imports
nothing of the project, so the config and the methods can both use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class UploadKind(StrEnum):
    """What an upload holds, as an institution decides what may leave it."""

    IMAGES = "images"  # the private images themselves (Central)
    LATENTS = "latents"  # one or more latents per private image (FedBiP's z(T))
    STATISTICS = "statistics"  # per-class Gaussian mixtures of latents or features
    CONCEPTS = "concepts"  # conditioning learned on the images (S and V, Espresso's conditions)
    TEXT = "text"  # encodings of the images' captions (OSCAR)
    CLASSIFIER = "classifier"  # a model trained on the images (FedLMG, Local, FedAvg)
    COUNTS = "counts"  # how many images of each class it holds (labels or class counts)


ALL_KINDS = "all"  # node config allow-uploads: every kind, stated explicitly
REFUSAL_PREFIX = "refused by the institution's policy: "


def parse_kinds(text: str) -> frozenset[UploadKind]:
    """Node config allow-uploads: ``all`` or comma-separated kinds; ValueError naming a
    word that is not one."""
    words = [word.strip() for word in text.split(",") if word.strip()]
    if words == [ALL_KINDS]:
        return frozenset(UploadKind)
    known = ", ".join(kind.value for kind in UploadKind)
    if not words:
        raise ValueError(f"name '{ALL_KINDS}' or at least one upload kind ({known})")
    unknown = [word for word in words if word not in {kind.value for kind in UploadKind}]
    if unknown:
        raise ValueError(f"'{unknown[0]}' is no upload kind; kinds: {known} (or '{ALL_KINDS}')")
    return frozenset(UploadKind(word) for word in words)


@dataclass(frozen=True)
class Guarantee:
    """An (epsilon, delta)-DP guarantee per private image."""

    epsilon: float
    delta: float

    def __str__(self) -> str:
        return f"({self.epsilon:g}, {self.delta:g})-DP per image"


@dataclass(frozen=True)
class UploadRequest:
    """What the run asks this institution to upload, known from the run config alone."""

    method: str
    kinds: frozenset[UploadKind]
    guarantee: Guarantee | None  # the method's settings': None where the upload has none
    replayable_noise: bool  # the server can replay this institution's noise: no DP holds


class PolicyRefusal(Exception):
    """The run's request breaks the institution's policy. ``reason`` goes to the server;
    ``detail``, which may name this institution's counts, stays in its own log."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason, self.detail = reason, detail or reason
        super().__init__(REFUSAL_PREFIX + reason)


@dataclass(frozen=True)
class UploadPolicy:
    """An institution's floor: the kinds it allows, the guarantee it requires (if any), and
    caps on the images and bytes an upload may take (0: no cap)."""

    kinds: frozenset[UploadKind]
    require_dp: bool
    max_epsilon: float
    max_delta: float
    max_images: int = 0
    max_bytes: int = 0

    def check_request(self, request: UploadRequest) -> None:
        """Before anything is read or loaded: the kinds, then the guarantee."""
        if denied := sorted(request.kinds - self.kinds):
            raise PolicyRefusal(
                f"the run's method {request.method} uploads {', '.join(denied)}, which this "
                f"institution does not allow (node config allow-uploads)"
            )
        if self.require_dp:
            self._check_guarantee(request)

    def _check_guarantee(self, request: UploadRequest) -> None:
        ceiling = f"epsilon <= {self.max_epsilon:g}, delta <= {self.max_delta:g} per image"
        given = request.guarantee
        if given is None:
            raise PolicyRefusal(
                f"the run's method {request.method} uploads without a DP guarantee; this "
                f"institution requires one of {ceiling} (node config require-dp)"
            )
        if request.replayable_noise:
            raise PolicyRefusal(
                f"the run's {given} is void: run config federation.replayable-client-noise lets "
                "the server replay this institution's noise (set seed in its node config to keep "
                "it here)"
            )
        if given.epsilon > self.max_epsilon or given.delta > self.max_delta:
            raise PolicyRefusal(
                f"the run's upload is {given}, weaker than this institution's {ceiling} "
                "(node config max-dp-epsilon, max-dp-delta)"
            )

    def check_before_compute(self, images: int, floor: Callable[[], int]) -> None:
        """Once the images are counted, before the model loads: the image cap, and the byte
        cap against ``floor``, the fewest bytes the upload can take (asked only under a cap)."""
        if self.max_images and images > self.max_images:
            raise PolicyRefusal(
                "the upload would stand for more private images than this institution's node "
                "config max-upload-images allows (counted in its own log)",
                f"the upload would stand for {images} private images, above node config "
                f"max-upload-images {self.max_images}",
            )
        if self.max_bytes:
            self.check_size(floor(), at_least=True)

    def check_size(self, size: int, *, at_least: bool = False) -> None:
        """The upload's bytes (or, ``at_least``, a lower bound on them) within the byte cap."""
        if self.max_bytes and size > self.max_bytes:
            what = "would take at least" if at_least else "takes"
            raise PolicyRefusal(
                "the upload is larger than this institution's node config max-upload-mb allows "
                "(sized in its own log)",
                f"the upload {what} {size} bytes, above node config max-upload-mb "
                f"({self.max_bytes} bytes)",
            )
