"""The paper's datasets from their usual on-disk layouts, indexed without decoding any pixel.

Layouts (``docs/datasets.md`` has the trees):

* ``folders``: ``<data.root>/<domain folder>/<class folder>/<image>`` (DomainNet, PACS,
  OfficeHome, UC Merced). Class folders are matched by exact name, so ``birdhouse`` never
  stands in for ``bird`` nor ``Pencil`` for ``Pen``. DomainNet's official
  ``<domain>_train.txt`` / ``<domain>_test.txt`` lists are used when they sit in data.root;
  otherwise :data:`TEST_FRACTION` of every class is held out with a fixed seed, so the test
  split is the same for every run seed.
* ``imagefolder``: an institution's own ``<data-root>/[train|test/]<class>/<image>``, in
  torchvision's ImageFolder convention, labelled by the run config's class list. Every file is
  decoded once when the folder is indexed (:func:`fedbip_flwr.images.find_unreadable`), so an
  unreadable one is named before any model loads; node config ``bad-images`` says whether that
  fails the institution's job or leaves the file out.
* ``medmnist``: MedMNIST ``.npz`` files (``train_images``, ``train_labels``, ``test_*``) of any
  size; the smallest one at least ``data.image-size`` wide is used, else the largest.

Hidden entries (names starting with ``.``: ``.ipynb_checkpoints/``, ``.DS_Store``, macOS's
``._`` files) are never data, at any depth. Indexing the paper's datasets only lists files or
reads label arrays, so a missing folder, class or file fails in seconds with one sentence; pixels
are read (:func:`fedbip_flwr.images.open_rgb`) when a client or the server takes its images.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .config import BadImagePolicy
from .images import BadImage, find_unreadable, image_files, is_hidden, open_rgb
from .partitions import DataError, holdout
from .specs import DatasetSpec

log = logging.getLogger(__name__)

TEST_FRACTION = 0.2  # held out per class where a dataset ships no official test split
SPLIT_SEED = 0  # fixed: the test split must not move with the run seed
HOLDOUT_KEY = b"fedbip-flwr held-out split"  # an institution's own folder: held_out_by_content
MEDMNIST_SIZES = (28, 64, 128, 224)
SPLITS = ("train", "test")
LAYOUT_HELP = "see docs/datasets.md for the expected layout"


@functools.cache
def image_suffixes() -> frozenset[str]:
    """torchvision's ImageFolder convention."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    return frozenset(IMG_EXTENSIONS)


@dataclass(frozen=True)
class Pool:
    """Labelled images of one split of one domain; ``read(i)`` decodes image i on demand."""

    labels: np.ndarray  # (N,) int64 indexing the spec's classes
    read: Callable[[int], Image.Image]

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: np.ndarray) -> Pool:
        return Pool(self.labels[indices], lambda i: self.read(int(indices[i])))

    def take(self, indices: Sequence[int] | np.ndarray, size: int) -> torch.Tensor:
        """Images ``indices`` as ``(n, 3, size, size)`` float32 in [-1, 1] (squashed to square)."""
        pixels = np.empty((len(indices), size, size, 3), dtype=np.uint8)
        for j, i in enumerate(indices):
            image = self.read(int(i)).convert("RGB")
            pixels[j] = np.asarray(image.resize((size, size), Image.Resampling.BICUBIC))
        return (
            torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0).contiguous()
        )


@dataclass(frozen=True)
class Split:
    """A domain's training pool (what clients draw from) and its test pool (what the server
    scores); ``skipped``: unreadable files left out under ``bad-images = "skip"``."""

    train: Pool
    test: Pool
    skipped: tuple[BadImage, ...] = ()


def _file_pool(paths: Sequence[Path], labels: Sequence[int]) -> Pool:
    files = tuple(paths)
    return Pool(np.asarray(labels, dtype=np.int64), lambda i: open_rgb(files[i]))


def _domain_dir(spec: DatasetSpec, root: Path, domain: str) -> Path:
    for name in spec.folders_of(domain):
        if (root / name).is_dir():
            return root / name
    wanted = " or ".join(f"'{n}'" for n in spec.folders_of(domain))
    raise DataError(f"{spec.name} domain '{domain}' needs folder {wanted} in {root}; {LAYOUT_HELP}")


def _class_folder_pool(spec: DatasetSpec, domain_dir: Path) -> Pool:
    """Every image under the spec's class folders, found by exact name."""
    present = {p.name for p in domain_dir.iterdir() if p.is_dir() and not is_hidden(p.name)}
    paths: list[Path] = []
    labels: list[int] = []
    for label, folder in enumerate(spec.folder_of_class()):
        if folder not in present:
            raise DataError(
                f"{spec.name}: class folder '{folder}' is missing in {domain_dir} "
                f"(class folders must match exactly); {LAYOUT_HELP}"
            )
        files = image_files(domain_dir / folder, image_suffixes())
        if not files:
            raise DataError(f"{spec.name}: class folder {domain_dir / folder} holds no images")
        paths += files
        labels += [label] * len(files)
    return _file_pool(paths, labels)


