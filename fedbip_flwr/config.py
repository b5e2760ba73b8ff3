"""One typed configuration for a FedBiP run, validated at the edge.

The run config is tables, as in Flower's baselines: four keys at the top level (``method``,
``seed``, ``output-dir``, ``run-name``), the shared settings in one table per part of the run
(:data:`TABLES`: ``data``, ``ldm``, ``synthesis``, ``classifier``, ``federation``), and each
method's own keys in a table named after it (``fedbip``: :mod:`fedbip_flwr.method_settings`).
Flower hands it over flat, every table's keys dotted (``classifier.lr``, ``fedbip.concept-lr``);
:meth:`FedBiPConfig.from_flat` turns it into this model and refuses unknown keys, keys in the
wrong place (a key of the flat layout before the tables among them: :data:`MOVED`) and bad
values with one readable message; :meth:`FedBiPConfig.from_recorded` reads a config an earlier
run recorded in an older layout. Defaults are the paper's (FedBiP, ICLR'25 submission, Sec. 5
and App. A) unless a comment says otherwise, except the base model and image sizes: the shipped
miniature LDM at 64 px (the paper: SD v1-4 at 512 px, which the conf/ files for a GPU set). The
dataset-dependent ones (prompt template, n_s, n_v, domains: Table 5; classes and where
evaluation happens) come from :data:`fedbip_flwr.specs.SPECS` when left empty / 0, and the model
holds the filled-in values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from .flat import ConfigError as ConfigError  # what from_flat raises; callers catch it from here
from .flat import FlatConfig, kebab, problems
from .method_settings import DEFAULT_METHOD, METHOD_SETTINGS, MethodSettings
from .policy import ALL_KINDS, UploadPolicy, parse_kinds
from .sampler import SchedulerName, TimestepSpacing
from .specs import FEATURE, OWN_FOLDER, SPECS, DatasetSpec

# node config bad-images: an unreadable image file fails the institution's job, or is left out
BadImagePolicy = Literal["fail", "skip"]

# The classifier's learning rate over training: lr throughout, or cosine-annealed to 0 step by step.
LearningRateSchedule = Literal["constant", "cosine"]

CONCEPT_SLOT_S = "{S}"
CONCEPT_SLOT_V = "{V}"
SD_V1_4 = "CompVis/stable-diffusion-v1-4"

DatasetName = Literal[
    "shapes", "domainnet", "pacs", "officehome", "dermamnist", "ucm", "imagefolder"
]
Partitioning = Literal["domain", "dirichlet", "iid"]
Evaluation = Literal["server", "clients", "both"]


def _split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _node_map(text: str) -> dict[str, int]:
    """'a=1, b=2' as {'a': 1, 'b': 2}; ValueError naming the pair that is not one."""
    pairs: dict[str, int] = {}
    for item in _split_list(text):
        client, _, node = (part.strip() for part in item.partition("="))
        if not client or not node.isdigit():
            raise ValueError(f"'{item}' is not a 'client-id=node-id' pair (node ids are integers)")
        if client in pairs:
            raise ValueError(f"client id '{client}' is listed twice")
        pairs[client] = int(node)
    return pairs


class DataDescription(BaseModel):
    """What to load, and nothing else: the data layer (:mod:`fedbip_flwr.dataset`) takes this,
    never a method's knobs. Built from a validated run config
    (:attr:`FedBiPConfig.data_description`)."""

    model_config = ConfigDict(frozen=True)

    dataset: DatasetName
    data_root: str
    classes: tuple[str, ...]  # label order
    domains: tuple[str, ...]
    partitioning: Partitioning
    dirichlet_beta: float
    shots_per_class: int
    test_per_class: int
    image_size: int
    seed: int


class DataConfig(FlatConfig):
    """Table ``data`` (keys ``data.KEY``): which images every client holds, at what size, and
    the dataset's prompt (Table 5) that concepts and plain prompts start from."""

    WHAT: ClassVar[str] = "data table"

    dataset: DatasetName = Field(
        "shapes",
        description="shapes is generated in memory; imagefolder is each institution's own "
        "<data.root>/[train|test/]<class>/<image> folder (node config); the others are the "
        "paper's datasets, read from data.root (docs/datasets.md).",
    )
    root: str = Field(
        "",
        description="Dataset folder (or MedMNIST .npz); unused by shapes. An institution sets "
        "its own in its node config (data-root).",
    )
    classes: str = Field(
        "",
        description="Comma-separated class names in label order, also the words each V_y "
        'starts from; required by imagefolder, "" = the dataset\'s.',
    )
    domains: str = Field(
        "",
        description="Comma-separated domains, each also the words S starts from; "
        '"" = the dataset\'s defaults (shapes: sketch,quickdraw,painting). Partition p gets '
        "domains[p % len(domains)].",
    )
    partitioning: Partitioning = Field(
        "domain",
        description="domain = one domain per client, k shots per class (feature heterogeneity); "
        "dirichlet / iid = labels split over num-partitions clients (DermaMNIST, UCM).",
    )
    dirichlet_beta: float = Field(0.5, gt=0.0, description="Dir(beta); smaller = more skewed.")
    shots_per_class: int = Field(16, ge=2, description="k real images per class per client.")
    test_per_class: int = Field(
        50, ge=1, description="shapes only: test images per class per domain."
    )
    image_size: int = Field(
        64, ge=8, description="Side of the images the LDM sees (paper: 512, SD v1-4's)."
    )
    prompt_template: str = Field(
        "",
        description='Must contain {S} (domain) and {V} (class); "" = the dataset\'s (Table 5; '
        'shapes: "a {S} of a {V}").',
    )
    n_s: int = Field(
        0,
        ge=1,
        le=8,
        description="Fewest vectors in S (one per token of the domain phrase if more); "
        "0 = the dataset's (Table 5).",
    )
    n_v: int = Field(
        0,
        ge=1,
        le=8,
        description="Fewest vectors per V_y (one per token of the class name if more); "
        "0 = the dataset's (Table 5).",
    )

    @model_validator(mode="before")
    @classmethod
    def _dataset_defaults(cls, data: Any) -> Any:
        """Fill unset (or sentinel) prompt-template, n-s, n-v, domains and classes from the
        dataset.

        Flower merges --run-config over pyproject's values, so pyproject holds sentinels: a
        concrete value there would silently give one dataset's prompt to every other one.
        """
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        spec = _spec_of(data.get("dataset", "shapes"))
        defaults = {
            "prompt_template": spec.prompt_template,
            "n_s": spec.n_s,
            "n_v": spec.n_v,
            "domains": ",".join(spec.default_domains),
            "classes": ",".join(spec.classes),
        }
        for field, value in defaults.items():
            key = field if field in data else kebab(field)
            if data.get(key) in (None, "", 0):
                data[key] = value
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> DataConfig:
        for slot in (CONCEPT_SLOT_S, CONCEPT_SLOT_V):
            if self.prompt_template.count(slot) != 1:
                raise ValueError(f"data.prompt-template must contain {slot} exactly once")
        spec = SPECS[self.dataset]
        if spec.layout == OWN_FOLDER:
            return self._check_own_folders()
        if self.class_list != list(spec.classes):
            raise ValueError(f"data.classes are fixed by dataset {self.dataset}: leave them empty")
        unknown = [d for d in self.domain_list if d not in spec.domains]
        if unknown or not self.domain_list:
            raise ValueError(
                f"data.domains must name {self.dataset} domains exactly; "
                f"got {self.domains!r}, valid: {', '.join(spec.domains)}"
            )
        if self.partitioning not in spec.partitionings:
            raise ValueError(
                f"data.partitioning '{self.partitioning}' does not apply to {self.dataset}; "
                f"use {' or '.join(spec.partitionings)}"
            )
        if spec.layout != "generated" and not self.root:
            raise ValueError(f"dataset {self.dataset} is read from disk: set data.root")
        return self

    def _check_own_folders(self) -> DataConfig:
        """imagefolder: the run names the classes; every institution brings its own domain."""
        if not self.class_list:
            raise ValueError(
                'dataset imagefolder needs data.classes = "name,name,..." (label order)'
            )
        if len(set(self.class_list)) != len(self.class_list):
            raise ValueError(f"data.classes must be unique; got {self.classes!r}")
        return self

    @property
    def domain_list(self) -> list[str]:
        return _split_list(self.domains)

    @property
    def class_list(self) -> list[str]:
        return _split_list(self.classes)

    @property
    def own_folders(self) -> bool:
        """Every institution brings its own folder (imagefolder): the server holds no image."""
        return SPECS[self.dataset].layout == OWN_FOLDER


