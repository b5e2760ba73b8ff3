"""One typed configuration for a FedBiP run, validated at the edge.

Flower delivers the run config as a flat ``dict[str, bool | int | float | str]`` with
kebab-case keys (``classifier-lr``); a method's own keys come as its table's dotted keys
(``fedbip.concept-lr``, :mod:`fedbip_flwr.method_settings`). :meth:`FedBiPConfig.from_flat`
turns it into this model and rejects unknown keys and bad values with one readable message. Defaults are the paper's
(FedBiP, ICLR'25 submission, Sec. 5 and App. A) unless a comment says otherwise, except the
base model and image sizes: the shipped miniature LDM at 64 px (the paper: SD v1-4 at 512 px,
which the conf/ files for a GPU set). The dataset-dependent ones (prompt template, n_s, n_v,
domains: Table 5; classes and where evaluation happens) come from
:data:`fedbip_flwr.specs.SPECS` when left empty / 0, and the model holds the filled-in values.
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
from .specs import FEATURE, OWN_FOLDER, SPECS

# node config bad-images: an unreadable image file fails the institution's job, or is left out
BadImagePolicy = Literal["fail", "skip"]

# The classifier's learning rate over training: lr throughout, or cosine-annealed to 0 step by step.
LearningRateSchedule = Literal["constant", "cosine"]

CONCEPT_SLOT_S = "{S}"
CONCEPT_SLOT_V = "{V}"
SD_V1_4 = "CompVis/stable-diffusion-v1-4"


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


def _home_of(key: str, tables: Mapping[str, type[MethodSettings]]) -> str | None:
    """The method whose table holds ``key`` (also spelled ``<method>-<key>``), if any."""
    for name, model in tables.items():
        if key in model.keys() or key.removeprefix(f"{name}-") in model.keys():
            return name
    return None


def _split_tables(data: dict[str, Any], shared: set[str]) -> dict[str, MethodSettings]:
    """Take every ``<method>.<key>`` out of ``data``, each method's table validated by that
    method's settings; a key in the wrong place is refused with where it belongs."""
    models = METHOD_SETTINGS
    for key in [k for k, v in data.items() if isinstance(v, Mapping)]:  # TOML read unflattened
        data.update({f"{key}.{name}": value for name, value in data.pop(key).items()})
    tables: dict[str, dict[str, Any]] = {name: {} for name in models}
    for key in [k for k in data if "." in k]:
        table, _, name = key.partition(".")
        if table not in models:
            raise ValueError(f"'{key}': no method is named {table!r}; tables: {', '.join(models)}")
        if name not in models[table].keys():
            if name in shared:
                raise ValueError(f"'{key}': {name!r} is a shared key: set it without '{table}.'")
            if home := _home_of(name, models):
                raise ValueError(f"'{key}' belongs to method {home}: set '{home}.{name}'")
        tables[table][name] = data.pop(key)
    for key in [k for k in data if k not in shared]:
        homes = [name for name, model in models.items() if key in model.keys()]
        if homes:
            method = data.get("method", DEFAULT_METHOD)
            home = method if method in homes else homes[0]
            also = [f"{name}'s" for name in homes if name != home]
            raise ValueError(
                f"'{key}' is method {home}'s setting"
                + (f" (also {', '.join(also)})" if also else "")
                + f": set '{home}.{key}' (TOML table [tool.flwr.app.config.{home}])"
            )
        if home := _home_of(key, models):
            short = key.removeprefix(f"{home}-")
            raise ValueError(
                f"'{key}' is method {home}'s setting: set '{home}.{short}' "
                f"(TOML table [tool.flwr.app.config.{home}])"
            )
    return {name: _table(models[name], name, table) for name, table in tables.items()}


def _table(model: type[MethodSettings], method: str, values: dict[str, Any]) -> MethodSettings:
    try:
        return model.model_validate(values)
    except ValidationError as err:
        raise ValueError(problems(err, f"{method}.")) from None


