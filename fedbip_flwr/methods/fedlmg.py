"""FedLMG (peer; Yang et al., ICML'25): each client uploads its own trained classifier, once;
the server samples with the LDM guided at every step by that client's model, then trains the
global model on the synthetic set (FT) or also distils the clients' models into it (MD, SD).

Client: :func:`~fedbip_flwr.methods.local.train_local_classifier` (ResNet-18, the shared
recipe over ``local-epochs``): its weights and BatchNorm statistics, plus how many images it
holds per class (how many the server makes: ``images-per-class`` or FedBiP's count).

Server, per client and class y, from fresh noise, prompt ``fedlmg.prompt`` with
classifier-free guidance, on a DDIM schedule:

1. the initial noise is edited ``fedlmg.noise-edits`` times, x_T -= eta grad L_BN
   (Algorithm 1, lines 6-11);
2. at every step, x0_hat = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t) (eq. 8) is decoded by
   the VAE, resized to the classifier's input and scored by the client's model in eval mode:
   L = CE(F(x0_hat), y) + w_BN sum_l ||mu_l - mu_kl|| + ||sigma2_l - sigma2_kl|| (eqs. 7, 9),
   with mu_l, sigma2_l the statistics of the l-th BatchNorm layer's input over ONE image's
   pixels (statistics over the batch would make each image's loss depend on the others);
3. eps_hat = eps + sqrt(1 - abar_t) * step * grad_{x_t} L, then the DDIM step (variant
   ``code``: x_t -= step * grad, then a fresh noise estimate at the edited x_t).

Eq. 10 as printed, eps - sqrt(1 - abar_t) grad L, puts the gradient of the LOSS where eq. 2
(classifier guidance) has that of log p(y | x): it raises the loss (the tests see CE and L_BN
rise). Eq. 2 with log p = -L, which eq. 10 instantiates, is the sign used here.

DDIM (built from the LDM's own scheduler config) steps from (x_t, eps) alone; PNDM's multistep
history would mix noise estimates made before an edit of x_t with ones made after it.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..classifier import Distillation, Divergence, Teacher, _prepare
from ..concepts import unconditional_embedding
from ..config import FedBiPConfig
from ..ldm import LDM
from ..method_settings import CLASS_SLOT, FedLMGSettings
from ..policy import UploadKind
from ..progress import Progress
from ..seeds import client_seed
from ..server import keyed_shard, shard_key
from ..synthesis import decode_latents, encode_texts
from ..upload import PayloadError, UploadMeta
from .base import (
    ClientJob,
    Method,
    ServerJob,
    Upload,
    check_class_counts,
    class_counts,
    common_meta,
    encode_upload,
    fresh_noise_labels,
    register,
)
from .local import check_classifier, classifier_names, classifier_tensors, train_local_classifier

if TYPE_CHECKING:
    from diffusers import DDIMScheduler

PREFIX = "classifier."  # the uploaded model's tensors, beside class_counts
Shift = Literal["noise", "latents"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """Where the paper and its authors' code differ (``fedlmg.variant``)."""

    bn_weight: float  # w_BN
    shift: Shift  # noise: eqs. 2 / 10 shift eps by sqrt(1 - abar_t) * grad; latents: x_t -= grad
    divergence: Divergence  # MD / SD's distillation term


VARIANTS = {
    "paper": Variant(bn_weight=0.2, shift="noise", divergence="kl-student-teacher"),
    "code": Variant(bn_weight=0.1, shift="latents", divergence="soft-ce"),
}


class FedLMGMeta(UploadMeta):
    method: Literal["fedlmg"] = "fedlmg"


@dataclass(frozen=True)
class GuidanceSettings:
    num_inference_steps: int
    guidance_scale: float  # classifier-free guidance
    step: float  # multiplies grad_{x_t} L at every step; 0 = plain sampling
    bn_weight: float
    shift: Shift = "noise"
    noise_edits: int = 0
    edit_step: float = 0.0
    batch_size: int = 8
    classifier_size: int = 64


def guidance_settings(cfg: FedBiPConfig, own: FedLMGSettings) -> GuidanceSettings:
    variant = VARIANTS[own.variant]
    return GuidanceSettings(
        num_inference_steps=cfg.synthesis.num_inference_steps,
        guidance_scale=own.guidance_scale,
        step=own.guidance_step,
        bn_weight=variant.bn_weight,
        shift=variant.shift,
        noise_edits=own.noise_edits,
        edit_step=own.edit_step,
        batch_size=own.batch_size,
        classifier_size=cfg.classifier.image_size,
    )