def _spec_of(name: Any) -> DatasetSpec:
    """The dataset's spec; any spec's values for an unknown name, whose one error is then the
    dataset field's (the unfilled sentinels, n-s = 0, ..., would add errors of their own)."""
    return SPECS.get(name, SPECS["shapes"]) if isinstance(name, str) else SPECS["shapes"]


class LDMConfig(FlatConfig):
    """Table ``ldm`` (keys ``ldm.KEY``): the frozen base latent diffusion model and how it
    runs."""

    WHAT: ClassVar[str] = "ldm table"

    model: str = Field(
        "models/miniature-ldm",
        description="Hub id (e.g. CompVis/stable-diffusion-v1-4, the paper's: "
        "conf/sd-v1-4-gpu.toml) or a local diffusers folder.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the LDM runs; auto = CUDA where a GPU is visible."
    )
    half_precision: bool = Field(
        True,
        description="CUDA: the frozen LDM in fp16. CPU with bf16 instructions: sampling "
        "under bfloat16 autocast (weights and concept learning stay float32).",
    )
    channels_last: bool = Field(
        False,
        description="Server's UNet in channels-last memory format (measured in BENCHMARKS.md).",
    )
    compile_unet: bool = Field(
        False,
        description="torch.compile the server's UNet: pays a compile at start for faster "
        "steps; worth it for long syntheses (BENCHMARKS.md).",
    )
    vae_batch_size: int = Field(
        8,
        ge=1,
        description="Images per VAE call (client encode, server decode): the VAE's "
        "full-resolution activations are the memory peak at 512 px.",
    )


