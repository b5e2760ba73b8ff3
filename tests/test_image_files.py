"""An institution's folder as real folders are: hidden entries, every image mode, bad files.

Each image mode is checked against the 8-bit RGB original it was made from, through the same
decoding the client uses (:func:`fedbip_flwr.images.open_rgb`, behind every file pool). Bad
files are found when the folder is indexed, before any model loads.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from PIL import Image

from client_app import app as client_app
from fedbip_flwr import shapes
from fedbip_flwr.config import FedBiPConfig, NodeConfig
from fedbip_flwr.folders import own_folder_split
from fedbip_flwr.images import BACKGROUND, PROGRESS_FROM, open_rgb, why_unreadable
from fedbip_flwr.methods import institution_upload
from fedbip_flwr.partitions import DataError
from fedbip_flwr.report import write_report
from fedbip_tools.cli import project_run_config

CLASSES = list(shapes.CLASSES)
SIZE = 32


@pytest.fixture()
def own_folder(tmp_path: Path) -> Path:
    return shapes.write_image_folder(tmp_path / "inst", "sketch", 3, 2, size=SIZE)


@pytest.fixture(scope="module")
def original() -> np.ndarray:
    """An 8-bit RGB image with structure in every channel and dark and light areas."""
    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 4, y * 5, (x + y) * 2], axis=-1) % 256
    return rgb.astype(np.uint8)


def decoded(tmp_path: Path, image: Image.Image, name: str, **save: object) -> np.ndarray:
    path = tmp_path / name
    image.save(path, **save)
    assert why_unreadable(path) is None  # the index-time check passes what decodes
    return np.asarray(open_rgb(path)).astype(np.int16)


def mean_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


# --- 1. hidden entries -----------------------------------------------------------------------


def test_hidden_folders_and_files_are_not_data(own_folder: Path) -> None:
    train = own_folder / "train"
    (train / ".ipynb_checkpoints").mkdir()
    (train / ".ipynb_checkpoints" / "0000-checkpoint.png").write_bytes(b"")
    (train / "circle" / ".ipynb_checkpoints").mkdir()
    (train / "circle" / ".ipynb_checkpoints" / "0000-checkpoint.png").write_bytes(b"")
    (train / "circle" / "._0000.png").write_bytes(b"\x00\x05\x16\x07")  # macOS AppleDouble
    (train / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    split = own_folder_split(own_folder, CLASSES)
    assert len(split.train) == 3 * len(CLASSES) and split.skipped == ()


# --- 2. every mode reaches the model with the right pixels ----------------------------------


def test_sixteen_bit_grayscale_is_scaled_not_clipped(tmp_path: Path, original) -> None:
    gray = np.asarray(Image.fromarray(original).convert("L"))
    wide = Image.fromarray(gray.astype(np.uint16) * 257)  # the same picture over 0..65535
    assert wide.mode == "I;16"
    for suffix in (".png", ".tif"):
        got = decoded(tmp_path, wide, "wide" + suffix)
        assert np.array_equal(got, np.repeat(gray[..., None], 3, -1)), suffix


def test_exif_orientation_is_applied(tmp_path: Path, original) -> None:
    """A phone stores a portrait sideways and says so in EXIF tag 0x0112 (6: rotate 90 CW)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    sideways = Image.fromarray(original).transpose(Image.Transpose.ROTATE_90)
    got = decoded(tmp_path, sideways, "phone.jpg", exif=exif, quality=95)
    assert (
        decoded(tmp_path, Image.fromarray(original).convert("CMYK"), "cmyk.jpg").shape == got.shape
    )
    assert got.shape == original.shape
    assert mean_error(got, original) < 3  # JPEG's own error; unrotated it would not even fit


def test_alpha_is_composited_on_the_stated_background(tmp_path: Path, original) -> None:
    alpha = np.zeros(original.shape[:2], np.uint8)
    alpha[:, 32:] = 255  # left half transparent, holding colours no viewer shows
    rgba = Image.fromarray(np.dstack([original, alpha]), "RGBA")
    want = original.copy()
    want[:, :32] = BACKGROUND
    assert np.array_equal(decoded(tmp_path, rgba, "rgba.png"), want)
    gray = np.asarray(Image.fromarray(original).convert("L"))
    la = Image.fromarray(np.dstack([gray, alpha]), "LA")
    want_la = np.repeat(np.where(alpha > 0, gray, BACKGROUND[0])[..., None], 3, -1)
    assert np.array_equal(decoded(tmp_path, la, "la.png"), want_la)