# --- the guidance loss (eqs. 7, 9) --------------------------------------------------------------


def bn_layers(model: nn.Module) -> list[nn.BatchNorm2d]:
    """The layers eq. 7 sums over: per-image statistics need pixels, so BatchNorm2d (the only
    kind ResNet-18 has)."""
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


def per_image_statistics(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, C) mean and (biased) variance of each image's (N, C, H, W) features over its own
    pixels."""
    return features.mean((2, 3)), features.var((2, 3), unbiased=False)


def forward_with_bn_inputs(
    model: nn.Module, images: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model's logits and, for every BatchNorm layer in order, its input's per-image
    statistics (hooks on the layers' inputs: the running statistics describe those)."""
    stats: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = [
        layer.register_forward_pre_hook(
            lambda _m, inputs: stats.append(per_image_statistics(inputs[0]))
        )
        for layer in bn_layers(model)
    ]
    try:
        logits = model(images)
    finally:
        for handle in handles:
            handle.remove()
    return logits, stats


@dataclass(frozen=True)
class LossTerms:
    ce: torch.Tensor  # (N,) CE(F(x0_hat), y)
    bn: torch.Tensor  # (N,) L_BN, eq. 7

    def total(self, bn_weight: float) -> torch.Tensor:
        """Eq. 9, per image."""
        return self.ce + bn_weight * self.bn