class SynthesisConfig(FlatConfig):
    """Table ``synthesis`` (keys ``synthesis.KEY``): the sampler clients and server share
    (clients noise z(T) to its first timestep) and who makes the training set (eq. 5)."""

    WHAT: ClassVar[str] = "synthesis table"

    scheduler: SchedulerName = Field(
        SchedulerName.PNDM,
        description="The sampler the server denoises with (diffusers' class, built from the "
        "model's noise schedule): pndm (the paper's), ddim, dpm-solver++, unipc. Clients noise "
        "z(T) to its first timestep, so clients and server must agree.",
    )
    num_inference_steps: int = Field(50, ge=1, description="Denoising steps (paper: 50).")
    timestep_spacing: TimestepSpacing = Field(
        "leading",
        description="Where the steps sit in 1..1000. leading (SD v1-x's, the paper's: T = 981 "
        "at 50 steps): T, the noise level of z(T), drops with fewer steps; trailing: T = 999 at "
        "every step count.",
    )
    guidance_scale: float = Field(
        7.5, ge=1.0, description="Classifier-free guidance; 1.0 disables it (authors' code: 7.5)."
    )
    batch_size: int = Field(32, ge=1, description="Images per denoising batch on the server.")
    start_timestep: int = Field(
        0,
        ge=0,
        description="T for z(T), the noise level every method that uploads z(T) or their "
        "statistics uses; 0 = the first timestep of the synthesis schedule (paper).",
    )
    where: Literal["server", "external"] = Field(
        "server",
        description="Who makes the training set after the round (one-shot methods): the "
        "ServerApp itself, or `fedbip synthesize RUN_DIR` in other processes (accelerate "
        "launch on many GPUs or machines over the run folder; docs/scale.md) while the "
        "ServerApp waits for every shard, then trains the classifier as usual.",
    )
    timeout_s: float = Field(
        86400.0,
        gt=0.0,
        description="where = external: how long the ServerApp waits for the shards before "
        "the run fails (a restart with the same run-name waits again; shards made are kept).",
    )


class ClassifierConfig(FlatConfig):
    """Table ``classifier`` (keys ``classifier.KEY``): the ResNet-18 trained on the synthetic
    set (eq. 6), and the recipe every client's own classifier shares (Local, FedLMG's guides,
    FedAvg's rounds)."""

    WHAT: ClassVar[str] = "classifier table"

    init: Literal["imagenet", "random", "pretrained"] = Field(
        "imagenet",
        description="The classifier's starting weights, each with a fresh head for the run's "
        "classes: imagenet = torchvision's ResNet-18 ImageNet weights (the paper's, from the torch "
        "hub cache), random, or pretrained = the ResNet-18 backbone shipped with the base model "
        "(<ldm.model>/classifier-backbone/model.safetensors: for the miniature LDM, trained on "
        "its public pretraining corpus only, never a client's or test image, by "
        "scripts/pretrain_backbone.py).",
    )
    epochs: int = Field(50, ge=1, description="Epochs over the synthetic set (paper: 50).")
    steps: int = Field(
        0,
        ge=0,
        description="> 0: train the global classifier for exactly this many SGD steps instead "
        "of epochs, so methods with training sets of different sizes get the same budget (the "
        "benchmark's rule).",
    )
    lr: float = Field(0.01, gt=0.0, description="SGD's learning rate.")
    schedule: LearningRateSchedule = Field(
        "constant",
        description="The learning rate over training: lr throughout (constant), or annealed "
        "from it to 0 along a cosine over the training's steps (cosine; BENCHMARKS.md).",
    )
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="SGD's momentum.")
    batch_size: int = Field(64, ge=1, description="Images per SGD step.")
    image_size: int = Field(64, ge=16, description="Side of the images the classifier sees.")
    precision: Literal["auto", "float32"] = Field(
        "float32",
        description="float32 everywhere (the benchmark's, so its rows compare across machines); "
        "auto: fp16 autocast with loss scaling and channels-last on CUDA, bfloat16 autocast and "
        "channels-last on a CPU with bf16 instructions above 16 px (the default run's: faster "
        "on AMX at the same accuracy, docs/benchmarks/default-run.md), float32 elsewhere.",
    )
    precise_bn: bool = Field(
        True,
        description="After training, re-estimate every BatchNorm's statistics over the whole "
        "training set, unaugmented, with the final weights (precise BN, not in the paper): the "
        "running averages left by training lag the weights and put some default runs' rare "
        "domains at chance.",
    )


