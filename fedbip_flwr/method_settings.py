"""Every method's name and its own run-config keys: the one list of methods.

A method's settings model checks its TOML table (``[tool.flwr.app.config.fedlmg]``, handed
over as dotted keys ``fedlmg.batch-size``). The run config (:mod:`fedbip_flwr.config`)
validates ``method`` and every table against :data:`METHOD_SETTINGS` here, below it; the
methods (:mod:`fedbip_flwr.methods`) sit above the config, and
:func:`~fedbip_flwr.methods.base.register` refuses a method whose name this table lacks, so
imports run one way and a config validates in a process that imported no method.

FedBiP's table is built from the levels of its method, :class:`InstanceSettings` (z(T)),
:class:`ConceptSettings` (S and V) and :class:`PassSettings` (synthesis), together
:class:`FedBiPStepSettings`. ``fedbip-mixture`` runs the same client step and passes under the
same keys, declared once, in the ``fedbip`` table (its :attr:`MethodSettings.LENDER`): its own
table holds only its mixture and its DP upload. Espresso reuses the pairs'
:class:`PairSettings`, and every method that samples its images sizes them by
:class:`FreshNoiseSettings`.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Self

from pydantic import Field, field_validator, model_validator

from .flat import FlatConfig
from .policy import Guarantee

FEDBIP = "fedbip"  # the method whose table declares FedBiP's client step for its family
CLASS_SLOT = "{class}"  # where fedlmg's prompt takes the class name
# Class concepts per class at most: a sub-cluster per image of a 16-shot class.
MAX_CLASS_CLUSTERS = 16


class MethodSettings(FlatConfig):
    """One method's own run-config keys: the TOML table named after the method
    (``[tool.flwr.app.config.fedlmg]``), which Flower hands over as dotted keys
    (``fedlmg.batch-size``). A method without keys of its own has this empty one."""

    WHAT: ClassVar[str] = "method settings"
    # A method that runs another's step takes that step's keys from the other's table, where
    # they are declared once: (that method, the model of those keys); None: all in its own.
    LENDER: ClassVar[tuple[str, type[MethodSettings]] | None] = None

    @classmethod
    def borrowed_keys(cls) -> set[str]:
        """The keys this method takes from its lender's table."""
        return cls.LENDER[1].keys() if cls.LENDER else set()

    @classmethod
    def table_keys(cls) -> set[str]:
        """The keys of its own table (``[tool.flwr.app.config.<method>]``)."""
        return cls.keys() - cls.borrowed_keys()

    @property
    def guarantee(self) -> Guarantee | None:
        """The upload's (epsilon, delta)-DP guarantee per private image; None: it has none."""
        return None

    @property
    def private(self) -> bool:
        """Whether the upload is differentially private: then nothing leaves the client that its
        guarantee does not cover, its evaluation reply included."""
        return self.guarantee is not None


class FreshNoiseSettings(MethodSettings):
    """How many images the server makes per client for a method that samples them (from fresh
    noise, a mixture or conditions) rather than from one uploaded z(T) each."""

    images_per_class: int = Field(
        0,
        ge=0,
        description="Synthetic images per class per client; 0 = images-per-image x the "
        "client's images of that class (clipped to federation.max-images-per-class).",
    )
    images_per_image: int = Field(
        2,
        ge=1,
        description="With images-per-class = 0: synthetic images per private image. 2 = what "
        "FedBiP's defaults make (2 z(T) per image, 1 pass), so every method trains on as much.",
    )


class PairSettings(MethodSettings):
    """FedBiP's pairs (eq. 3): each image's latent mixed with another of its class,
    gamma ~ N(gamma-mean, gamma-std^2)."""

    gamma_mean: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Mean of gamma, an image's own share of its mix with a same-class partner "
        "(eq. 3; each drawn gamma is clipped to [0, 1]).",
    )
    gamma_std: float = Field(0.1, ge=0.0, description="Standard deviation of gamma.")