def test_palette_with_transparency_and_cmyk_and_gray_and_upper_case(
    tmp_path: Path, original
) -> None:
    palette = Image.fromarray(original).quantize(64)
    opaque = np.asarray(palette.convert("RGB"))
    assert np.array_equal(decoded(tmp_path, palette, "palette.png"), opaque)
    index = int(np.asarray(palette)[0, 0])  # this colour becomes transparent
    want = np.where((np.asarray(palette) == index)[..., None], np.array(BACKGROUND), opaque)
    assert np.array_equal(decoded(tmp_path, palette, "clear.png", transparency=index), want)
    assert (
        mean_error(
            decoded(tmp_path, Image.fromarray(original).convert("CMYK"), "cmyk.tif"), original
        )
        < 1
    )
    gray = np.asarray(Image.fromarray(original).convert("L"))
    assert np.array_equal(decoded(tmp_path, Image.fromarray(gray), "gray.png")[..., 0], gray)
    assert np.array_equal(decoded(tmp_path, Image.fromarray(original), "UPPER.PNG"), original)


def test_the_folder_pool_decodes_through_the_same_path(own_folder: Path, original) -> None:
    """What a client takes from its folder is what open_rgb gives: a 16-bit file in a class
    folder reaches the model scaled."""
    gray = np.asarray(Image.fromarray(original).convert("L").resize((SIZE, SIZE)))
    folder = own_folder / "train" / "circle"
    for old in folder.iterdir():
        old.unlink()
    Image.fromarray(gray.astype(np.uint16) * 257).save(folder / "scan.png")
    pool = own_folder_split(own_folder, CLASSES).train
    taken = pool.take([int(np.flatnonzero(pool.labels == 0)[0])], SIZE)
    pixels = ((taken[0, 0] + 1) * 127.5).round().numpy()
    assert mean_error(pixels, gray) < 1


# --- 3. unreadable files are found when the folder is indexed -------------------------------


def plant_bad_files(root: Path) -> list[str]:
    """A zero-byte PNG, a truncated JPEG and a text file named .png, as a folder gets them."""
    train = root / "train"
    (train / "circle" / "empty.png").write_bytes(b"")
    jpeg = io.BytesIO()
    Image.new("RGB", (256, 256), (200, 30, 30)).save(jpeg, "JPEG")
    (train / "square" / "cut.jpg").write_bytes(jpeg.getvalue()[: len(jpeg.getvalue()) // 2])
    (root / "test" / "star" / "notes.png").write_text("not an image\n")
    return ["train/circle/empty.png", "train/square/cut.jpg", "test/star/notes.png"]


def test_every_unreadable_file_is_named_in_one_message(own_folder: Path) -> None:
    bad = plant_bad_files(own_folder)
    with pytest.raises(DataError) as info:
        own_folder_split(own_folder, CLASSES)
    message = str(info.value)
    assert message.startswith(f"3 of {3 * 6 + 2 * 6 + 3} image files in {own_folder}")
    assert all(name in message for name in bad), message
    assert "empty file" in message and "damaged or truncated" in message
    assert "not an image" in message
    assert 'bad-images = "skip"' in message


def test_skip_leaves_them_out_lists_them_once_and_counts_them(own_folder: Path, caplog) -> None:
    bad = plant_bad_files(own_folder)
    with caplog.at_level(logging.WARNING, logger="fedbip_flwr"):
        split = own_folder_split(own_folder, CLASSES, "skip")
    assert [str(b.path.relative_to(own_folder)) for b in split.skipped] == sorted(bad[:2]) + bad[2:]
    assert (len(split.train), len(split.test)) == (3 * 6, 2 * 6)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and all(name in warnings[0] for name in bad)
    split.train.take(np.arange(len(split.train)), SIZE)  # every kept file decodes


def test_the_upload_fails_before_any_model_loads_or_counts_what_it_skipped(
    own_folder: Path,
) -> None:
    """Through the ClientApp's own entry: fail never reaches the model; skip reports the count
    in the metrics the reply carries (prompts-only: the upload needs no model at all)."""
    plant_bad_files(own_folder)
    cfg = FedBiPConfig.from_flat(
        {
            "method": "prompts-only",
            "data.dataset": "imagefolder",
            "data.classes": ",".join(CLASSES),
            "data.root": str(own_folder),
            "data.image-size": SIZE,
        }
    )

    def no_model():
        raise AssertionError("the model was loaded before the folder was checked")

    node = NodeConfig(domain="sketch", client_id="inst", data_root=str(own_folder))
    with pytest.raises(DataError, match="3 of"):
        institution_upload(cfg, node, no_model)
    skip = node.model_copy(update={"bad_images": "skip"})
    _, metrics = institution_upload(cfg, skip, no_model)
    assert metrics["unreadable-files-skipped"] == 3 and metrics["num-examples"] == 3 * 6


def test_an_institution_above_the_image_cap_fails_before_any_model_loads(own_folder: Path) -> None:
    """The cap the server holds every upload to (federation.max-images-per-client) is known to the
    client too: it stops before its work instead of uploading what the server would refuse."""
    cfg = FedBiPConfig.from_flat(
        {
            "method": "fedbip",
            "data.dataset": "imagefolder",
            "data.classes": ",".join(CLASSES),
            "data.root": str(own_folder),
            "data.image-size": SIZE,
            "federation.max-images-per-client": 3 * 6 - 1,
        }
    )

    def no_model():
        raise AssertionError("the model was loaded before the image count was checked")

    node = NodeConfig(domain="sketch", client_id="inst", data_root=str(own_folder))
    with pytest.raises(
        DataError,
        match="inst holds more private images than the run's federation.max-images-per-client 17",
    ) as info:
        institution_upload(cfg, node, no_model)
    assert "18" not in str(info.value)  # the refusal reaches the server: its count stays in the log


def test_a_dp_upload_sends_its_epsilon_and_nothing_its_guarantee_hides(
    own_folder: Path, tiny_ldm
) -> None:
    """Beside a DP upload the reply carries no exact image count, skipped-file count or timing:
    each would tell the server what the noisy counts inside the upload hide."""
    values = {
        "method": "fedld",
        "data.dataset": "imagefolder",
        "data.classes": ",".join(CLASSES),
        "data.root": str(own_folder),
        "data.image-size": SIZE,
    }
    node = NodeConfig(domain="sketch", client_id="inst", data_root=str(own_folder))
    plain = institution_upload(FedBiPConfig.from_flat(values), node, lambda: tiny_ldm)[1]
    assert plain["num-examples"] == 3 * 6 and "seconds-total" in plain
    private = FedBiPConfig.from_flat({**values, "fedld.dp-epsilon": 4.0})
    _, metrics = institution_upload(private, node, lambda: tiny_ldm)
    assert set(metrics) == {"dp-epsilon"} and 0 < metrics["dp-epsilon"] <= 4.0


def test_report_counts_the_files_each_institution_left_out(tmp_path: Path) -> None:
    clients = [
        {
            "node_id": 1,
            "client_id": "a",
            "domain": "sketch",
            "status": "accepted",
            "payload_bytes": 10,
            "metrics": {"num-examples": 18, "unreadable-files-skipped": 2},
        },
        {
            "node_id": 2,
            "client_id": "b",
            "domain": "painting",
            "status": "accepted",
            "payload_bytes": 10,
            "metrics": {"num-examples": 20, "unreadable-files-skipped": 0},
        },
    ]
    metrics = {
        "status": "failed",
        "reason": "stopped after the round",
        "config": {},
        "clients": clients,
    }
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in write_report(tmp_path).read_text().splitlines()
        if line.startswith("|")
    ]
    assert rows[0][:5] == ["client", "domain", "status", "images", "unreadable files left out"]
    assert rows[2][:5] == ["a", "sketch", "accepted", "18", "2"]


@pytest.mark.parametrize("kind", ["float", "int32"])
def test_images_without_an_eight_bit_meaning_are_unreadable(tmp_path: Path, kind: str) -> None:
    values = np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8)
    image = (
        Image.fromarray(values)
        if kind == "float"
        else Image.fromarray((values * 2**20).astype(np.int32))
    )
    image.save(tmp_path / "x.tif")
    assert "8-bit" in (why_unreadable(tmp_path / "x.tif") or "")