class FederationConfig(FlatConfig):
    """Table ``federation`` (keys ``federation.KEY``): who takes part, how long the server
    waits, what it accepts, and where the classifier is scored."""

    WHAT: ClassVar[str] = "federation table"

    min_clients: int = Field(2, ge=1, description="Fewer valid payloads than this fail the run.")
    wait_for_clients_s: float = Field(
        300.0, gt=0.0, description="How long the server waits for min-clients nodes to connect."
    )
    client_nodes: str = Field(
        "",
        description="Who may upload under which client id: 'client-id=node-id' pairs, comma "
        "separated, the node ids `flwr supernode register` gave the institutions' keys. With "
        "it, an upload under a listed id from any other node, or under an unlisted id, is "
        "refused, so no node can take an institution's id. Empty: a client id belongs to the "
        "node that first uploaded it (simulation, where node ids are drawn at start).",
    )
    reply_timeout_s: float = Field(
        3600.0, gt=0.0, description="How long the server waits for a round's replies."
    )
    evaluation: Evaluation = Field(
        "both",
        description="Where the classifier is scored: on the server's test sets, by every "
        "institution on its own held-out images (it gets the classifier back), or both. "
        '"" = both, and clients for imagefolder runs: the server holds no institution\'s '
        "images.",
    )
    replayable_client_noise: bool = Field(
        False,
        description="INSECURE, for simulations and benchmarks only: clients seed their "
        "randomness (partners, gamma, the noise hiding z(T), concept learning) from seed and "
        "their client id, which lets the server replay that noise and recover every client's "
        "private latents. Off: each client draws from its operating system's entropy, or from "
        "the seed in its own node config.",
    )
    max_payload_mb: float = Field(512.0, gt=0.0, description="Replies above this are refused.")
    max_images_per_client: int = Field(
        100_000,
        ge=1,
        description="Uploads claiming more private images than this (in all, or of one class) "
        "are refused: the server synthesizes in proportion to the claim, so the cap bounds its "
        "work per client (docs/methods.md). The default passes every paper setting (the largest "
        "client holds DermaMNIST's 7,007 training images) and institutions of tens of thousands "
        "of images.",
    )
    max_images_per_class: int = Field(
        0,
        ge=0,
        description="The most private images of one class the server synthesizes for per "
        "client: a larger claim is clipped to it (a FedBiP upload with more z(T) of a class is "
        "refused), so an inflated count buys neither compute nor a larger share of the "
        "training set. 0 = data.shots-per-class where the server's partition gives every client "
        "exactly that many (a named dataset split by domain), else max-images-per-client; set "
        "it for institutions' own folders.",
    )

    @field_validator("client_nodes")
    @classmethod
    def _client_nodes(cls, text: str) -> str:
        _node_map(text)
        return text

    @property
    def client_node_map(self) -> dict[str, int]:
        """client-nodes as {client id: node id}."""
        return _node_map(self.client_nodes)

    @property
    def scored_on_server(self) -> bool:
        """evaluation asks for the server's test sets."""
        return self.evaluation in ("server", "both")

    @property
    def scored_at_institutions(self) -> bool:
        """evaluation asks every institution to score the classifier on its own images."""
        return self.evaluation in ("clients", "both")


# The shared tables, by name: each a field of FedBiPConfig of this model.
TABLES: dict[str, type[FlatConfig]] = {
    "data": DataConfig,
    "ldm": LDMConfig,
    "synthesis": SynthesisConfig,
    "classifier": ClassifierConfig,
    "federation": FederationConfig,
}

