"""A run's results (``metrics.json``): one typed record, written by the server and validated by
every reader, so each key is spelled in one place and a malformed file fails where it is read.

The record's own keys are snake_case. Two parts keep the names they arrived with, being data
rather than the record's vocabulary: ``config``, the flat run config under its run-config keys
(what :meth:`fedbip_flwr.config.FedBiPConfig.from_flat` reads back), and each client's
``metrics``, the Flower MetricRecord keys the client sent. A part the run never reached (a
failed run's accuracy, a multi-round run's clients) is left out of the file rather than
written as null. ``clients.json``, the round's outcome on its own, holds the same client
records.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from .storage import write_json

FILE_NAME = "metrics.json"
MAX_PROBLEMS = 3  # validation problems quoted in an error; the rest are counted

RunStatus = Literal["completed", "failed"]
UploadStatus = Literal["accepted", "kept", "rejected", "refused", "failed", "missing"]
ConfigValue = bool | int | float | str  # what a Flower run-config value can be
WireMetric = int | float | list[int] | list[float]  # what a Flower MetricRecord value can be
T = TypeVar("T")

# What a client sends beside its upload and an institution's scores of the classifier: Flower
# MetricRecord keys, kebab-case on the wire, kept as sent in a client's ``metrics``
SENT_IMAGES = "num-examples"
SENT_SECONDS = "seconds-total"
SENT_SKIPPED = "unreadable-files-skipped"
SENT_BYTES = "payload-bytes"
SENT_CONCEPT_LOSSES = "concept-losses"
SENT_ACCURACY = "accuracy"
SENT_CORRECT, SENT_TOTAL = "per-class-correct", "per-class-total"
PRIVATE_ACCURACY_DIGITS = 2  # what a DP institution's accuracy is rounded to


class ResultsError(ValueError):
    """A file that does not hold what it should; the message names the file and the keys."""


class _Part(BaseModel):
    """A part of the record: an unknown key is an error at read (a misspelling would
    otherwise read as a section the run never wrote)."""

    model_config = ConfigDict(extra="forbid")


class ClientOutcome(_Part):
    """What happened to one client's upload in the one round."""

    node_id: int
    # kept: uploaded before a restart, not asked again; refused: by the institution's own
    # upload policy (fedbip_flwr.policy), before it computed anything
    status: UploadStatus
    reason: str = ""
    client_id: str = ""
    domain: str = ""
    payload_bytes: int = 0
    metrics: dict[str, WireMetric] | None = None  # as sent; None where no reply was read


class DomainAccuracy(_Part):
    """One classifier scored on the server's test sets."""

    per_domain: dict[str, float]
    mean: float


class Accuracy(_Part):
    """The server's side of the scores; every part is there only where the run produced it."""

    per_domain: dict[str, float] | None = None  # where the server holds test sets
    mean: float | None = None
    num_synthetic_images: int | None = None  # where one global classifier was trained
    classifier_seconds: float | None = None
    models: list[str] | None = None  # where the method leaves several models (one per client)
    per_model: dict[str, DomainAccuracy] | None = None  # several models, server-scored


class ClassifierCurves(_Part):
    """The global classifier's training, per epoch."""

    epoch_loss: list[float]


# |accuracy - correct / total| of an honest score: the client's float32 mean of 0/1 values is
# exact below 2^24 images but for its division's rounding, 2^-24 relative
ACCURACY_ROUNDING = 1e-6