class InstanceSettings(PairSettings):
    """FedBiP's instance level (eq. 3): z(T) of the pairs, uploaded one per row."""

    latent_dtype: Literal["float32", "float16"] = Field(
        "float32", description="The dtype z(T) is uploaded in (float16: half the bytes)."
    )
    latents_per_image: int = Field(
        1,
        ge=1,
        description="Independent z(T) per private image (each its own partner, gamma and "
        "noise). With k the upload is k times larger and the server's multiplier applies to "
        "all k*N: FedBiP-M as k=5, multiplier=1 instead of k=1, multiplier=5.",
    )


class ConceptSettings(MethodSettings):
    """FedBiP's concept level (eq. 4): S and V learned with the diffusion loss, all else frozen."""

    class_clusters: int = Field(
        1,
        ge=1,
        le=MAX_CLASS_CLUSTERS,
        description="Class concepts per class: >1 splits each class's images into this many "
        "sub-clusters (a public encoder's features) and learns one V per sub-cluster.",
    )
    concept_space: Literal["token", "hidden"] = Field(
        "token",
        description="token = input token embeddings (paper); "
        "hidden = text-encoder output states (authors' code).",
    )
    concept_lr: float = Field(
        0.1, gt=0.0, description="Adam lr, in units of the concept space's coordinate scale."
    )
    concept_epochs: int = Field(
        50, ge=0, description="Epochs of concept learning over the client's images."
    )
    concept_batch_size: int = Field(8, ge=1, description="Images per concept-learning step.")


class PassSettings(MethodSettings):
    """FedBiP's synthesis (eq. 5): passes over every z(T), each with its own perturbed S."""

    multiplier: int = Field(
        2,
        ge=1,
        description="Passes over every z(T), each with its own perturbed S: the images each "
        "z(T) gives. FedBiP-S / M / L are 2 / 5 / 10 z(T) per image (latents-per-image) with "
        "multiplier = 1; multiplier = 2 with one z(T) per image is the paper's multiplier, the "
        'benchmark\'s "FedBiP-S, 2 passes of one z(T)".',
    )
    eta_std: float = Field(
        0.1,
        ge=0.0,
        description="sigma of the perturbation S + eta, in units of the concept space's "
        "coordinate scale.",
    )


class FedBiPStepSettings(InstanceSettings, ConceptSettings, PassSettings):
    """FedBiP's client step (z(T), S and V) and its passes: what fedbip and fedbip-mixture run
    alike, set once in table ``fedbip``."""


class FedBiPSettings(FedBiPStepSettings):
    """FedBiP's own run-config keys (table ``fedbip``)."""

    WHAT: ClassVar[str] = "fedbip settings"

    synthesis_start: Literal["uploaded", "fresh-noise"] = Field(
        "uploaded",
        description="Denoise from each uploaded z(T) (the method), or from fresh noise with "
        "the learned concepts only (the paper's concept-only ablation).",
    )


class MixtureSettings(MethodSettings):
    """How a client summarizes its z(T) per class."""

    components: int = Field(4, ge=1, description="Gaussians per class (Espresso: 4; 2-4 plateau).")
    rows_per_component: int = Field(
        4,
        ge=1,
        description="At most one component per this many z(T) of a class, so no "
        "component is fitted to a handful of rows (its mean would nearly be one private z(T)).",
    )


class DPMixtureSettings(MixtureSettings):
    """The opt-in DP upload of a mixture's class statistics (docs/dp.md says, per method,
    which tensors its guarantee covers)."""

    dp_epsilon: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="> 0: an (epsilon, dp-delta)-DP upload per private "
        "image (docs/dp.md): per class one Gaussian, its mean the noisy mean of the clipped "
        "z(T) (one per image), its variance the forward process's; counts noisy too. 0: off. At "
        "most 100: beyond that no guarantee means anything, and the accountant's grid grows "
        "without bound.",
    )
    dp_delta: float = Field(1e-5, gt=0.0, lt=1.0, description="The DP upload's delta.")
    dp_clip: float = Field(
        1.25,
        gt=0.0,
        description="The DP upload clips each z(T) to this many times sqrt(D) "
        "(an honest z(T) at T near 1000 has norm about sqrt(D)).",
    )

    @property
    def guarantee(self) -> Guarantee | None:
        return Guarantee(self.dp_epsilon, self.dp_delta) if self.dp_epsilon > 0 else None


