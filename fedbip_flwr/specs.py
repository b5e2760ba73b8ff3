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
from typing import Any

from . import shapes

FEATURE = "domain"  # one domain per client, k shots per class
LABEL = ("dirichlet", "iid")  # one domain, labels split over the clients
FEW_SHOT_TEMPLATE = "A {S} of {V}."  # Table 5: "A [STY] of [CLS]."
OWN_FOLDER = "imagefolder"  # each institution's own folder; classes from the run config


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
    layout: str = "folders"  # generated | folders (domain/class/image) | medmnist | imagefolder
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
    "airplane",
    "clock",
    "axe",
    "basketball",
    "bicycle",
    "bird",
    "strawberry",
    "flower",
    "pizza",
    "bracelet",
)
DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
OFFICEHOME_FOLDERS = (
    "Marker",
    "Spoon",
    "Pencil",
    "Speaker",
    "Toys",
    "Fan",
    "Hammer",
    "Notebook",
    "Telephone",
    "Sink",
    "Chair",
    "Fork",
    "Kettle",
    "Bucket",
    "Knives",
    "Monitor",
    "Mop",
    "Oven",
    "Pen",
    "Couch",
)
# MedMNIST label order 0..6; names as in Table 5.
DERMAMNIST_CLASSES = (
    "intraepithelial carcinoma",
    "basal cell carcinoma",
    "benign keratosis",
    "dermatofibroma",
    "melanoma",
    "melanocytic nevi",
    "vascular skin",
)
# (prompt words, UC Merced folder), in Table 5's order.
UCM_CLASSES = (
    ("agricultural", "agricultural"),
    ("dense residential", "denseresidential"),
    ("medium residential", "mediumresidential"),
    ("sparse residential", "sparseresidential"),
    ("parking lot", "parkinglot"),
    ("buildings", "buildings"),
    ("harbor", "harbor"),
    ("mobile home park", "mobilehomepark"),
    ("storage tanks", "storagetanks"),
    ("freeway", "freeway"),
    ("intersection", "intersection"),
    ("overpass", "overpass"),
    ("golf course", "golfcourse"),
    ("baseball diamond", "baseballdiamond"),
    ("runway", "runway"),
    ("tennis court", "tenniscourt"),
    ("beach", "beach"),
    ("forest", "forest"),
    ("river", "river"),
    ("chaparral", "chaparral"),
    ("airplane", "airplane"),
)


def _few_shot(
    name: str, classes: tuple[str, ...], domains: tuple[str, ...], **layout: Any
) -> DatasetSpec:
    """DomainNet, PACS, OfficeHome: Table 5's "A [STY] of [CLS].", n_s = n_v = 1, all domains."""
    return DatasetSpec(
        name=name,
        classes=classes,
        domains=domains,
        default_domains=domains,
        prompt_template=FEW_SHOT_TEMPLATE,
        n_s=1,
        n_v=1,
        partitionings=(FEATURE,),
        **layout,
    )


def _label_skew(
    name: str,
    classes: tuple[str, ...],
    domain: str,
    template: str,
    n_s: int,
    n_v: int,
    **layout: Any,
) -> DatasetSpec:
    """DermaMNIST, UCM: one domain, named by the template's highlighted words (Table 5)."""
    return DatasetSpec(
        name=name,
        classes=classes,
        domains=(domain,),
        default_domains=(domain,),
        prompt_template=template,
        n_s=n_s,
        n_v=n_v,
        partitionings=LABEL,
        **layout,
    )


SPECS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            name="shapes",
            classes=shapes.CLASSES,
            domains=shapes.DOMAINS,
            default_domains=("sketch", "quickdraw", "painting"),
            prompt_template=shapes.CAPTION_TEMPLATE,
            n_s=1,
            n_v=1,
            partitionings=(FEATURE,),
            layout="generated",
        ),
        _few_shot(
            "domainnet", DOMAINNET_CLASSES, DOMAINNET_DOMAINS, split_lists="{domain}_{split}.txt"
        ),
        _few_shot(
            "pacs",
            ("dog", "elephant", "giraffe", "guitar", "horse", "house", "person"),
            ("art", "cartoon", "photo", "sketch"),
            domain_folders=(("art_painting",), ("cartoon",), ("photo",), ("sketch",)),
        ),
        _few_shot(
            "officehome",
            tuple(f.lower() for f in OFFICEHOME_FOLDERS),
            ("art", "clipart", "product", "real"),
            class_folders=OFFICEHOME_FOLDERS,
            domain_folders=(("Art",), ("Clipart",), ("Product",), ("Real World", "Real_World")),
        ),
        DatasetSpec(
            name=OWN_FOLDER,
            classes=(),  # the run config's data.classes
            domains=(),  # each institution's node config names its own
            default_domains=(),
            prompt_template="a {S} of a {V}",
            n_s=1,
            n_v=1,
            partitionings=(FEATURE,),
            layout=OWN_FOLDER,
        ),
        _label_skew(
            "dermamnist",
            DERMAMNIST_CLASSES,
            "dermatoscopic image",
            "A {S} of a {V}, a type of pigmented skin lesions.",
            n_s=2,
            n_v=4,
            layout="medmnist",
        ),
        _label_skew(
            "ucm",
            tuple(words for words, _ in UCM_CLASSES),
            "centered satellite photo",
            "A {S} of {V}.",
            n_s=3,
            n_v=3,
            class_folders=tuple(folder for _, folder in UCM_CLASSES),
            domain_folders=(("Images", "."),),  # data.root is UCMerced_LandUse or its Images
        ),
    )
}
