"""A DP upload's guarantee holds for the institution's folder, and nothing around it gives back
what it hides: the held-out split, the evaluation reply, non-finite rows; and DP-SGD is the
mechanism the accountant is told about (Poisson batches, noise, a constant divisor).

Each test fails on a version without the property: a class permutation for the split, counts
in a DP evaluation reply, a NaN row summed, fixed batches, no noise, the batch's own size as
the divisor.
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from PIL import Image
from safetensors.torch import save as safetensors_bytes

from client_app import app as client_app
from fedbip_flwr import shapes
from fedbip_flwr.classifier import build_classifier
from fedbip_flwr.concepts import DPSGD, _private_epoch
from fedbip_flwr.dp import gaussian_guarantee, noisy_estimate
from fedbip_flwr.folders import TEST_FRACTION, own_folder_split
from fedbip_flwr.results import Scored, Unscored, institutions_mean
from fedbip_flwr.strategy import ScoreBounds, _scores
from fedbip_flwr.wire import RUN_FOLDER, blob_record, evaluate_content, reply_metrics
from fedbip_tools.cli import project_run_config

CLASSES = list(shapes.CLASSES)
SIZE = 16


def _pixels(pool) -> set[bytes]:
    return {np.asarray(pool.read(i)).tobytes() for i in range(len(pool))}


@pytest.fixture()
def folder_without_test(tmp_path: Path) -> Path:
    root = shapes.write_image_folder(tmp_path / "inst", "sketch", 20, 1, size=SIZE)
    shutil.rmtree(root / "test")
    return root


# --- the held-out split --------------------------------------------------------------------------


def test_adding_a_file_moves_no_other_file_between_train_and_test(
    folder_without_test: Path,
) -> None:
    """Under add/remove one image, the split of every other image must not change: a DP
    guarantee per image of the folder needs it (a permutation of the class moves several)."""
    before = own_folder_split(folder_without_test, CLASSES)
    extra = shapes.render("circle", "sketch", np.random.default_rng(99), SIZE)
    Image.fromarray(extra).save(folder_without_test / "train" / "circle" / "extra.png")
    after = own_folder_split(folder_without_test, CLASSES)
    new = {
        np.asarray(
            Image.open(folder_without_test / "train" / "circle" / "extra.png").convert("RGB")
        ).tobytes()
    }
    assert _pixels(after.test) - new == _pixels(before.test)
    assert _pixels(after.train) - new == _pixels(before.train)


def test_about_a_fifth_of_the_files_are_held_out(folder_without_test: Path) -> None:
    split = own_folder_split(folder_without_test, CLASSES)
    n = len(split.train) + len(split.test)
    # Binomial(120, 0.2): mean 24, sd 4.4; this band fails with probability below 1e-5
    assert (
        abs(len(split.test) - TEST_FRACTION * n)
        < 5 * (n * TEST_FRACTION * (1 - TEST_FRACTION)) ** 0.5
    )


# --- the evaluation reply ------------------------------------------------------------------------


def _evaluate_reply(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: dict
) -> Message:
    """The ClientApp's own evaluate step on a random classifier sent as the server sends it."""
    for field in ("_task_id", "_run_id", "_node_id"):  # what a SuperNode's runtime sets
        monkeypatch.setattr(TaskIdentity, field, 1)
    config = {
        **project_run_config(),
        "data.dataset": "imagefolder",
        "data.classes": ",".join(CLASSES),
        "data.image-size": SIZE,
        "classifier.image-size": 32,
        **run,
    }
    node = {
        "data-root": str(folder),
        "domain": "sketch",
        "client-id": "inst",
        "output-dir": str(tmp_path / "out"),
    }
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config=config)
    classifier = safetensors_bytes(dict(build_classifier(len(CLASSES), "random").state_dict()))
    content = evaluate_content(blob_record(classifier), ConfigRecord({RUN_FOLDER: "run-1"}))
    message = Message(content=content, dst_node_id=1, message_type=MessageType.EVALUATE)
    return client_app.evaluate(message, context)