class FedLDSettings(DPMixtureSettings, FreshNoiseSettings):
    """FedLD's own run-config keys (table ``fedld``)."""

    WHAT: ClassVar[str] = "fedld settings"

    noisings: int = Field(2, ge=1, description="z(T) per private image the mixture is fitted to.")


class FedBiPMixtureSettings(DPMixtureSettings, FedBiPStepSettings):
    """FedBiP's mixture mode's settings: FedBiP's client step and passes, from table
    ``fedbip``, and its own run-config keys (table ``fedbip-mixture``), the mixture and the DP
    upload. Its DP upload covers S and V too, learned by DP-SGD (the dp-grad-clip,
    dp-sample-rate and dp-concept-share below), and its mixture is fitted to one unmixed z(T)
    per image."""

    WHAT: ClassVar[str] = "fedbip-mixture settings"
    LENDER: ClassVar[tuple[str, type[MethodSettings]] | None] = (FEDBIP, FedBiPStepSettings)

    dp_grad_clip: float = Field(
        1e-3,
        gt=0.0,
        description="DP-SGD's clip: the L2 norm of each image's gradient with "
        "respect to the concept shifts u (S and V's together). Depends on the model: 1e-3 is "
        "about the miniature's median per-image norm in token space (7.5e-4).",
    )
    dp_sample_rate: float = Field(
        0.08,
        gt=0.0,
        le=1.0,
        description="DP-SGD's Poisson sampling rate q: each step takes "
        "each image with probability q, ceil(1 / q) steps an epoch. A setting, not "
        "concept-batch-size / N, so that the header does not give away N (0.08: about 8 of the "
        "miniature's 96 images).",
    )
    dp_concept_share: float = Field(
        0.5,
        gt=0.0,
        lt=1.0,
        description="The concepts' part of epsilon when each release is "
        "calibrated on its own; both noise multipliers are then scaled by one factor so that "
        "the two composed are exactly (epsilon, dp-delta)-DP.",
    )


class EspressoSettings(MixtureSettings, PairSettings, FreshNoiseSettings):
    """Espresso's own run-config keys (table ``espresso``)."""

    WHAT: ClassVar[str] = "espresso settings"

    clusters: int = Field(
        4, ge=1, description="Sub-clusters, and so conditions, per class (J; the paper: 4)."
    )
    noisings: int = Field(2, ge=1, description="z(T) per private image the mixture is fitted to.")
    epochs: int = Field(
        10, ge=0, description="Epochs of condition learning over the client's images."
    )
    lr: float = Field(
        0.1, gt=0.0, description="Adam lr, in units of the hidden space's coordinate scale."
    )
    batch_size: int = Field(8, ge=1, description="Images per condition-learning step.")
    z_sampling: bool = Field(True, description="Z-Sampling's zigzag at the early timesteps.")
    z_threshold: int = Field(
        800, ge=0, le=1000, description="Zigzag at every timestep above this (T_z)."
    )
    z_inverse_guidance: float = Field(
        0.0,
        ge=0.0,
        description="Guidance of the inversion step (g2; the paper keeps it below "
        "the run's guidance).",
    )