# Where every key of the flat layout before the tables (issue 92) went: what from_recorded
# translates in an earlier run's config, and what from_flat names when a stale key is given.
SHARED_MOVES: dict[str, str] = {
    "model": "ldm.model",
    "device": "ldm.device",
    "half-precision": "ldm.half-precision",
    "channels-last": "ldm.channels-last",
    "compile-unet": "ldm.compile-unet",
    "vae-batch-size": "ldm.vae-batch-size",
    "dataset": "data.dataset",
    "data-root": "data.root",
    "classes": "data.classes",
    "domains": "data.domains",
    "partitioning": "data.partitioning",
    "dirichlet-beta": "data.dirichlet-beta",
    "shots-per-class": "data.shots-per-class",
    "test-per-class": "data.test-per-class",
    "image-size": "data.image-size",
    "prompt-template": "data.prompt-template",
    "n-s": "data.n-s",
    "n-v": "data.n-v",
    "scheduler": "synthesis.scheduler",
    "num-inference-steps": "synthesis.num-inference-steps",
    "timestep-spacing": "synthesis.timestep-spacing",
    "guidance-scale": "synthesis.guidance-scale",
    "synthesis-batch-size": "synthesis.batch-size",
    "start-timestep": "synthesis.start-timestep",
    "synthesis": "synthesis.where",
    "synthesis-timeout-s": "synthesis.timeout-s",
    "classifier-init": "classifier.init",
    "classifier-epochs": "classifier.epochs",
    "classifier-steps": "classifier.steps",
    "classifier-lr": "classifier.lr",
    "classifier-schedule": "classifier.schedule",
    "classifier-momentum": "classifier.momentum",
    "classifier-batch-size": "classifier.batch-size",
    "classifier-image-size": "classifier.image-size",
    "classifier-precision": "classifier.precision",
    "classifier-precise-bn": "classifier.precise-bn",
    "min-clients": "federation.min-clients",
    "wait-for-clients-s": "federation.wait-for-clients-s",
    "client-nodes": "federation.client-nodes",
    "reply-timeout-s": "federation.reply-timeout-s",
    "evaluation": "federation.evaluation",
    "replayable-client-noise": "federation.replayable-client-noise",
    "max-payload-mb": "federation.max-payload-mb",
    "max-images-per-client": "federation.max-images-per-client",
    "max-images-per-class": "federation.max-images-per-class",
}
# ... and a method's keys that another method's table now declares once (fedbip-mixture's
# FedBiP client step: fedbip's): the run's value only where the run's method was the first.
MOVED: dict[str, str] = {
    **SHARED_MOVES,
    **{
        f"{name}.{key}": f"{model.LENDER[0]}.{key}"
        for name, model in METHOD_SETTINGS.items()
        if model.LENDER
        for key in sorted(model.borrowed_keys())
    },
}