def guidance_terms(classifier: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> LossTerms:
    """Each image's CE to its label and its L_BN against the classifier's running statistics:
    sum over layers of ||mu_l - running_mean_l||_2 + ||sigma2_l - running_var_l||_2 (eq. 7).
    The classifier must be in eval mode, so no image's score depends on another's."""
    logits, stats = forward_with_bn_inputs(classifier, images)
    ce = F.cross_entropy(logits.float(), labels.to(logits.device), reduction="none")
    bn = sum(
        (
            (mean - layer.running_mean).norm(dim=1) + (var - layer.running_var).norm(dim=1)
            for layer, (mean, var) in zip(bn_layers(classifier), stats, strict=True)
        ),
        torch.zeros_like(ce),
    )
    return LossTerms(ce=ce, bn=bn.float())


# --- the guided sampler (eqs. 8, 10, Algorithm 1) -----------------------------------------------


def ddim_scheduler(ldm: LDM) -> DDIMScheduler:
    """DDIM on the LDM's own noise schedule, stepping from epsilon (the sampler converts a
    v-prediction) without clipping x0: its state is (x_t, eps), so an edit of x_t is safe."""
    from diffusers import DDIMScheduler

    return DDIMScheduler.from_config(
        ldm.scheduler.config, prediction_type="epsilon", clip_sample=False, thresholding=False
    )


class GuidedSampler:
    """One client's sampler: the frozen LDM steered by that client's classifier."""

    def __init__(self, ldm: LDM, classifier: nn.Module, settings: GuidanceSettings) -> None:
        self.ldm, self.settings = ldm, settings
        self.classifier = classifier.to(ldm.device).eval().requires_grad_(False)
        self.scheduler = ddim_scheduler(ldm)
        self.abar = self.scheduler.alphas_cumprod.to(ldm.device)

    def epsilon(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The classifier-free-guided noise estimate at (x_t, t), float32, differentiable."""
        unet, scale = self.ldm.unet, self.settings.guidance_scale
        guided = scale > 1.0
        x_in = (torch.cat([x, x]) if guided else x).to(unet.dtype)
        out = unet(x_in, t.to(x.device), encoder_hidden_states=context).sample.float()
        if guided:
            uncond, cond = out.chunk(2)
            out = uncond + scale * (cond - uncond)
        if self.ldm.scheduler.config.prediction_type == "v_prediction":
            abar = self.abar[t]
            out = abar.sqrt() * out + (1 - abar).sqrt() * x
        return out

    def predicted_x0(self, x: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Eq. 8."""
        abar = self.abar[t]
        return (x - (1 - abar).sqrt() * eps) / abar.sqrt()

    def decoded_x0(self, x: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x0_hat as the classifier sees it: decoded, in [-1, 1], at its input size."""
        vae = self.ldm.vae
        x0 = self.predicted_x0(x, eps, t) / float(vae.config.scaling_factor)
        images = vae.decode(x0.to(vae.dtype)).sample.float().clamp(-1.0, 1.0)
        return _prepare(images, self.settings.classifier_size)

    def loss_gradient(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        context: torch.Tensor,
        labels: torch.Tensor,
        *,
        bn_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, LossTerms]:
        """(eps, grad_{x_t} L, the loss terms) at x_t, the gradient through the UNet, the VAE
        decoder and the classifier; L is eq. 9, or L_BN alone for the noise edits."""
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            eps = self.epsilon(x, t, context)
            terms = guidance_terms(self.classifier, self.decoded_x0(x, eps, t), labels)
            loss = terms.bn if bn_only else terms.total(self.settings.bn_weight)
            (grad,) = torch.autograd.grad(loss.sum(), x)  # per-image losses: per-image gradients
        return eps.detach(), grad, LossTerms(terms.ce.detach(), terms.bn.detach())

    @torch.no_grad()
    def sample(
        self, noise: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """z(0) from ``noise`` (N, C, h, w) toward ``labels`` with conditioning ``cond``."""
        s = self.settings
        context = torch.cat([uncond.expand_as(cond), cond]) if s.guidance_scale > 1.0 else cond
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(s.num_inference_steps)
        x = noise.to(self.ldm.device, torch.float32) * scheduler.init_noise_sigma
        for _ in range(s.noise_edits):
            _, grad, _ = self.loss_gradient(
                x, scheduler.timesteps[0], context, labels, bn_only=True
            )
            x = x - s.edit_step * grad
        for t in scheduler.timesteps:
            if s.step == 0.0:
                eps = self.epsilon(x, t, context)
            elif s.shift == "noise":
                eps, grad, _ = self.loss_gradient(x, t, context, labels)
                eps = eps + (1 - self.abar[t]).sqrt() * s.step * grad  # eq. 2, log p = -L
            else:
                _, grad, _ = self.loss_gradient(x, t, context, labels)
                x = x - s.step * grad
                eps = self.epsilon(x, t, context)
            x = scheduler.step(eps, t, x, eta=0.0).prev_sample
        return x


def iter_guided(
    ldm: LDM,
    classifier: nn.Module,
    cond_per_class: torch.Tensor,
    labels: torch.Tensor,
    settings: GuidanceSettings,
    generator: torch.Generator,
    on_batch: Callable[[int], None] | None = None,
    vae_batch_size: int = 8,
) -> Iterator[torch.Tensor]:
    """Images (batches in [-1, 1], float32, CPU) guided by one client's classifier, in label
    order, the noise drawn from ``generator`` batch by batch."""
    sampler = GuidedSampler(ldm, classifier, settings)
    uncond = unconditional_embedding(ldm)
    for batch in labels.split(settings.batch_size):
        noise = torch.randn((len(batch), *ldm.latent_shape()), generator=generator)
        cond = cond_per_class[batch.to(cond_per_class.device)].to(ldm.device, ldm.dtype)
        z0 = sampler.sample(noise, cond, uncond, batch.to(ldm.device))
        if on_batch is not None:
            on_batch(len(batch))
        yield decode_latents(ldm, z0, vae_batch_size)


# --- the global model's soft targets (eqs. 12, 13) ----------------------------------------------


def mean_teacher(models: Mapping[str, nn.Module]) -> Teacher:
    """MD (eq. 12): the mean of all clients' softmax outputs, returned as its log (logits)."""

    def targets(x: torch.Tensor, _sources: list[str]) -> torch.Tensor:
        log_p = torch.stack([m.to(x.device)(x).float().log_softmax(-1) for m in models.values()])
        return log_p.logsumexp(0) - math.log(len(models))

    return targets


def source_teacher(models: Mapping[str, nn.Module]) -> Teacher:
    """SD (eq. 13): each row's logits from the model of the client that generated it."""

    def targets(x: torch.Tensor, sources: list[str]) -> torch.Tensor:
        out: torch.Tensor | None = None
        for client_id in sorted(set(sources)):
            rows = torch.tensor(
                [i for i, s in enumerate(sources) if s == client_id], device=x.device
            )
            logits = models[client_id].to(x.device)(x[rows]).float()
            if out is None:
                out = logits.new_empty((len(x), logits.shape[-1]))
            out[rows] = logits
        if out is None:
            raise ValueError("no rows to distil")
        return out

    return targets


# --- the method --------------------------------------------------------------------------------


def class_prompts(own: FedLMGSettings, class_names: list[str]) -> list[str]:
    return [own.prompt.replace(CLASS_SLOT, name) for name in class_names]


def guided_key(
    upload: Upload,
    settings: GuidanceSettings,
    prompts: list[str],
    ldm: LDM,
    seed: int,
    labels: torch.Tensor,
) -> str:
    """The key of a client's guided shard: the base model, the seed, the settings, the
    prompts, the labels and every byte of the uploaded model."""
    names = sorted(upload.tensors)
    knobs = (ldm.fingerprint, seed, asdict(settings), prompts, names)
    return shard_key(knobs, labels, *(upload.tensors[name] for name in names))


@register
class FedLMG(Method):
    name = "fedlmg"
    # uploads: its own classifier and class counts
    uploads = frozenset({UploadKind.CLASSIFIER, UploadKind.COUNTS})
    settings: FedLMGSettings
    meta_model = FedLMGMeta
    tensor_names = ("class_counts",)  # and the classifier's own names under PREFIX

    def upload(self, job: ClientJob) -> tuple[bytes, dict[str, Any]]:
        started = time.perf_counter()
        model = train_local_classifier(job, self.settings.local_epochs)
        tensors = {PREFIX + name: t for name, t in classifier_tensors(model).items()}
        tensors["class_counts"] = class_counts(job.data.labels, len(job.data.classes))
        blob = encode_upload(FedLMGMeta(**common_meta(job)), tensors)
        return blob, {"seconds-local-training": time.perf_counter() - started}

    def expected_tensors(self, server: ServerJob) -> tuple[str, ...]:
        names = classifier_names(len(server.class_names))
        return (*self.tensor_names, *(PREFIX + name for name in names))

    def check(self, upload: Upload, server: ServerJob) -> Upload:
        check_class_counts(upload, server)
        model = check_classifier(upload, PREFIX)
        for layer_name, layer in model.named_modules():
            if isinstance(layer, nn.BatchNorm2d) and bool((layer.running_var < 0).any()):
                raise PayloadError(f"{PREFIX}{layer_name}.running_var must be non-negative")
        return Upload(upload.meta, upload.tensors, content=model.requires_grad_(False))

    def train_set(
        self,
        uploads: Mapping[str, Upload],
        server: ServerJob,
        shard_path: Callable[[str, int], Path],
    ) -> dict[str, list[Path]]:
        cfg, ldm = server.cfg, server.ldm()
        settings = guidance_settings(cfg, self.settings)
        prompts = class_prompts(self.settings, server.class_names)
        cond = encode_texts(ldm, prompts)
        labels = {
            cid: fresh_noise_labels(u.tensors["class_counts"], self.settings, cfg.class_cap)
            for cid, u in uploads.items()
        }
        out = {}
        progress = Progress(log, "guided sampling", sum(len(v) for v in labels.values()), "images")
        for client_id, upload in sorted(uploads.items()):
            seed = client_seed(cfg.seed, client_id)
            batches = functools.partial(
                iter_guided,
                ldm,
                upload.content,
                cond,
                labels[client_id],
                settings,
                torch.Generator().manual_seed(seed),
                progress.update,
                cfg.ldm.vae_batch_size,
            )
            key = guided_key(upload, settings, prompts, ldm, seed, labels[client_id])
            path = keyed_shard(
                shard_path(client_id, 0),
                key,
                labels[client_id],
                batches,
                mode=server.shard_mode,
                on_reuse=progress.update,
            )
            out[client_id] = [path]
        progress.finish()
        return out

    def teacher(self, uploads: Mapping[str, Upload], server: ServerJob) -> Distillation | None:
        """FT: none; MD: the mean of every client's model; SD: each image's own client's."""
        own = self.settings
        if own.global_ == "ft":
            return None
        models = {client_id: upload.content for client_id, upload in sorted(uploads.items())}
        targets = mean_teacher(models) if own.global_ == "md" else source_teacher(models)
        return Distillation(targets, VARIANTS[own.variant].divergence, own.kd_weight)