class FedLMGSettings(FreshNoiseSettings):
    """FedLMG's own run-config keys (table ``fedlmg``)."""

    WHAT: ClassVar[str] = "fedlmg settings"

    local_epochs: int = Field(30, ge=1, description="Epochs of each client's own classifier.")
    variant: Literal["paper", "code"] = Field(
        "paper",
        description="paper = eq. 10 (eps shifted by sqrt(1 - abar_t) * step * grad, "
        "descending the loss), w_BN 0.2, "
        "distillation KL(student || teacher) as eqs. 12-13 write it; code = the authors' code "
        "(x_t -= step * grad, then a fresh noise estimate at the edited x_t; w_BN 0.1; soft "
        "cross-entropy to the teacher).",
    )
    prompt: str = Field(
        "an image of {class}",
        description="the class-only prompt the server samples with; {class} is the "
        'class name (paper: "an image of {class}").',
    )
    guidance_scale: float = Field(
        3.0, ge=1.0, description="classifier-free guidance scale (paper: 3)."
    )
    guidance_step: float = Field(
        1.0,
        ge=0.0,
        description="multiplies the gradient of CE + w_BN * L_BN w.r.t. x_t at every "
        "step (paper and code: 1, at Stable Diffusion's scale); 0 = no local-model guidance.",
    )
    noise_edits: int = Field(
        10,
        ge=0,
        description="gradient steps on the BN loss that edit the initial noise before "
        "sampling (Algorithm 1's M; the paper gives no number, the code makes 10).",
    )
    edit_step: float = Field(
        0.1,
        ge=0.0,
        description="each noise edit is x_T -= edit-step * grad L_BN (Algorithm 1's "
        "eta; the code's step, 1 x grad of 0.1 L_BN, is 0.1).",
    )
    batch_size: int = Field(
        8,
        ge=1,
        description="images per guided batch; each step back-propagates through the "
        "UNet, the VAE decoder and the client's classifier, so memory grows with it.",
    )
    global_: Literal["ft", "md", "sd"] = Field(
        "md",
        alias="global",
        description="how the global model learns from the synthetic set: ft = "
        "cross-entropy only (eq. 11), md = plus distillation from the mean of all clients' "
        "models (eq. 12, the paper's best on DomainNet), sd = plus distillation from the "
        "model of the client that generated the image (eq. 13).",
    )
    kd_weight: float = Field(
        1.0,
        ge=0.0,
        description="w_MD / w_SD, the distillation term's weight (the paper gives no "
        "number; the code uses 1).",
    )

    @field_validator("prompt")
    @classmethod
    def _one_class_slot(cls, prompt: str) -> str:
        if prompt.count(CLASS_SLOT) != 1:
            raise ValueError(f"must contain {CLASS_SLOT} exactly once")
        return prompt


class OSCARSettings(FreshNoiseSettings):
    """OSCAR's own run-config keys (table ``oscar``)."""

    WHAT: ClassVar[str] = "oscar settings"

    captioner: str = Field(
        "models/miniature-captioner",
        description="The clients' frozen captioner, a local folder or hub id: a BLIP "
        "captioning model (e.g. Salesforce/blip-image-captioning-base, the paper's) or the "
        "miniature captioner's folder (its stand-in on the miniature LDM).",
    )
    captions_per_image: int = Field(
        1, ge=1, description="Captions sampled per private image (OSCAR's code: 1)."
    )


class LocalSettings(MethodSettings):
    """Local's own run-config keys (table ``local``)."""

    WHAT: ClassVar[str] = "local settings"

    epochs: int = Field(30, ge=1, description="Epochs of each client's own classifier.")


class FedAvgSettings(MethodSettings):
    """FedAvg's own run-config keys (table ``fedavg``)."""

    WHAT: ClassVar[str] = "fedavg settings"

    rounds: int = Field(10, ge=1, description="Rounds of Flower's FedAvg.")
    local_epochs: int = Field(2, ge=1, description="Local epochs per round.")
    part: Literal["all", "head"] = Field(
        "all",
        description="What is federated. all: the whole ResNet-18 from classifier.init, "
        "trained with the shared classifier recipe. head: only a linear head (512 -> classes) on "
        "the frozen backbone shipped with the base model (FedPFT's encoder, the Flower FedPFT "
        "baseline's comparison), trained on the client's features with FedPFT's head recipe "
        "(AdamW, fedpft.head-lr and fedpft.head-batch-size; local-epochs per round); only the "
        "head's weight and bias travel.",
    )