class Scored(_Part):
    """An institution's scores of the classifier on its own held-out images, consistent with
    themselves: per-class counts with 0 <= correct <= total, totals summing to num_examples and
    accuracy their ratio (an evaluate reply is untrusted; one that is not is refused). An
    institution whose upload is differentially private sends its accuracy alone, to two decimals
    (:data:`PRIVATE_ACCURACY_DIGITS`): its held-out counts would give back the class counts its
    release adds noise to."""

    status: Literal["ok"] = "ok"
    accuracy: float = Field(ge=0.0, le=1.0)
    num_examples: int | None = Field(None, ge=1)
    per_class_correct: list[Annotated[int, Field(ge=0)]] | None = None
    per_class_total: list[Annotated[int, Field(ge=0)]] | None = None

    @property
    def counted(self) -> bool:
        """Whether the scores carry their counts (every institution but a DP one)."""
        return self.num_examples is not None

    @model_validator(mode="after")
    def _consistent(self) -> Scored:
        correct, total = self.per_class_correct, self.per_class_total
        if (self.num_examples, correct, total).count(None) not in (0, 3):
            raise ValueError(
                "the test-image count and the per-class counts come together or not at all"
            )
        if correct is None or total is None or self.num_examples is None:
            return self
        if len(correct) != len(total):
            raise ValueError(f"{len(correct)} per-class correct counts for {len(total)} classes")
        if any(c > t for c, t in zip(correct, total, strict=True)):
            raise ValueError("a class has more correct answers than images")
        if sum(total) != self.num_examples:
            raise ValueError(
                f"per-class totals sum to {sum(total)}, not num-examples {self.num_examples}"
            )
        if abs(self.accuracy - sum(correct) / self.num_examples) > ACCURACY_ROUNDING:
            raise ValueError(
                f"accuracy {self.accuracy:.6g} is not its counts' {sum(correct)}/{self.num_examples}"
            )
        return self


# Scored's fields -> the keys an institution's evaluate reply holds them under
SCORE_KEYS = {
    "accuracy": SENT_ACCURACY,
    "num_examples": SENT_IMAGES,
    "per_class_correct": SENT_CORRECT,
    "per_class_total": SENT_TOTAL,
}


class Unscored(_Part):
    """An institution that did not score the classifier, and why."""

    status: Literal["failed"] = "failed"
    reason: str


InstitutionScore = Annotated[Scored | Unscored, Field(discriminator="status")]


class Evaluation(_Part):
    """The classifier scored by the institutions that uploaded."""

    where: Literal["clients", "both"]  # the run config's ``federation.evaluation``
    per_client: dict[str, InstitutionScore]  # empty where a strategy reports only the mean
    # the institutions' mean, each weighing one (:func:`institutions_mean`); the key keeps the
    # name records have always had
    weighted_mean: float
    round: int | None = None  # a multi-round method: the round whose model they scored

    @classmethod
    def of(cls, where: str, per_client: Mapping[str, Scored | Unscored]) -> Evaluation:
        """Per-institution scores and their mean, each institution weighing one."""
        mean = institutions_mean(per_client)
        return cls(where=where, per_client=dict(per_client), weighted_mean=mean)


class Seconds(_Part):
    """Seconds per server phase. The fields are in the order the phases run, each starting
    where the one before ended; the model loads on first use, inside the round, whose own
    seconds leave it out."""

    load_model: float | None = None
    round: float | None = None
    synthesis: float | None = None
    classifier: float | None = None
    evaluation: float | None = None
    rounds: float | None = None  # a multi-round method: all its rounds, as one phase

    def phases(self) -> dict[str, float]:
        """The phases that ran, in the order they ran."""
        return self.model_dump(exclude_none=True)


class RunResults(_Part):
    """Everything a run leaves in ``metrics.json``."""

    status: RunStatus
    reason: str | None = None  # why a failed run stopped
    config: dict[str, ConfigValue]  # the flat run config, under its run-config keys
    started_unix: float | None = None  # when ``seconds`` begin: samplers place phases by it
    clients: list[ClientOutcome] | None = None  # the one round's outcomes (one-shot methods)
    accuracy: Accuracy | None = None
    classifier: ClassifierCurves | None = None
    evaluation: Evaluation | None = None
    seconds: Seconds | None = None

    def headline(self) -> str:
        """One line of results: server-side per domain, the institutions' own, or both."""
        parts = []
        if self.accuracy is not None and self.accuracy.per_domain is not None:
            domains = ", ".join(f"{d} {100 * a:.1f}%" for d, a in self.accuracy.per_domain.items())
            parts.append(f"accuracy {domains} (mean {100 * self.accuracy.mean:.1f}%)")
        if self.evaluation is not None:
            scored = ", ".join(
                f"{c} {100 * s.accuracy:.1f}%" if isinstance(s, Scored) else f"{c} failed"
                for c, s in sorted(self.evaluation.per_client.items())
            )
            mean = self.evaluation.weighted_mean
            parts.append(f"institutions' own scores {scored} (mean {100 * mean:.1f}%)")
        return "; ".join(parts)