def test_a_large_folder_reports_its_check_as_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "big" / "circle"
    folder.mkdir(parents=True)
    for i in range(PROGRESS_FROM):
        Image.new("L", (4, 4), i % 256).save(folder / f"{i:04d}.png")
    with caplog.at_level(logging.INFO, logger="fedbip_flwr"):
        own_folder_split(tmp_path / "big", CLASSES)
    closing = [r.getMessage() for r in caplog.records if "checking images in" in r.getMessage()]
    assert closing and f"{PROGRESS_FROM} files in" in closing[-1], caplog.text


def test_an_error_reply_to_the_server_neither_counts_nor_names_the_bad_files(
    own_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ClientApp's own train step on a folder with bad files: the exception that becomes
    Flower's error reply says neither how many (a count is what a DP upload hides) nor which
    (a file name can be a patient's id)."""
    for field in ("_task_id", "_run_id", "_node_id"):  # what a SuperNode's runtime sets
        monkeypatch.setattr(TaskIdentity, field, 1)
    bad = plant_bad_files(own_folder)
    run = {
        **project_run_config(),
        "method": "prompts-only",
        "data.dataset": "imagefolder",
        "data.classes": ",".join(CLASSES),
        "data.image-size": SIZE,
    }
    # an institution that lets counts leave without a DP guarantee (prompts-only's upload)
    node = {
        "data-root": str(own_folder),
        "domain": "sketch",
        "client-id": "inst",
        "require-dp": False,
    }
    context = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config=run)
    message = Message(
        content=RecordDict({"config": ConfigRecord({})}),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )
    with pytest.raises(DataError) as info:
        client_app.train(message, context)
    reason = str(info.value)
    assert reason.startswith("image files of this institution cannot be read"), reason
    assert not any(str(n) in reason for n in (3, 33)), reason
    assert not [name for name in bad if Path(name).name in reason] and str(own_folder) not in reason