DatasetName = Literal[
    "shapes", "domainnet", "pacs", "officehome", "dermamnist", "ucm", "imagefolder"
]
Partitioning = Literal["domain", "dirichlet", "iid"]


class DataDescription(BaseModel):
    """What to load, and nothing else: the data layer (:mod:`fedbip_flwr.dataset`) takes this,
    never a method's knobs. Built from a validated run config (:attr:`FedBiPConfig.data`)."""

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


class FedBiPConfig(FlatConfig):
    """Every knob of a FedBiP run. Keys are kebab-case in TOML / ``--run-config``."""

    WHAT: ClassVar[str] = "FedBiP run config"

    # --- method (fedbip_flwr.methods) ----------------------------------------------------------
    method: str = Field(
        DEFAULT_METHOD,
        description=f"Which method the federation runs: {', '.join(METHOD_SETTINGS)} "
        "(fedbip_flwr.method_settings; docs/methods.md says what each uploads: central's "
        "clients upload their images, not private).",
    )

    @field_validator("method")
    @classmethod
    def _registered(cls, name: str) -> str:
        known = sorted(METHOD_SETTINGS)
        if name not in known:
            raise ValueError(f"unknown method {name!r}; the registry knows {', '.join(known)}")
        return name

    # Every method's own table, validated by its settings model (filled from run-config keys
    # ``<method>.<key>`` by :meth:`_tables`; never a run-config key itself).
    method_settings: dict[str, SerializeAsAny[MethodSettings]] = Field(
        default_factory=dict, exclude=True
    )

    @model_validator(mode="before")
    @classmethod
    def _tables(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if "method-settings" in data or "method_settings" in data:
            raise ValueError("method settings are given as '<method>.<key>' run-config keys")
        shared = cls.keys() | set(cls.model_fields)
        data["method_settings"] = _split_tables(
            data, shared - {"method-settings", "method_settings"}
        )
        return data

    @classmethod
    def from_recorded(cls, flat: Mapping[str, Any]) -> FedBiPConfig:
        """A config a run folder recorded, also one written before FedBiP's keys moved into
        the methods' tables: such a top-level key moves into the run's method's table where
        that table has it, and is dropped where the method never read it."""
        values, shared = dict(flat), cls.keys()
        method = values.get("method", DEFAULT_METHOD)
        own = (
            METHOD_SETTINGS.get(method, MethodSettings).keys() if isinstance(method, str) else set()
        )
        tables = set().union(*(model.keys() for model in METHOD_SETTINGS.values()))
        for key in [k for k in values if "." not in k and k not in shared and k in tables]:
            value = values.pop(key)
            if key in own:
                values.setdefault(f"{method}.{key}", value)
        return cls.from_flat(values)

    def settings_of(self, method: str) -> MethodSettings:
        """The run's settings of ``method`` (its table, defaults filled)."""
        return self.method_settings[method]

    def with_settings(self, method: str, **values: Any) -> FedBiPConfig:
        """This config with ``method``'s table changed by ``values`` (field names), validated."""
        table = self.method_settings[method]
        changed = type(table).model_validate({**table.model_dump(), **values})
        return self.model_copy(
            update={"method_settings": {**self.method_settings, method: changed}}
        )

    # --- base latent diffusion model -------------------------------------------------------
    model: str = Field(
        "models/miniature-ldm",
        description="Hub id (e.g. CompVis/stable-diffusion-v1-4) or a local diffusers folder.",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
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

    # --- data --------------------------------------------------------------------------------
    dataset: DatasetName = Field(
        "shapes",
        description="shapes is generated in memory; imagefolder is each institution's own "
        "<data-root>/[train|test/]<class>/<image> folder (node config); the others are the "
        "paper's datasets, read from data-root.",
    )
    data_root: str = Field(
        "",
        description="Dataset folder (or MedMNIST .npz); unused by shapes. An institution sets "
        "its own in its node config.",
    )
    classes: str = Field(
        "",
        description="Comma-separated class names in label order, also the words each V_y "
        'starts from; required by imagefolder, "" = the dataset\'s.',
    )
    domains: str = Field(
        "",
        description="Comma-separated domains, each also the words S starts from; "
        '"" = the dataset\'s defaults. Partition p gets domains[p % len(domains)].',
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
    image_size: int = Field(64, ge=8, description="Side of the images the LDM sees.")

    # --- the noise level every z(T) method uploads at ----------------------------------------
    start_timestep: int = Field(
        0,
        ge=0,
        description="T for z(T); 0 = the first timestep of the synthesis schedule (paper).",
    )
    vae_batch_size: int = Field(
        8,
        ge=1,
        description="Images per VAE call (client encode, server decode): the VAE's "
        "full-resolution activations are the memory peak at 512 px.",
    )

    # --- the dataset's prompt (Table 5), from which concepts and plain prompts start --------
    prompt_template: str = Field(
        "",
        description='Must contain {S} (domain) and {V} (class); "" = the dataset\'s (Table 5).',
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

    # --- payload -----------------------------------------------------------------------------
    max_payload_mb: float = Field(512.0, gt=0.0, description="Replies above this are refused.")
    max_images_per_client: int = Field(
        100_000,
        ge=1,
        description="Uploads claiming more private images than this (in all, or of one class) "
        "are refused: the server synthesizes in proportion to the claim, so the cap bounds its "
        "work per client. The default passes every paper setting (the largest client holds "
        "DermaMNIST's 7,007 training images) and institutions of tens of thousands of images.",
    )
    max_images_per_class: int = Field(
        0,
        ge=0,
        description="The most private images of one class the server synthesizes for per "
        "client: a larger claim is clipped to it (a FedBiP upload with more z(T) of a class is "
        "refused), so an inflated count buys neither compute nor a larger share of the "
        "training set. 0 = shots-per-class where the server's partition gives every client "
        "exactly that many (a named dataset split by domain), else max-images-per-client; set "
        "it for institutions' own folders.",
    )

    # --- server synthesis (eq. 5) ------------------------------------------------------------
    scheduler: SchedulerName = Field(
        SchedulerName.PNDM,
        description="The sampler the server denoises with (diffusers' class, built from the "
        "model's noise schedule): pndm (the paper's), ddim, dpm-solver++, unipc. Clients noise "
        "z(T) to its first timestep, so clients and server must agree.",
    )
    num_inference_steps: int = Field(50, ge=1)
    timestep_spacing: TimestepSpacing = Field(
        "leading",
        description="Where the steps sit in 1..1000. leading (SD v1-x's, the paper's): T, the "
        "noise level of z(T), drops with fewer steps; trailing: T = 999 at every step count.",
    )
    guidance_scale: float = Field(7.5, ge=1.0, description="1.0 disables guidance.")
    synthesis_batch_size: int = Field(32, ge=1)
    synthesis: Literal["server", "external"] = Field(
        "server",
        description="Who makes the training set after the round (one-shot methods): the "
        "ServerApp itself, or `fedbip synthesize RUN_DIR` in other processes (accelerate "
        "launch on many GPUs or machines over the run folder; docs/scale.md) while the "
        "ServerApp waits for every shard, then trains the classifier as usual.",
    )
    synthesis_timeout_s: float = Field(
        86400.0,
        gt=0.0,
        description="external synthesis: how long the ServerApp waits for the shards before "
        "the run fails (a restart with the same run-name waits again; shards made are kept).",
    )

    # --- classifier (eq. 6) ------------------------------------------------------------------
    classifier_init: Literal["imagenet", "random", "pretrained"] = Field(
        "imagenet",
        description="The classifier's starting weights, each with a fresh head for the run's "
        "classes: imagenet = torchvision's ResNet-18 ImageNet weights (the paper's, from the torch "
        "hub cache), random, or pretrained = the ResNet-18 backbone shipped with the base model "
        "(<model>/classifier-backbone/model.safetensors: for the miniature LDM, trained on its "
        "public pretraining corpus only, never a client's or test image, by "
        "scripts/pretrain_backbone.py).",
    )
    classifier_epochs: int = Field(50, ge=1)
    classifier_steps: int = Field(
        0,
        ge=0,
        description="> 0: train the global classifier for exactly this many SGD steps instead "
        "of classifier-epochs, so methods with training sets of different sizes get the same "
        "budget (the benchmark's rule).",
    )
    classifier_lr: float = Field(0.01, gt=0.0)
    classifier_schedule: LearningRateSchedule = Field(
        "constant",
        description="The learning rate over training: classifier-lr throughout (constant), or "
        "annealed from it to 0 along a cosine over the training's steps (cosine).",
    )
    classifier_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    classifier_batch_size: int = Field(64, ge=1)
    classifier_image_size: int = Field(64, ge=16)
    classifier_precision: Literal["auto", "float32"] = Field(
        "float32",
        description="float32 everywhere (the benchmark's, so its rows compare across machines); "
        "auto: fp16 autocast with loss scaling and channels-last on CUDA, bfloat16 autocast and "
        "channels-last on a CPU with bf16 instructions above 16 px (faster; its accuracy is not "
        "yet measured against float32: scripts/precision_check.py), float32 elsewhere.",
    )
    classifier_precise_bn: bool = Field(
        True,
        description="After training, re-estimate every BatchNorm's statistics over the whole "
        "training set, unaugmented, with the final weights (precise BN): the running averages "
        "left by training lag the weights and put some default runs' rare domains at chance.",
    )

    # --- federation --------------------------------------------------------------------------
    min_clients: int = Field(2, ge=1, description="Fewer valid payloads than this fail the run.")
    wait_for_clients_s: float = Field(300.0, gt=0.0)
    client_nodes: str = Field(
        "",
        description="Who may upload under which client id: 'client-id=node-id' pairs, comma "
        "separated, the node ids `flwr supernode register` gave the institutions' keys. With "
        "it, an upload under a listed id from any other node, or under an unlisted id, is "
        "refused, so no node can take an institution's id. Empty: a client id belongs to the "
        "node that first uploaded it (simulation, where node ids are drawn at start).",
    )
    reply_timeout_s: float = Field(3600.0, gt=0.0)
    output_dir: str = "outputs"
    run_name: str = Field(
        "", description="Folder under output-dir; reuse one to resume an interrupted server."
    )
    seed: int = 0
    replayable_client_noise: bool = Field(
        False,
        description="INSECURE, for simulations and benchmarks only: clients seed their "
        "randomness (partners, gamma, the noise hiding z(T), concept learning) from seed and "
        "their client id, which lets the server replay that noise and recover every client's "
        "private latents. Off: each client draws from its operating system's entropy, or from "
        "the seed in its own node config.",
    )
    evaluation: Literal["server", "clients", "both"] = Field(
        "both",
        description="Where the classifier is scored: on the server's test sets, by every "
        "institution on its own held-out images (it gets the classifier back), or both. "
        "imagefolder runs default to clients: the server holds no institution's images.",
    )

    @model_validator(mode="before")
    @classmethod
    def _dataset_defaults(cls, data: Any) -> Any:
        """Fill unset (or sentinel) prompt-template, n-s, n-v, domains, classes and evaluation
        from the dataset.

        Flower merges --run-config over pyproject's values, so pyproject holds sentinels: a
        concrete value there would silently give one dataset's prompt to every other one.
        """
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        name = data.get("dataset", "shapes")
        # An unknown name is the dataset field's one error; any spec's values keep the unfilled
        # sentinels (n-s = 0, ...) from adding errors of their own.
        spec = SPECS.get(name, SPECS["shapes"]) if isinstance(name, str) else SPECS["shapes"]
        defaults = {
            "prompt_template": spec.prompt_template,
            "n_s": spec.n_s,
            "n_v": spec.n_v,
            "domains": ",".join(spec.default_domains),
            "classes": ",".join(spec.classes),
            "evaluation": "clients" if spec.layout == OWN_FOLDER else "both",
        }
        for field, value in defaults.items():
            key = field if field in data else kebab(field)
            if data.get(key) in (None, "", 0):
                data[key] = value
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> FedBiPConfig:
        for slot in (CONCEPT_SLOT_S, CONCEPT_SLOT_V):
            if self.prompt_template.count(slot) != 1:
                raise ValueError(f"prompt-template must contain {slot} exactly once")
        spec = SPECS[self.dataset]
        if spec.layout == OWN_FOLDER:
            return self._check_own_folders()
        if self.class_list != list(spec.classes):
            raise ValueError(f"classes are fixed by dataset {self.dataset}: leave them empty")
        unknown = [d for d in self.domain_list if d not in spec.domains]
        if unknown or not self.domain_list:
            raise ValueError(
                f"domains must name {self.dataset} domains exactly; "
                f"got {self.domains!r}, valid: {', '.join(spec.domains)}"
            )
        if self.partitioning not in spec.partitionings:
            raise ValueError(
                f"partitioning '{self.partitioning}' does not apply to {self.dataset}; "
                f"use {' or '.join(spec.partitionings)}"
            )
        if spec.layout != "generated" and not self.data_root:
            raise ValueError(f"dataset {self.dataset} is read from disk: set data-root")
        return self

    def _check_own_folders(self) -> FedBiPConfig:
        """imagefolder: the run names the classes; every institution brings its own domain."""
        if not self.class_list:
            raise ValueError('dataset imagefolder needs classes = "name,name,..." (label order)')
        if len(set(self.class_list)) != len(self.class_list):
            raise ValueError(f"classes must be unique; got {self.classes!r}")
        if self.evaluation != "clients":
            raise ValueError(
                "the server holds no institution's images: imagefolder needs "
                'evaluation = "clients"'
            )
        return self

    @property
    def domain_list(self) -> list[str]:
        return _split_list(self.domains)

    @property
    def class_list(self) -> list[str]:
        return _split_list(self.classes)

    @field_validator("client_nodes")
    @classmethod
    def _client_nodes(cls, text: str) -> str:
        _node_map(text)
        return text

    @property
    def client_node_map(self) -> dict[str, int]:
        """Run config client-nodes as {client id: node id}."""
        return _node_map(self.client_nodes)

    @property
    def class_cap(self) -> int:
        """Run config max-images-per-class, resolved (0 = the partition's own bound)."""
        if self.max_images_per_class:
            return self.max_images_per_class
        k_shots = self.partitioning == FEATURE and SPECS[self.dataset].layout != OWN_FOLDER
        return self.shots_per_class if k_shots else self.max_images_per_client

    @property
    def data(self) -> DataDescription:
        """The data layer's part of this config."""
        return DataDescription(
            dataset=self.dataset,
            data_root=self.data_root,
            classes=tuple(self.class_list),
            domains=tuple(self.domain_list),
            partitioning=self.partitioning,
            dirichlet_beta=self.dirichlet_beta,
            shots_per_class=self.shots_per_class,
            test_per_class=self.test_per_class,
            image_size=self.image_size,
            seed=self.seed,
        )

    def to_flat(self) -> dict[str, Any]:
        """The kebab-case dict form, as written to metrics.json and accepted by from_flat:
        shared keys, then every method's table as dotted keys."""
        tables = {
            f"{method}.{key}": value
            for method, settings in sorted(self.method_settings.items())
            for key, value in settings.to_flat().items()
        }
        return {**super().to_flat(), **tables}


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
        "data_root": "data-root",
        "model": "model",
        "captioner": "oscar.captioner",
        "device": "device",
        "half_precision": "half-precision",
    }

    def run_overrides(self) -> dict[str, Any]:
        """The run-config keys this institution sets for itself (they win over the server's)."""
        values = {key: getattr(self, name) for name, key in self.RUN_KEYS.items()}
        return {key: v for key, v in values.items() if v not in ("", None)}