FIDELITY_FILE = "fidelity.json"


class JudgedImages(_Part):
    """One client's synthetic images as judges trained on real images of every domain see them."""

    class_fidelity: float = Field(ge=0.0, le=1.0)  # share judged as the class they were made for
    domain_fidelity: float = Field(ge=0.0, le=1.0)  # share judged as the client's domain
    images: int = Field(ge=0)


class Fidelity(_Part):
    """``fidelity.json``: whether the synthetic set is in each client's domain, which accuracy
    alone does not say (``fedbip report RUN_DIR --judges``; judges exist for the shapes world)."""

    judges: str  # where the judges' weights are
    per_domain: dict[str, JudgedImages]


def read_fidelity(run_dir: str | Path) -> Fidelity | None:
    """The run folder's judged fidelity, validated; None where it was never judged."""
    path = Path(run_dir) / FIDELITY_FILE
    return _validated(path, Fidelity.model_validate) if path.exists() else None


def institutions_mean(per_client: Mapping[str, Scored | Unscored]) -> float:
    """Mean accuracy over the institutions that scored the classifier, each weighing one.

    Not weighted by test images: an institution's count of its held-out images is its own
    claim, which the server cannot check (a self-consistent 100,000 of 100,000 correct passes
    every check a reply can be held to), so weighting by it would let one institution outweigh
    all the others. The server knows only that each institution took part: an inflated reply
    moves this mean by at most 1 / (institutions that scored)."""
    scored = [s for s in per_client.values() if isinstance(s, Scored)]
    if not scored:
        return math.nan
    return math.fsum(s.accuracy for s in scored) / len(scored)


def write(results: RunResults, target: str | Path) -> Path:
    """``results`` written atomically to ``target``: a run folder, or a ``.json`` path."""
    return write_json(_file(target), results.model_dump(exclude_none=True))


def read(target: str | Path) -> RunResults:
    """The results in ``target`` (a run folder, or a ``.json`` path), validated.

    Raises ``OSError`` when the file cannot be read and :class:`ResultsError` (a ValueError)
    naming the file when it holds anything but a run's results.
    """
    return _validated(_file(target), RunResults.model_validate)


_OUTCOMES = TypeAdapter(list[ClientOutcome])


def write_clients(outcomes: Iterable[ClientOutcome], path: str | Path) -> Path:
    """The round's outcomes (``clients.json``), as ``metrics.json`` holds them."""
    return write_json(path, [outcome.model_dump(exclude_none=True) for outcome in outcomes])


def read_clients(path: str | Path) -> list[ClientOutcome]:
    """The round's outcomes from ``clients.json``, validated like :func:`read`."""
    return _validated(Path(path), _OUTCOMES.validate_python)


def _file(target: str | Path) -> Path:
    path = Path(target)
    return path if path.suffix == ".json" else path / FILE_NAME


def _validated(path: Path, validate: Callable[[Any], T]) -> T:
    text = path.read_text()
    try:
        return validate(json.loads(text))
    except json.JSONDecodeError as err:
        raise ResultsError(f"{path} is not JSON: {err}") from None
    except ValidationError as err:
        raise ResultsError(f"{path} does not hold a run's results: {_problems(err)}") from None


def _problems(err: ValidationError) -> str:
    """The first few problems on one line, each with where in the file it is."""
    problems = [
        f"{'.'.join(str(p) for p in e['loc']) or 'the whole file'}: {e['msg']}"
        for e in err.errors()
    ]
    more = len(problems) - MAX_PROBLEMS
    return "; ".join(problems[:MAX_PROBLEMS]) + (f" (and {more} more)" if more > 0 else "")