def earlier_layout(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``flat`` (the tables' keys) as the flat layout before the tables wrote it: the inverse of
    :data:`MOVED`, a lender's moved keys also under each borrower's table (fedbip-mixture's
    table repeated fedbip's). For keys made of configs in that layout, which must not change."""
    earlier: dict[str, list[str]] = {}
    for old, new in MOVED.items():
        earlier.setdefault(new, []).append(old)
    shared = set(SHARED_MOVES.values())  # keys that had no place of their own before
    return {
        name: value
        for key, value in flat.items()
        for name in ([] if key in shared else [key]) + earlier.get(key, [])
    }


def in_tables(flat: Mapping[str, Any], method: Any = None) -> dict[str, Any]:
    """``flat`` with every key of the flat layout before the tables at its place now
    (:data:`MOVED`): how a config recorded in that layout reads. A method's key that its
    lender's table now declares (``fedbip-mixture.latents-per-image``) is the run's value where
    ``method`` is that method, and is dropped for any other method's run; with no ``method``
    (settings shared by every method's run) it fills the lender's key where that is unset."""
    values = dict(flat)
    for old, new in MOVED.items():
        if old in values:
            value = values.pop(old)
            owner, dotted, _ = old.partition(".")
            if not dotted or owner == method:
                values[new] = value
            elif method is None:
                values.setdefault(new, value)
    return values


def _placed(values: Mapping[str, Any], top_keys: set[str]) -> dict[str, Any]:
    """Flower's flat keys as FedBiPConfig's fields: every table's dotted keys (or its dict, as
    TOML read unflattened has it) gathered under the table's name, the methods' validated into
    ``method_settings``; a key in the wrong place raises ValueError saying where it belongs."""
    tables: dict[str, dict[str, Any]] = {name: {} for name in (*TABLES, *METHOD_SETTINGS)}
    top: dict[str, Any] = {}
    for key, value in values.items():
        if key in tables and isinstance(value, Mapping):
            tables[key].update(value)
        elif "." in key:
            table, _, name = key.partition(".")
            if table not in tables:
                raise ValueError(
                    f"'{key}': no table is named {table!r}; tables: {', '.join(tables)}"
                )
            tables[table][name] = value
        else:
            if key not in top_keys:
                _check_top(key, values.get("method", DEFAULT_METHOD))
            top[key] = value
    for table, entries in tables.items():
        for name in entries:
            _check_in_table(table, name)
    methods = {name: _table(model, name, tables[name]) for name, model in METHOD_SETTINGS.items()}
    return {**top, **{name: tables[name] for name in TABLES}, "method_settings": _lend(methods)}


def _check_top(key: str, method: Any) -> None:
    """Refuse a top-level key whose place is a table, naming it (a key several methods' tables
    hold: the run's ``method``'s where it is one of them)."""
    if kebab(key) in SHARED_MOVES:
        raise ValueError(f"'{key}' moved: set '{SHARED_MOVES[kebab(key)]}'")
    if key in ("method-settings", "method_settings"):
        raise ValueError("method settings are given as '<method>.<key>' run-config keys")
    homes = [name for name, model in METHOD_SETTINGS.items() if key in model.table_keys()]
    if homes:
        home = method if method in homes else homes[0]
        also = [f"{name}'s" for name in homes if name != home]
        raise ValueError(
            f"'{key}' is method {home}'s setting"
            + (f" (also {', '.join(also)})" if also else "")
            + f": set '{home}.{key}' (TOML table [tool.flwr.app.config.{home}])"
        )
    if home := _method_spelling(key):
        short = key.removeprefix(f"{home}-")
        raise ValueError(
            f"'{key}' is method {home}'s setting: set '{home}.{short}' "
            f"(TOML table [tool.flwr.app.config.{home}])"
        )


def _check_in_table(table: str, name: str) -> None:
    """Refuse ``table.name`` where another table holds ``name``, naming that one."""
    key = f"{table}.{name}"
    model = TABLES.get(table) or METHOD_SETTINGS[table]
    if name in _table_names(model):
        return
    if key in MOVED:
        raise ValueError(f"'{key}' moved: set '{MOVED[key]}'")
    shared = [f"'{t}.{name}'" for t, other in TABLES.items() if name in other.keys()]
    if shared:
        raise ValueError(f"'{key}': {name!r} is a shared key: set {' or '.join(shared)}")
    if home := next((m for m, s in METHOD_SETTINGS.items() if name in s.table_keys()), None):
        raise ValueError(f"'{key}' belongs to method {home}: set '{home}.{name}'")


def _table_names(model: type[FlatConfig]) -> set[str]:
    """What a run config may set in the table of ``model``: its keys, also spelled as field
    names (a table as a config's model_dump holds it)."""
    keys = model.table_keys() if issubclass(model, MethodSettings) else model.keys()
    return keys | {n for n, f in model.model_fields.items() if (f.alias or kebab(n)) in keys}


def _method_spelling(key: str) -> str | None:
    """The method whose table holds ``key`` spelled ``<method>-<key>``, if any."""
    for name, model in METHOD_SETTINGS.items():
        if key.startswith(f"{name}-") and key.removeprefix(f"{name}-") in model.table_keys():
            return name
    return None


def _table(model: type[MethodSettings], method: str, values: dict[str, Any]) -> MethodSettings:
    try:
        return model.model_validate(values)
    except ValidationError as err:
        raise ValueError(problems(err, f"{method}.")) from None


def _lend(settings: Mapping[str, MethodSettings]) -> dict[str, MethodSettings]:
    """Every method's settings, a method that runs another's step given that one's values of
    the keys it declares once (:attr:`MethodSettings.LENDER`)."""
    out = dict(settings)
    for name, own in settings.items():
        if lent := own.LENDER:
            lender, step = lent
            values = settings[lender].model_dump(include=set(step.model_fields))
            out[name] = type(own).model_validate({**own.model_dump(), **values})
    return out


class FedBiPConfig(FlatConfig):
    """Every knob of a FedBiP run: four top-level keys, the shared tables (:data:`TABLES`) and
    every method's table. Keys are kebab-case in TOML / ``--run-config``."""

    WHAT: ClassVar[str] = "FedBiP run config"
    TABLE_FIELDS: ClassVar[frozenset[str]] = frozenset(TABLES)

    method: str = Field(
        DEFAULT_METHOD,
        description=f"Which method the federation runs: {', '.join(METHOD_SETTINGS)} "
        "(fedbip_flwr/method_settings.py; docs/methods.md says what each uploads: central's "
        "clients upload their images, not private).",
    )
    seed: int = Field(
        0,
        description="The server's randomness (eta, classifier) and, in simulation, which images "
        "each client holds; the clients' hiding noise only with "
        "federation.replayable-client-noise.",
    )
    output_dir: str = Field("outputs", description="Where every run's folder is made.")
    run_name: str = Field(
        "", description="Folder under output-dir; reuse one to resume an interrupted server."
    )
    data: DataConfig = Field(default_factory=DataConfig)
    ldm: LDMConfig = Field(default_factory=LDMConfig)
    synthesis: SynthesisConfig = Field(default_factory=SynthesisConfig)
    classifier: ClassifierConfig = Field(default_factory=ClassifierConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    # Every method's own table, validated by its settings model (filled from run-config keys
    # ``<method>.<key>`` by :meth:`_tables`; never a run-config key itself).
    method_settings: dict[str, SerializeAsAny[MethodSettings]] = Field(
        default_factory=dict, exclude=True
    )

    @field_validator("method")
    @classmethod
    def _registered(cls, name: str) -> str:
        known = sorted(METHOD_SETTINGS)
        if name not in known:
            raise ValueError(f"unknown method {name!r}; the registry knows {', '.join(known)}")
        return name

    @model_validator(mode="before")
    @classmethod
    def _tables(cls, data: Any) -> Any:
        """Every dotted key into its table; evaluation's sentinel "" filled from the dataset
        (imagefolder: clients, the server holds no institution's images; else both)."""
        if not isinstance(data, Mapping):
            return data
        top = cls.top_keys()
        data = _placed(data, top | {name for name in cls.model_fields if kebab(name) in top})
        if data["federation"].get("evaluation") in (None, ""):
            own = _spec_of(data["data"].get("dataset", "shapes")).layout == OWN_FOLDER
            data["federation"]["evaluation"] = "clients" if own else "both"
        return data

    @model_validator(mode="after")
    def _scored_where_the_images_are(self) -> FedBiPConfig:
        if self.data.own_folders and self.federation.evaluation != "clients":
            raise ValueError(
                "the server holds no institution's images: imagefolder needs "
                'federation.evaluation = "clients"'
            )
        return self

    @classmethod
    def from_recorded(cls, flat: Mapping[str, Any]) -> FedBiPConfig:
        """A config a run folder recorded, also in a layout of before: a key of the flat layout
        before the tables moves to its table (:data:`MOVED`; a method's key moved to another
        method's table only where the run's method was the first, else dropped), and a
        top-level key from before FedBiP's keys moved into the methods' tables moves into the
        run's method's table where that table has it, and is dropped where the method never
        read it."""
        values, top = dict(flat), cls.keys()
        method = values.get("method", DEFAULT_METHOD)
        own = (
            METHOD_SETTINGS.get(method, MethodSettings).keys() if isinstance(method, str) else set()
        )
        tables = set().union(*(model.keys() for model in METHOD_SETTINGS.values()))
        for key in [k for k in values if k not in top | SHARED_MOVES.keys() and k in tables]:
            value = values.pop(key)
            if key in own:
                values.setdefault(f"{method}.{key}", value)
        return cls.from_flat(in_tables(values, method))

    def settings_of(self, method: str) -> MethodSettings:
        """The run's settings of ``method`` (its table, defaults filled)."""
        return self.method_settings[method]

    def with_settings(self, method: str, **values: Any) -> FedBiPConfig:
        """This config with ``method``'s table changed by ``values`` (field names), validated;
        a method that takes keys from another's table takes the change too."""
        table = self.method_settings[method]
        lent = set(table.LENDER[1].model_fields) if table.LENDER else set()
        if lent & set(values):
            raise ValueError(
                f"{method} takes {', '.join(sorted(lent & set(values)))} from method "
                f"{table.LENDER[0]}'s table: change them there"
            )
        changed = type(table).model_validate({**table.model_dump(), **values})
        settings = _lend({**self.method_settings, method: changed})
        return self.model_copy(update={"method_settings": settings})

    @property
    def class_cap(self) -> int:
        """federation.max-images-per-class, resolved (0 = the partition's own bound)."""
        federation, data = self.federation, self.data
        if federation.max_images_per_class:
            return federation.max_images_per_class
        k_shots = data.partitioning == FEATURE and not data.own_folders
        return data.shots_per_class if k_shots else federation.max_images_per_client

    @property
    def data_description(self) -> DataDescription:
        """The data layer's part of this config."""
        data = self.data
        return DataDescription(
            dataset=data.dataset,
            data_root=data.root,
            classes=tuple(data.class_list),
            domains=tuple(data.domain_list),
            partitioning=data.partitioning,
            dirichlet_beta=data.dirichlet_beta,
            shots_per_class=data.shots_per_class,
            test_per_class=data.test_per_class,
            image_size=data.image_size,
            seed=self.seed,
        )

    @classmethod
    def top_keys(cls) -> set[str]:
        """The run-config keys of no table."""
        return cls.keys() - set(TABLES) - {"method-settings"}

    def to_flat(self) -> dict[str, Any]:
        """The flat dict form, as written to metrics.json and accepted by from_flat: the
        top-level keys, then every shared table's and every method's keys, dotted."""
        top = {k: v for k, v in super().to_flat().items() if k in self.top_keys()}
        shared = {
            f"{name}.{key}": value
            for name in TABLES
            for key, value in getattr(self, name).to_flat().items()
        }
        tables = {
            f"{method}.{key}": value
            for method, settings in sorted(self.method_settings.items())
            for key, value in settings.to_flat().items()
            if key in settings.table_keys()
        }
        return {**top, **shared, **tables}


class NodeConfig(FlatConfig):
    """What one institution's SuperNode says about itself (``--node-config``); the server never sees it.

    A simulation gives every node ``partition-id`` / ``num-partitions`` and the run config picks
    its data; a real institution names its own folder, domain phrase and client id instead, and
    may name its own model copy, device, precision, seed and output folder, and what it lets
    leave it (its upload policy, :mod:`fedbip_flwr.policy`).
    """

    WHAT: ClassVar[str] = "node config"

    partition_id: int | None = Field(None, ge=0, description="Simulation: this node's partition.")
    num_partitions: int | None = Field(None, ge=1)
    data_root: str = Field("", description="This institution's data folder.")
    domain: str = Field(
        "", description='imagefolder: the words S starts from, e.g. "dermatoscopic image".'
    )
    client_id: str = Field("", description="imagefolder: the name this institution uploads under.")
    bad_images: BadImagePolicy = Field(
        "fail",
        description='imagefolder: an unreadable image file fails the job ("fail", naming '
        'every one) or is left out ("skip", listed in a warning, counted in the metrics).',
    )
    model: str = Field("", description="This institution's copy of the run's base model.")
    captioner: str = Field("", description="oscar: this institution's copy of the run's captioner.")
    device: Literal["", "auto", "cpu", "cuda"] = ""
    half_precision: bool | None = None
    seed: int | None = Field(
        None,
        description="Makes this institution's own randomness reproducible; never leaves the "
        "institution. Unset: the operating system's entropy.",
    )
    output_dir: str = Field(
        "",
        description="Where the classifier sent back and the record of every upload are kept; "
        '"" = the run\'s output-dir.',
    )

    # --- its upload policy: checked before any image is read or any model loaded ----------
    allow_uploads: str = Field(
        ALL_KINDS,
        description="Which kinds of upload may leave this institution: all, or a comma-separated "
        "list of images, latents, statistics, concepts, text, classifier, counts (docs/"
        "institutions.md says which method uploads which). A run whose method uploads another "
        "kind is refused.",
    )
    require_dp: bool | None = Field(
        None,
        description="Whether an upload must carry a differential-privacy guarantee of at most "
        "max-dp-epsilon and max-dp-delta per image. Unset: yes for an institution with its own "
        "data (no partition-id), no for a simulated partition.",
    )
    max_dp_epsilon: float = Field(
        4.0, gt=0.0, le=100.0, description="With require-dp: the weakest epsilon accepted."
    )
    max_dp_delta: float = Field(
        1e-5, gt=0.0, lt=1.0, description="With require-dp: the weakest delta accepted."
    )
    max_upload_images: int = Field(
        0, ge=0, description="The most private images one upload may stand for; 0 = no cap."
    )
    max_upload_mb: float = Field(
        0.0, ge=0.0, description="The most MiB one upload may take; 0 = no cap."
    )

    @field_validator("allow_uploads")
    @classmethod
    def _kinds(cls, text: str) -> str:
        parse_kinds(text)
        return text

    @property
    def simulated(self) -> bool:
        """A simulation's partition, not an institution with its own data."""
        return self.partition_id is not None

    @property
    def upload_policy(self) -> UploadPolicy:
        """This institution's upload policy, its defaults resolved: a real institution requires
        a DP guarantee unless it says otherwise; a simulated partition does not."""
        return UploadPolicy(
            kinds=parse_kinds(self.allow_uploads),
            require_dp=not self.simulated if self.require_dp is None else self.require_dp,
            max_epsilon=self.max_dp_epsilon,
            max_delta=self.max_dp_delta,
            max_images=self.max_upload_images,
            max_bytes=int(self.max_upload_mb * 2**20),
        )

    # the run-config keys an institution may set for itself: its paths and its hardware
    RUN_KEYS: ClassVar[dict[str, str]] = {
        "data_root": "data.root",
        "model": "ldm.model",
        "captioner": "oscar.captioner",
        "device": "ldm.device",
        "half_precision": "ldm.half-precision",
    }

    def run_overrides(self) -> dict[str, Any]:
        """The run-config keys this institution sets for itself (they win over the server's)."""
        values = {key: getattr(self, name) for name, key in self.RUN_KEYS.items()}
        return {key: v for key, v in values.items() if v not in ("", None)}