def _listed_pool(spec: DatasetSpec, root: Path, listing: Path) -> Pool:
    """The spec's classes from an official split file of ``<path> <label>`` lines."""
    label_of = {folder: label for label, folder in enumerate(spec.folder_of_class())}
    paths: list[Path] = []
    labels: list[int] = []
    for line in listing.read_text().splitlines():
        relative = line.split()[0] if line.strip() else ""
        label = label_of.get(Path(relative).parent.name) if relative else None
        if label is not None:
            paths.append(root / relative)
            labels.append(label)
    found = set(labels)
    missing = [name for label, name in enumerate(spec.classes) if label not in found]
    if missing:
        raise DataError(f"{listing} lists no image of class '{missing[0]}'; {LAYOUT_HELP}")
    absent = next((p for p in paths if not p.is_file()), None)
    if absent is not None:
        raise DataError(f"{absent}, listed in {listing}, does not exist; {LAYOUT_HELP}")
    return _file_pool(paths, labels)


def _folder_split(spec: DatasetSpec, root: Path, domain: str) -> Split:
    domain_dir = _domain_dir(spec, root, domain)
    lists = [root / spec.split_lists.format(domain=domain, split=s) for s in SPLITS]
    if spec.split_lists and all(p.is_file() for p in lists):
        log.info(
            "%s %s: official split from %s", spec.name, domain, ", ".join(p.name for p in lists)
        )
        return Split(*(_listed_pool(spec, root, p) for p in lists))
    pool = _class_folder_pool(spec, domain_dir)
    train, test = holdout(pool.labels, TEST_FRACTION, (SPLIT_SEED,))
    return Split(pool.subset(train), pool.subset(test))


def medmnist_file(spec: DatasetSpec, root: Path, image_size: int) -> Path:
    """``root`` itself if it is a file, else the best-sized ``<name>[_<size>].npz`` inside it."""
    if root.is_file():
        return root
    sized = [
        (s, root / (f"{spec.name}.npz" if s == 28 else f"{spec.name}_{s}.npz"))
        for s in MEDMNIST_SIZES
    ]
    present = [(s, p) for s, p in sized if p.is_file()]
    if not present:
        raise DataError(
            f"no {spec.name}.npz or {spec.name}_{{64,128,224}}.npz in {root}; "
            f"download {spec.name} from MedMNIST and point data.root at it"
        )
    return next((p for s, p in present if s >= image_size), present[-1][1])


def _array_pool(spec: DatasetSpec, path: Path, npz: np.lib.npyio.NpzFile, split: str) -> Pool:
    labels = npz[f"{split}_labels"].reshape(-1).astype(np.int64)
    if len(labels) and not 0 <= labels.min() <= labels.max() < len(spec.classes):
        raise DataError(
            f"{path} has labels outside 0..{len(spec.classes) - 1}: not a {spec.name} file"
        )
    images = functools.cache(lambda: npz[f"{split}_images"])  # decompressed on first read only
    return Pool(labels, lambda i: Image.fromarray(images()[i]))


def _medmnist_split(spec: DatasetSpec, root: Path, image_size: int) -> Split:
    path = medmnist_file(spec, root, image_size)
    npz = np.load(path)
    missing = sorted({f"{s}_{k}" for s in SPLITS for k in ("images", "labels")} - set(npz.files))
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}: not a MedMNIST file")
    return Split(*(_array_pool(spec, path, npz, s) for s in SPLITS))


def open_split(spec: DatasetSpec, root: Path, domain: str, image_size: int) -> Split:
    """Index ``domain`` of an on-disk dataset; raise :class:`DataError` if anything is missing."""
    if not root.exists():
        raise DataError(
            f"{spec.name} data.root {root} does not exist; download the dataset and set data.root "
            f"to its folder ({LAYOUT_HELP})"
        )
    if spec.layout == "medmnist":
        split = _medmnist_split(spec, root, image_size)
    else:
        split = _folder_split(spec, root, domain)
    log.info(
        "%s %s: %d training and %d test images",
        spec.name,
        domain,
        len(split.train),
        len(split.test),
    )
    return split


def _own_class_files(folder: Path, classes: Sequence[str]) -> tuple[list[Path], list[int]]:
    """``<folder>/<class>/<image>`` (torchvision's ImageFolder convention), labelled by the run's
    class order, class folders in name order. A folder the run does not know is an error; a run
    class with no folder is the institution's legal label skew, logged."""
    present = sorted(p.name for p in folder.iterdir() if p.is_dir() and not is_hidden(p.name))
    unknown = [name for name in present if name not in classes]
    if unknown:
        raise DataError(
            f"class folder '{unknown[0]}' in {folder} is not one of the run's classes "
            f"({', '.join(classes)}); rename or remove it (hidden folders, named '.*', are "
            "ignored)"
        )
    lacking = [name for name in classes if name not in present]
    if lacking:
        log.warning(
            "%s has no images of %s: label skew, which FedBiP allows; the upload has none of them",
            folder,
            ", ".join(lacking),
        )
    paths: list[Path] = []
    labels: list[int] = []
    for name in present:
        files = image_files(folder / name, image_suffixes())
        paths += files
        labels += [classes.index(name)] * len(files)
    if not paths:
        raise DataError(f"{folder} holds no images in class folders; {LAYOUT_HELP}")
    return paths, labels