# Covariance types a FedPFT upload may carry; "full" and "tied" are refused with this reason.
FEDPFT_COVARIANCES = ("spherical", "diag")


class FedPFTSettings(MethodSettings):
    """FedPFT's own run-config keys (table ``fedpft``): the client's per-class Gaussian
    mixtures of its features (scikit-learn's GaussianMixture; the Flower baseline's defaults),
    the server's linear head trained on draws from them, and the opt-in DP upload."""

    WHAT: ClassVar[str] = "fedpft settings"

    components: int = Field(
        1,
        ge=1,
        le=64,
        description="Gaussians per class (the Flower baseline: 1); a class "
        "with fewer images gets one per image, the rest weight-0 padding.",
    )
    covariance_type: str = Field(
        "spherical",
        description="spherical (one variance per component, the baseline's) or "
        "diag (one per feature).",
    )
    tol: float = Field(1e-12, gt=0.0, description="EM's convergence tolerance (the baseline's).")
    max_iter: int = Field(
        1000, ge=1, description="At most this many EM iterations (the baseline's)."
    )
    draws_per_image: int = Field(
        10,
        ge=1,
        description="Features the server draws per claimed image (each class's count "
        "clipped to federation.max-images-per-class); the baseline draws 1.",
    )
    head_epochs: int = Field(
        50, ge=1, description="Epochs of the server's linear head over the draws."
    )
    head_lr: float = Field(
        1e-3, gt=0.0, description="AdamW's lr for the head (the baseline's optimiser)."
    )
    head_batch_size: int = Field(32, ge=1, description="Draws per step (the baseline's 32).")
    dp_epsilon: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="> 0: an (epsilon, dp-delta)-DP upload per private "
        "image (docs/peers.md): per class one Gaussian from dp.py's noisy sum, sum of squares "
        "and count of the clipped features. Needs components = 1. 0: off.",
    )
    dp_delta: float = Field(1e-5, gt=0.0, lt=1.0, description="The DP upload's delta.")
    dp_clip: float = Field(
        1.0,
        gt=0.0,
        description="The DP upload clips each feature vector to L2 norm this many "
        "times sqrt(D) (D = 512).",
    )

    @property
    def guarantee(self) -> Guarantee | None:
        return Guarantee(self.dp_epsilon, self.dp_delta) if self.dp_epsilon > 0 else None

    @field_validator("covariance_type")
    @classmethod
    def _supported_covariance(cls, value: str) -> str:
        if value in ("full", "tied"):
            raise ValueError(
                f"{value!r} covariances are not supported: one is D x D = 262,144 floats (1 MiB) "
                "and needs more images of a class than D = 512 to be well-posed; use 'spherical' "
                "(the baseline's) or 'diag'"
            )
        if value not in FEDPFT_COVARIANCES:
            raise ValueError(f"must be 'spherical' or 'diag', not {value!r}")
        return value

    @model_validator(mode="after")
    def _dp_is_one_gaussian(self) -> Self:
        if self.dp_epsilon and self.components != 1:
            raise ValueError(
                f"the DP upload (dp-epsilon > 0) releases one Gaussian per class: set components = 1, not {self.components}"
            )
        return self


DEFAULT_METHOD = FEDBIP  # the run config's method when it names none
# Every method by name, with the model of its table (the run config's ``method`` accepts
# exactly these names; each has its class in fedbip_flwr.methods).
METHOD_SETTINGS: dict[str, type[MethodSettings]] = {
    "central": MethodSettings,
    "espresso": EspressoSettings,
    "fedavg": FedAvgSettings,
    FEDBIP: FedBiPSettings,
    "fedbip-mixture": FedBiPMixtureSettings,
    "fedld": FedLDSettings,
    "fedpft": FedPFTSettings,
    "fedlmg": FedLMGSettings,
    "local": LocalSettings,
    "oscar": OSCARSettings,
    "prompts-only": FreshNoiseSettings,
}
