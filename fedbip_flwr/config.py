"""One typed configuration for a FedBiP run, validated at the edge.

Flower delivers the run config as a flat ``dict[str, bool | int | float | str]`` with
kebab-case keys (``concept-lr``); :meth:`FedBiPConfig.from_flat` turns it into this model and
rejects unknown keys and bad values with one readable message. Defaults are the paper's
(FedBiP, ICLR'25 submission, Sec. 5 and App. A) unless a comment says otherwise; the
dataset-dependent ones (prompt template, n_s, n_v, domains: Table 5) come from
:data:`fedbip_flwr.specs.SPECS` when left empty / 0, and the model holds the filled-in values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .specs import SPECS

CONCEPT_SLOT_S = "{S}"
CONCEPT_SLOT_V = "{V}"
SD_V1_4 = "CompVis/stable-diffusion-v1-4"


class ConfigError(ValueError):
    """A run config that cannot be used; the message says which key and why."""


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class FedBiPConfig(BaseModel):
    """Every knob of a FedBiP run. Keys are kebab-case in TOML / ``--run-config``."""

    model_config = ConfigDict(
        extra="forbid", alias_generator=_kebab, populate_by_name=True, frozen=True
    )

    # --- base latent diffusion model -------------------------------------------------------
    model: str = Field(
        "models/miniature-ldm",
        description="Hub id (e.g. CompVis/stable-diffusion-v1-4) or a local diffusers folder.",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    half_precision: bool = Field(
        True, description="fp16 for the frozen LDM on CUDA; CPU always runs float32."
    )

    # --- data --------------------------------------------------------------------------------
    dataset: Literal["shapes", "domainnet", "pacs", "officehome", "dermamnist", "ucm"] = Field(
        "shapes", description="shapes is generated in memory; the others are read from data-root."
    )
    data_root: str = Field("", description="Dataset folder (or MedMNIST .npz); unused by shapes.")
    domains: str = Field(
        "",
        description="Comma-separated domains, each also the words S starts from; "
        "\"\" = the dataset's defaults. Partition p gets domains[p % len(domains)].",
    )
    partitioning: Literal["domain", "dirichlet", "iid"] = Field(
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

    # --- instance level (eq. 3) --------------------------------------------------------------
    gamma_mean: float = Field(0.5, ge=0.0, le=1.0)
    gamma_std: float = Field(0.1, ge=0.0)
    start_timestep: int = Field(
        0,
        ge=0,
        description="T for z(T); 0 = the first timestep of the synthesis schedule (paper).",
    )
    latent_dtype: Literal["float32", "float16"] = "float32"

    # --- concept level (eq. 4) ---------------------------------------------------------------
    prompt_template: str = Field(
        "",
        description="Must contain {S} (domain) and {V} (class); \"\" = the dataset's (Table 5).",
    )
    n_s: int = Field(0, ge=1, le=8, description="Tokens in S; 0 = the dataset's (Table 5).")
    n_v: int = Field(0, ge=1, le=8, description="Tokens per V_y; 0 = the dataset's (Table 5).")
    concept_space: Literal["token", "hidden"] = Field(
        "token",
        description="token = input token embeddings (paper); "
        "hidden = text-encoder output states (authors' code).",
    )
    concept_lr: float = Field(0.1, gt=0.0)
    concept_epochs: int = Field(50, ge=0)
    concept_batch_size: int = Field(8, ge=1)

    # --- payload -----------------------------------------------------------------------------
    max_payload_mb: float = Field(512.0, gt=0.0, description="Replies above this are refused.")

    # --- server synthesis (eq. 5) ------------------------------------------------------------
    multiplier: int = Field(2, ge=1, description="Images per z(T): FedBiP-S/M/L = 2/5/10.")
    num_inference_steps: int = Field(50, ge=1)
    guidance_scale: float = Field(7.5, ge=1.0, description="1.0 disables guidance.")
    eta_std: float = Field(0.1, ge=0.0, description="sigma of the perturbation S + eta.")
    synthesis_batch_size: int = Field(32, ge=1)

    # --- classifier (eq. 6) ------------------------------------------------------------------
    classifier_init: Literal["imagenet", "random"] = "imagenet"
    classifier_epochs: int = Field(50, ge=1)
    classifier_lr: float = Field(0.01, gt=0.0)
    classifier_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    classifier_batch_size: int = Field(64, ge=1)
    classifier_image_size: int = Field(64, ge=16)

    # --- federation --------------------------------------------------------------------------
    min_clients: int = Field(2, ge=1, description="Fewer valid payloads than this fail the run.")
    wait_for_clients_s: float = Field(300.0, gt=0.0)
    reply_timeout_s: float = Field(3600.0, gt=0.0)
    output_dir: str = "outputs"
    run_name: str = Field(
        "", description="Folder under output-dir; reuse one to resume an interrupted server."
    )
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _dataset_defaults(cls, data: Any) -> Any:
        """Fill unset (or sentinel) prompt-template, n-s, n-v and domains from the dataset.

        Flower merges --run-config over pyproject's values, so pyproject holds sentinels: a
        concrete value there would silently give one dataset's prompt to every other one.
        """
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        name = data.get("dataset", "shapes")
        spec = SPECS.get(name) if isinstance(name, str) else None
        if spec is None:
            return data  # the dataset field reports the unknown name
        defaults = {
            "prompt_template": spec.prompt_template,
            "n_s": spec.n_s,
            "n_v": spec.n_v,
            "domains": ",".join(spec.default_domains),
        }
        for field, value in defaults.items():
            key = field if field in data else _kebab(field)
            if data.get(key) in (None, "", 0):
                data[key] = value
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> FedBiPConfig:
        for slot in (CONCEPT_SLOT_S, CONCEPT_SLOT_V):
            if self.prompt_template.count(slot) != 1:
                raise ValueError(f"prompt-template must contain {slot} exactly once")
        spec = SPECS[self.dataset]
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

    @property
    def domain_list(self) -> list[str]:
        return [d.strip() for d in self.domains.split(",") if d.strip()]

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> FedBiPConfig:
        """Build from Flower's flat run config; raise :class:`ConfigError` with one sentence."""
        try:
            return cls.model_validate(dict(flat))
        except ValidationError as err:
            problems = "; ".join(
                f"'{'.'.join(str(p) for p in e['loc']) or 'config'}': {e['msg']}"
                for e in err.errors()
            )
            raise ConfigError(f"Invalid FedBiP run config: {problems}.") from None

    def to_flat(self) -> dict[str, Any]:
        """The kebab-case dict form, as written to metrics.json and accepted by from_flat."""
        return self.model_dump(by_alias=True)