def test_a_dp_institution_replies_its_accuracy_alone(
    folder_without_test: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its held-out counts per class are round(0.2 n_c) of the class counts the release adds
    noise to; a full-precision accuracy names its denominator. The server takes the reply."""
    reply = _evaluate_reply(
        folder_without_test, tmp_path, monkeypatch, {"method": "fedld", "fedld.dp-epsilon": 4.0}
    )
    sent = reply_metrics(reply)
    assert set(sent) == {"accuracy"} and round(sent["accuracy"], 2) == sent["accuracy"]
    score = _scores(reply, ScoreBounds(classes=len(CLASSES), max_examples=1000, private=True))
    assert isinstance(score, Scored) and not score.counted
    refused = _scores(reply, ScoreBounds(classes=len(CLASSES), max_examples=1000))  # not a DP run
    assert isinstance(refused, Unscored) and "no counts" in refused.reason


def test_a_plain_institution_still_replies_its_counts(
    folder_without_test: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reply = _evaluate_reply(folder_without_test, tmp_path, monkeypatch, {"method": "fedld"})
    assert set(reply_metrics(reply)) == {
        "accuracy",
        "num-examples",
        "per-class-correct",
        "per-class-total",
    }


def test_the_mean_of_scores_without_counts_is_unweighted() -> None:
    counted = Scored(
        accuracy=0.5, num_examples=30, per_class_correct=[15, 0], per_class_total=[15, 15]
    )
    assert institutions_mean({"a": counted, "b": Scored(accuracy=0.91)}) == pytest.approx(0.705)
    assert institutions_mean({"a": counted, "b": counted}) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="together or not at all"):
        Scored(accuracy=0.5, num_examples=30)


# --- the release -------------------------------------------------------------------------------


def test_a_non_finite_row_is_left_out_before_clipping() -> None:
    """One NaN latent would make its class's noisy sum NaN, and the upload a refusal that says
    something about that one image; left out, the release is the one without that image."""
    rows = torch.randn(10, 4, 2, 2)
    bad = torch.cat([rows[:3], torch.full((1, 4, 2, 2), float("nan")), rows[3:]])
    guarantee = gaussian_guarantee(clip=2.0, epsilon=4.0, delta=1e-5)
    with_bad = noisy_estimate(bad, guarantee, torch.Generator().manual_seed(0))
    without = noisy_estimate(rows, guarantee, torch.Generator().manual_seed(0))
    assert with_bad.sum_rows.isfinite().all() and with_bad.sum_squares is not None
    torch.testing.assert_close(with_bad.sum_rows, without.sum_rows)
    torch.testing.assert_close(with_bad.sum_squares, without.sum_squares)
    assert with_bad.count == pytest.approx(without.count)


# --- DP-SGD as the accountant sees it ------------------------------------------------------------


def _epoch(loss, n: int, privacy: DPSGD, batch_size: int, seed: int = 0) -> torch.Tensor:
    """One epoch of :func:`_private_epoch` on a 4000-wide shift u from 0 with SGD at lr 1;
    returns u afterwards."""
    shift = torch.zeros(4000, requires_grad=True)
    optimizer = torch.optim.SGD([shift], lr=1.0)
    _private_epoch(
        optimizer,
        loss,
        [torch.zeros(4000)],
        [shift],
        torch.Size([n, 1]),
        10,
        1.0,
        batch_size,
        privacy,
        torch.Generator().manual_seed(seed),
        1.0,
    )
    return shift.detach()


def test_dp_sgd_batches_are_poisson_samples() -> None:
    """Every step takes each image with probability q, so batch sizes vary as Binomial(n, q);
    fixed batches (variance 0) are not the mechanism the accountant composes."""
    sizes: list[int] = []

    def loss(shifts, batch, t, noise):
        sizes.append(len(batch))
        return (shifts[0] * 0).sum()

    privacy = DPSGD(sample_rate=0.1, steps_per_epoch=60, noise_multiplier=1.0, clip=1.0)
    _epoch(loss, 200, privacy, batch_size=1000)  # one chunk per step: one call per non-empty batch
    assert len(sizes) >= 55 and 15 < statistics.fmean(sizes) < 25
    assert statistics.variance(sizes) > 6  # Binomial(200, 0.1): 18


def test_dp_sgd_adds_noise_of_sigma_times_clip() -> None:
    """With every image's gradient 0, one step moves u by the noise alone: std sigma C / B."""
    privacy = DPSGD(sample_rate=0.1, steps_per_epoch=1, noise_multiplier=2.0, clip=0.5)
    moved = _epoch(
        lambda shifts, batch, t, noise: (shifts[0] * 0).sum(), 100, privacy, batch_size=10
    )
    assert moved.std().item() == pytest.approx(2.0 * 0.5 / 10, rel=0.1)


def test_dp_sgd_divides_by_the_expected_batch_not_the_drawn_one() -> None:
    """The sum's sensitivity is C only over a constant divisor; dividing by the drawn batch's
    size would make the step depend on how many images were drawn in a way the accounting
    does not cover. Each image's gradient here is e_0 (norm 1 < C), no noise: u_0 = -|b| / B."""
    drawn: list[int] = []

    def loss(shifts, batch, t, noise):
        drawn.append(len(batch))
        return shifts[0][:, 0].mean()  # the batch's mean loss; each image's gradient is e_0

    privacy = DPSGD(sample_rate=0.3, steps_per_epoch=1, noise_multiplier=0.0, clip=2.0)
    moved = _epoch(loss, 50, privacy, batch_size=15, seed=3)
    assert sum(drawn) != 15  # (taken in chunks of B)
    assert moved[0].item() == pytest.approx(-sum(drawn) / 15) and moved[1:].abs().max() == 0
