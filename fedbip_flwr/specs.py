"""What each dataset is: classes, domains, prompt template and concept sizes (paper Table 5).

Pure data, kept apart from the loaders so :mod:`fedbip_flwr.config` can validate a run config
(dataset, domains, partitioning) and fill the dataset's prompt defaults without importing them.

A domain's name is also the phrase that initialises the domain concept S (the highlighted
[STY] words of Table 5), because the client hands one string to both: the payload's domain and
the words S starts from. For the label-heterogeneity datasets there is one domain, named by
their template's highlighted words ("dermatoscopic image", "centered satellite photo").
"""

from __future__ import annotations

from dataclasses import dataclass

from . import shapes

FEATURE = "domain"  # one domain per client, k shots per class
LABEL = ("dirichlet", "iid")  # one domain, labels split over the clients
FEW_SHOT_TEMPLATE = "A {S} of {V}."  # Table 5: "A [STY] of [CLS]."


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset as the paper uses it; ``classes`` are prompt words, in label order."""

    name: str
    classes: tuple[str, ...]
    domains: tuple[str, ...]
    default_domains: tuple[str, ...]
    prompt_template: str
    n_s: int
    n_v: int
    partitionings: tuple[str, ...]
    layout: str = "folders"  # generated (shapes) | folders (domain/class/image) | medmnist (.npz)
    split_lists: str = ""  # official split files, e.g. "{domain}_{split}.txt"; "" = hold out
    class_folders: tuple[str, ...] = ()  # on-disk folder of each class; () = same as classes
    domain_folders: tuple[tuple[str, ...], ...] = ()  # accepted folder names per domain

    def folder_of_class(self) -> tuple[str, ...]:
        return self.class_folders or self.classes

    def folders_of(self, domain: str) -> tuple[str, ...]:
        """Folder names that hold ``domain`` (several where distributions spell it differently)."""
        if not self.domain_folders:
            return (domain,)
        return self.domain_folders[self.domains.index(domain)]


DOMAINNET_CLASSES = (
    "airplane", "clock", "axe", "basketball", "bicycle",
    "bird", "strawberry", "flower", "pizza", "bracelet",
)  # fmt: skip
DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
OFFICEHOME_FOLDERS = (
    "Marker", "Spoon", "Pencil", "Speaker", "Toys", "Fan", "Hammer", "Notebook", "Telephone",
    "Sink", "Chair", "Fork", "Kettle", "Bucket", "Knives", "Monitor", "Mop", "Oven", "Pen", "Couch",
)  # fmt: skip
# MedMNIST label order 0..6; names as in Table 5.
DERMAMNIST_CLASSES = (
    "intraepithelial carcinoma", "basal cell carcinoma", "benign keratosis", "dermatofibroma",
    "melanoma", "melanocytic nevi", "vascular skin",
)  # fmt: skip
# (prompt words, UC Merced folder), in Table 5's order.
UCM_CLASSES = (
    ("agricultural", "agricultural"), ("dense residential", "denseresidential"),
    ("medium residential", "mediumresidential"), ("sparse residential", "sparseresidential"),
    ("parking lot", "parkinglot"), ("buildings", "buildings"), ("harbor", "harbor"),
    ("mobile home park", "mobilehomepark"), ("storage tanks", "storagetanks"),
    ("freeway", "freeway"), ("intersection", "intersection"), ("overpass", "overpass"),
    ("golf course", "golfcourse"), ("baseball diamond", "baseballdiamond"), ("runway", "runway"),
    ("tennis court", "tenniscourt"), ("beach", "beach"), ("forest", "forest"), ("river", "river"),
    ("chaparral", "chaparral"), ("airplane", "airplane"),
)  # fmt: skip

SPECS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            name="shapes",
            classes=shapes.CLASSES,
            domains=shapes.DOMAINS,
            default_domains=("sketch", "quickdraw", "painting"),
            prompt_template="a {S} style of a {V}",
            n_s=1,
            n_v=1,
            partitionings=(FEATURE,),
            layout="generated",
        ),
        DatasetSpec(
            name="domainnet",
            classes=DOMAINNET_CLASSES,
            domains=DOMAINNET_DOMAINS,
            default_domains=DOMAINNET_DOMAINS,
            prompt_template=FEW_SHOT_TEMPLATE,
            n_s=1,
            n_v=1,
            partitionings=(FEATURE,),
            split_lists="{domain}_{split}.txt",
        ),
        DatasetSpec(
            name="pacs",
            classes=("dog", "elephant", "giraffe", "guitar", "horse", "house", "person"),
            domains=("art", "cartoon", "photo", "sketch"),
            default_domains=("art", "cartoon", "photo", "sketch"),
            prompt_template=FEW_SHOT_TEMPLATE,
            n_s=1,
            n_v=1,
            partitionings=(FEATURE,),
            domain_folders=(("art_painting",), ("cartoon",), ("photo",), ("sketch",)),
        ),
        DatasetSpec(
            name="officehome",
            classes=tuple(f.lower() for f in OFFICEHOME_FOLDERS),
            domains=("art", "clipart", "product", "real"),
            default_domains=("art", "clipart", "product", "real"),
            prompt_template=FEW_SHOT_TEMPLATE,
            n_s=1,
            n_v=1,
            partitionings=(FEATURE,),
            class_folders=OFFICEHOME_FOLDERS,
            domain_folders=(("Art",), ("Clipart",), ("Product",), ("Real World", "Real_World")),
        ),
        DatasetSpec(
            name="dermamnist",
            classes=DERMAMNIST_CLASSES,
            domains=("dermatoscopic image",),
            default_domains=("dermatoscopic image",),
            prompt_template="A {S} of a {V}, a type of pigmented skin lesions.",
            n_s=2,
            n_v=4,
            partitionings=LABEL,
            layout="medmnist",
        ),
        DatasetSpec(
            name="ucm",
            classes=tuple(words for words, _ in UCM_CLASSES),
            domains=("centered satellite photo",),
            default_domains=("centered satellite photo",),
            prompt_template="A {S} of {V}.",
            n_s=3,
            n_v=3,
            partitionings=LABEL,
            class_folders=tuple(folder for _, folder in UCM_CLASSES),
            domain_folders=(("Images", "."),),  # data-root is UCMerced_LandUse or its Images
        ),
    )
}