def _listing(root: Path, bad: Sequence[BadImage]) -> str:
    return "; ".join(f"{b.path.relative_to(root)}: {b.reason}" for b in bad)


class UnreadableImages(DataError):
    """Files of an institution's folder that do not decode. ``str()`` names and counts every
    one, for the institution's own eyes; :meth:`for_server` neither names nor counts them: file
    names (a patient's id, a date) must not leave the institution in an error reply, and counts
    are what a DP upload's guarantee hides."""

    FIX = (
        'Fix or remove them, or leave them out with node config bad-images = "skip" '
        "(fedbip personalize --bad-images skip)"
    )

    def __init__(self, root: Path, bad: Sequence[BadImage], total: int) -> None:
        self.count, self.total = len(bad), total
        super().__init__(
            f"{len(bad)} of {total} image files in {root} cannot be read: "
            f"{_listing(root, bad)}. {self.FIX}"
        )

    def for_server(self) -> DataError:
        return DataError(
            f"image files of this institution cannot be read (named and counted in its own log). {self.FIX}"
        )


def _readable(
    root: Path, parts: list[tuple[list[Path], list[int]]], bad_images: BadImagePolicy
) -> tuple[list[tuple[list[Path], list[int]]], tuple[BadImage, ...]]:
    """``parts`` without their unreadable files, or :class:`DataError` naming every one of them
    (``bad_images = "fail"``). Each file is decoded once, here, before any model loads."""
    bad = find_unreadable([path for paths, _ in parts for path in paths], root)
    if not bad:
        return parts, ()
    total = sum(len(paths) for paths, _ in parts)
    if bad_images == "fail":
        raise UnreadableImages(root, bad, total)
    log.warning(
        "left out %d of %d image files in %s that cannot be read (node config "
        'bad-images = "skip"): %s',
        len(bad),
        total,
        root,
        _listing(root, bad),
    )
    unreadable = {b.path for b in bad}
    kept = [
        (
            [p for p in paths if p not in unreadable],
            [y for p, y in zip(paths, labels) if p not in unreadable],
        )
        for paths, labels in parts
    ]
    if any(not paths for paths, _ in kept):
        raise DataError(f"no readable image is left in {root} (or in one of its splits)")
    return kept, tuple(bad)


def own_folder_split(
    root: Path, classes: Sequence[str], bad_images: BadImagePolicy = "fail"
) -> Split:
    """An institution's own folder: ``<root>/train/`` and ``<root>/test/`` above the class
    folders, or the class folders directly in ``root`` (or in ``train/`` alone); without a
    ``test/`` folder, each file is held out with probability :data:`TEST_FRACTION` by a hash of
    its content (:func:`held_out_by_content`). Unreadable files fail the split or are left out,
    as ``bad_images`` says."""
    if not root.is_dir():
        raise DataError(f"data-root {root} is not a folder; {LAYOUT_HELP}")
    if (root / "test").is_dir():
        if not (root / "train").is_dir():
            raise DataError(f"{root} has a test/ folder but no train/ folder; {LAYOUT_HELP}")
        parts = [_own_class_files(root / s, classes) for s in SPLITS]
        (train, test), skipped = _readable(root, parts, bad_images)
        return Split(_file_pool(*train), _file_pool(*test), skipped)
    folder = root / "train" if (root / "train").is_dir() else root
    [(paths, labels)], skipped = _readable(root, [_own_class_files(folder, classes)], bad_images)
    pool = _file_pool(paths, labels)
    held = np.array([held_out_by_content(path) for path in paths], dtype=bool)
    log.info(
        "%s has no test/ folder: each file held out with probability %.0f%% by a hash of its "
        "content (%d of %d)",
        root,
        100 * TEST_FRACTION,
        held.sum(),
        len(held),
    )
    return Split(pool.subset(np.flatnonzero(~held)), pool.subset(np.flatnonzero(held)), skipped)


def held_out_by_content(path: Path, fraction: float = TEST_FRACTION) -> bool:
    """Whether an institution's file is a test image: a keyed hash of its bytes below
    ``fraction``. Each file's side depends on that file alone, so adding or removing one moves
    no other file between train and test (a permutation of the class would move several), which
    is what a DP upload's guarantee per image of the folder needs; the same bytes under another
    name stay on the same side, so a copy never straddles the split. The key is public: it only
    separates this hash's uses from any other."""
    digest = hashlib.blake2b(path.read_bytes(), digest_size=8, key=HOLDOUT_KEY).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64
