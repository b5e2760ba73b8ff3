"""Can the server tell which images a client held from its upload alone (issue 49)?

Upload kinds (``--kinds``): ``zT``, FedBiP's z(T) rows; ``fedbip-mixture``, ``espresso`` and
``fedld``, the per-class diagonal Gaussian mixtures those methods fit to such rows (mixed
same-class pairs, and plain z(T) with no partner) instead of uploading them; ``concepts`` and
``espresso-conditions``, FedBiP's learned concepts and Espresso's learned cross-attention
conditions, by how far they lower a candidate's diffusion loss below the plain prompt's, at the
run's budget and overfitted to ``--overfit-shots`` (the positive control), at ``--large-size``
on ``--large-model`` (models/miniature-ldm-256px, its UNet continued at that size: the shipped
one, trained at 4x16x16 only, fails the control there); ``fedbip-mixture-dp``, the mixture
mode's DP upload as the method makes and the server accepts it, its class statistics by the
mixture tests and its DP-SGD concepts by the loss-ratio test; ``fedld-dp`` and
``fedbip-mixture-dp-stats``, a DP release of class statistics alone; ``fedpft`` and ``oscar``,
a mean per class of what the server can compute from an image; ``fedlmg``, a
client's own trained classifier (Local's and FedLMG's upload, one client step), by its loss
and, with ``--reference-models``, offline LiRA, at ``--local-epochs`` (the benchmark's budget:
150) from ``--classifier-init``; ``fedavg`` and ``fedavg-head``, every reply of a FedAvg
federation (one client a domain, the whole ResNet-18 or its head alone), by its loss in the
first and last round and by its loss drop below the global model the server sent, summed over
``--fedavg-rounds`` (the benchmark's: 25).

The server holds every client's upload (rows z(T) = sqrt(abar_T) zbar + sqrt(1 - abar_T) eps,
zbar = gamma z_i(0) + (1 - gamma) z_i'(0), with their class labels) and the base model's VAE.
It encodes a candidate image, centres it by its class's mean over public reference images of
the domain it encoded itself, and scores it against the upload's rows of its class
(:func:`fedbip_tools.privacy.zT_membership_scores`): the likelihood ratio of a row model,
whitened by the reference's within-class spread (the attack), the same unwhitened, and the max
correlation of the first measurement. Members are the images of R clients of each
domain of the default federation (``[tool.flwr.app.config]`` of pyproject.toml: 16 shots per
class, 6 classes, so 96 per client), each client running the real instance step
(:func:`fedbip_flwr.instance.personalize_instances`) with the run's T (the default sampler's
first timestep) and ``latents-per-image`` K (the default's and ``--draws``); non-members are as
many unseen images of the same domain and classes (the test split), each client's share scored
against that client's upload; reference images are the pretraining split (no member, no
non-member). Scores are pooled over the R clients of a domain.

Variants: ``rows``: the upload's rows as given, shuffled (what a client that shuffles uploads;
the statistic does not depend on the order, checked); ``oracle``: rows known to be one image's
(an upload in today's order, row k N + i from image i) grouped. Sizes: the miniature's 64 px
(4x16x16 latents, its schedule, T of the default sampler) and, without Stable Diffusion's
weights, the same world rendered at ``--large-size`` (256 px: the miniature VAE, fully
convolutional, gives 4x64x64 latents, SD's latent size), noised with SD v1-4's own scheduler
config (models/sd-v1-4-architecture) at T = 999 and at PNDM-25's first timestep (961).

    OMP_NUM_THREADS=1 python scripts/server_attacks.py [--out benchmarks/server_attacks.json]
    python scripts/server_attacks.py --summarize benchmarks/server_attacks.json \
        benchmarks/server_attacks_seed1.json benchmarks/server_attacks_seed2.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path
from typing import cast, get_args

import torch
from diffusers import PNDMScheduler, SchedulerMixin
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from tqdm import tqdm

from fedbip_flwr import methods, shapes
from fedbip_flwr.captioner import load_captioner
from fedbip_flwr.classifier import evaluate
from fedbip_flwr.clusters import public_encoder
from fedbip_flwr.conditions import initial_conditions
from fedbip_flwr.config import ClassifierConfig, FedBiPConfig
from fedbip_flwr.dataset import ClientSet
from fedbip_flwr.instance import (
    InstanceLatents,
    encode_images,
    forward_noise,
    noise_instances,
    upload_order,
)
from fedbip_flwr.ldm import ALLOW_CPU_ENV, LDM, cpu_full_size_allowed, load_for_run
from fedbip_flwr.methods import fedavg, fedbip_mixture, fedld
from fedbip_flwr.methods.base import ClientJob, ServerJob
from fedbip_flwr.methods.fedbip import fedbip_settings, personalize
from fedbip_flwr.methods.fedpft import fit_class_mixtures
from fedbip_flwr.methods.oscar import caption_images, class_conditioning
from fedbip_flwr.mixture import LatentMixture, fit_mixture, from_tensors
from fedbip_flwr.results import SENT_CONCEPT_LOSSES, SENT_IMAGES
from fedbip_flwr.sampler import Sampler
from fedbip_flwr.shared_concepts import Concepts
from fedbip_flwr.storage import write_json
from fedbip_flwr.synthesis import SynthesisSettings, concept_layout
from fedbip_tools import provenance
from fedbip_tools.benchmark import (
    CONCEPT_ATTACK,
    DP_MIXTURE,
    FEDAVG_KINDS,
    Bench,
    ConditioningSetting,
    Settings,
    classifier_key,
    fedavg_key,
    record_seed,
    variant_values,
)
from fedbip_tools.benchmark import VARIANTS as BENCHMARK_ROWS
from fedbip_tools.cli import project_run_config
from fedbip_tools.privacy import (
    LatentReference,
    class_mean_scores,
    concept_conditionings,
    conditioning_loss_ratio_scores,
    lira_offline_scores,
    loss_drop_scores,
    membership_result,
    mixture_membership_scores,
    zT_membership_scores,
)

ROOT = Path(__file__).resolve().parents[1]
SD_SCHEDULER = ROOT / "models" / "sd-v1-4-architecture"  # SD v1-4's scheduler_config.json
# name -> (statistic, whiten): the likelihood ratio whitened by the reference's spread (the
# attack), the same without whitening, and the first measurement's max correlation
STATISTICS = {
    "likelihood-ratio": ("likelihood-ratio", True),
    "likelihood-ratio/unwhitened": ("likelihood-ratio", False),
    "max-correlation": ("max-correlation", False),
}
VARIANTS = ("rows", "oracle")
MIXTURE_KINDS = ("fedbip-mixture", "fedld", "espresso")
MIXTURE_STATISTICS = ("likelihood-ratio", "mean-filter")
CONCEPTS = "concepts"
ESPRESSO = "espresso"
CONDITIONS = "espresso-conditions"  # Espresso's uploaded cross-attention conditions
CONDITIONING_KINDS = (CONCEPTS, CONDITIONS)  # loss-ratio tests, each with its positive control
MEAN_KINDS = ("fedpft", "oscar")  # uploads of a mean per class of what the server can compute
CLASSIFIER = "fedlmg"  # an upload of the client's own trained classifier
FEDAVG_TESTS = ("loss-first", "loss-last", "loss-drop")
# A DP upload's class statistics at any latent size and T, released by the method's own code
# under its own share of the budget (fedbip-mixture's concepts, DP-SGD at the rest, not run:
# the server tests the statistics): kind -> (method, its statistics' guarantee)
DP_RELEASES = {
    "fedld-dp": ("fedld", fedld.dp_stats_guarantee),
    "fedbip-mixture-dp-stats": ("fedbip-mixture", fedbip_mixture.dp_stats_guarantee),
}
KINDS = (
    "zT",
    *MIXTURE_KINDS,
    CONCEPTS,
    CONDITIONS,
    *MEAN_KINDS,
    DP_MIXTURE,
    CLASSIFIER,
    *FEDAVG_KINDS,
    *DP_RELEASES,
)
LATENT_KINDS = ("zT", *MIXTURE_KINDS, *DP_RELEASES)
PLAIN = {"gamma_mean": 1.0, "gamma_std": 0.0}  # z(T) of each image alone, no partner


def per_class_chunk(
    data: shapes.ImageSet, per_class: int, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``chunk * per_class .. (chunk + 1) * per_class`` of every class (class-major sets)."""
    keep = torch.cat(
        [
            (data.labels == y).nonzero().flatten()[chunk * per_class : (chunk + 1) * per_class]
            for y in range(len(data.classes))
        ]
    )
    return data.images[keep], data.labels[keep]


def attack(
    member_z0: torch.Tensor,
    non_member_z0: torch.Tensor,
    labels: torch.Tensor,
    non_labels: torch.Tensor,
    upload: torch.Tensor,
    upload_labels: torch.Tensor,
    n_images: int,
    draws: int,
    a: float,
    gamma: tuple[float, float],
    reference: LatentReference,
    generator: torch.Generator,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Scores of one client's members and its share of non-members, per variant and statistic.
    ``upload`` is in the client's order (row k N + i from image i)."""
    order = upload_order(len(upload), generator)  # as the client now uploads them
    shuffled, shuffled_labels = upload[order], upload_labels[order]
    groups = torch.arange(len(upload)) % n_images
    base = {
        "signal_scale": a,
        "reference": reference,
        "latents_per_image": draws,
        "gamma_mean": gamma[0],
        "gamma_std": gamma[1],
    }
    out = {}
    for name, (statistic, whiten) in STATISTICS.items():
        kwargs = {**base, "statistic": statistic, "whiten": whiten}
        for variant in VARIANTS:
            rows, row_labels, row_groups = (
                (shuffled, shuffled_labels, None)
                if variant == "rows"
                else (upload, upload_labels, groups)
            )
            out[f"{variant}/{name}"] = (
                zT_membership_scores(
                    member_z0, labels, rows, row_labels, groups=row_groups, **kwargs
                ),
                zT_membership_scores(
                    non_member_z0, non_labels, rows, row_labels, groups=row_groups, **kwargs
                ),
            )
        # the rows-as-given statistic must not depend on the order (shuffled vs today's)
        in_order = zT_membership_scores(member_z0, labels, upload, upload_labels, **kwargs)
        gap = float((in_order - out[f"rows/{name}"][0]).abs().max())
        assert gap < 1e-6 * max(1.0, float(in_order.abs().max())), (
            f"order changed the rows statistic by {gap}"
        )
    # the first measurement's centring: the upload rows' class mean over sqrt(abar)
    out["rows/max-correlation/upload-centred"] = tuple(
        zT_membership_scores(
            z, y, shuffled, shuffled_labels, signal_scale=a, statistic="max-correlation"
        )
        for z, y in ((member_z0, labels), (non_member_z0, non_labels))
    )
    return out


def mixture_attack(
    member_z0: torch.Tensor,
    non_member_z0: torch.Tensor,
    labels: torch.Tensor,
    non_labels: torch.Tensor,
    uploaded: LatentMixture,
    reference_mixture: LatentMixture,
    a: float,
    gamma: tuple[float, float],
    reference: LatentReference,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Scores of one client's members and its share of non-members against its mixture."""
    base = {
        "signal_scale": a,
        "reference": reference,
        "reference_mixture": reference_mixture,
        "gamma_mean": gamma[0],
        "gamma_std": gamma[1],
    }
    return {
        statistic: tuple(
            mixture_membership_scores(z, y, uploaded, statistic=statistic, **base)
            for z, y in ((member_z0, labels), (non_member_z0, non_labels))
        )
        for statistic in MIXTURE_STATISTICS
    }


def pair_mixing(own: object) -> dict[str, float]:
    """The gamma a method's z(T) rows mix same-class pairs with; :data:`PLAIN` without pairs."""
    if hasattr(own, "gamma_mean"):
        return {"gamma_mean": own.gamma_mean, "gamma_std": own.gamma_std}
    return PLAIN


def fitted_mixture(
    cfg: FedBiPConfig, kind: str, rows: InstanceLatents, generator: torch.Generator
) -> LatentMixture:
    """The mixture method ``kind`` fits to ``rows`` with the run's settings of its table."""
    own = cfg.settings_of(kind)
    return fit_mixture(
        rows.zT,
        rows.zT_labels,
        len(shapes.CLASSES),
        own.components,
        generator,
        rows_per_component=own.rows_per_component,
    )


def pool(pooled: dict[str, tuple[list, list]], scores: dict[str, tuple[torch.Tensor, ...]]) -> None:
    """Adds one client's member and non-member scores to its domain's, per attack."""
    for name, (members, others) in scores.items():
        pooled.setdefault(name, ([], []))
        pooled[name][0].append(members)
        pooled[name][1].append(others)


def dp_release_attacks(
    kind: str,
    epsilons: list[float],
    schedule: SchedulerMixin,
    t: int,
    reference: tuple[torch.Tensor, torch.Tensor, LatentReference],
    members: list[tuple[torch.Tensor, torch.Tensor]],
    non_members: list[tuple[torch.Tensor, torch.Tensor]],
    seed: int,
) -> dict[float, dict]:
    """Per epsilon, the mixture tests on ``kind``'s DP class statistics of each client's one
    plain z(T) per image at T = ``t`` (z(0) and labels per client in ``members``; its share of
    non-members beside), against one mixture fitted to the public reference's plain z(T)."""
    method, guarantee_of = DP_RELEASES[kind]
    flat = project_run_config()
    reference_z0, reference_labels, prior = reference
    alpha_bar = float(schedule.alphas_cumprod[t])
    generator = torch.Generator().manual_seed(seed)
    rows = noise_instances(
        schedule, reference_z0, reference_labels, t, **PLAIN, generator=generator
    )
    # epsilon changes no fit setting: one reference mixture for every epsilon
    reference_mixture = fitted_mixture(
        FedBiPConfig.from_flat(flat), method, rows, torch.Generator().manual_seed(seed)
    )
    out = {}
    for epsilon in epsilons:
        run = FedBiPConfig.from_flat({**flat, f"{method}.dp-epsilon": epsilon})
        own = run.settings_of(method)
        guarantee = guarantee_of(own, reference_z0[0].numel())
        pooled: dict[str, tuple[list, list]] = {}
        for r, ((z0, labels), (other_z0, other_labels)) in enumerate(zip(members, non_members)):
            generator = torch.Generator().manual_seed(seed + r * 101 + 7)
            z_t = forward_noise(schedule, z0, t, torch.randn(z0.shape, generator=generator))
            uploaded, _, _ = fedld.private_mixture(
                z_t,
                labels,
                len(shapes.CLASSES),
                guarantee,
                own.components,
                alpha_bar,
                generator,
                False,
            )
            scores = mixture_attack(
                z0,
                other_z0,
                labels,
                other_labels,
                uploaded,
                reference_mixture,
                math.sqrt(alpha_bar),
                (PLAIN["gamma_mean"], PLAIN["gamma_std"]),
                prior,
            )
            pool(pooled, scores)
        out[epsilon] = {
            "latent_shape": list(reference_z0.shape[1:]),
            "timestep": t,
            "epsilon": guarantee.epsilon,
            "noise_multiplier": guarantee.noise_multiplier,
            "clip": guarantee.clip,
            "clients": len(members),
            "attacks": {
                f"{kind}/{name}": membership_result(
                    torch.cat(m), torch.cat(n), statistic=name
                ).summary()
                for name, (m, n) in pooled.items()
            },
        }
    return out


def loss_ratio_budgets(
    args: argparse.Namespace, shots: int, epochs: int
) -> list[tuple[int, int, int]]:
    """(shots per class, epochs, clients) of a conditioning test: the run's budget with
    ``replicates`` clients (none when 0) and, unless ``--overfit-shots 0``, the overfitted
    positive control."""
    budgets = [(shots, epochs, args.replicates)] if args.replicates else []
    if args.overfit_shots:
        budgets.append((args.overfit_shots, args.overfit_epochs, 1))
    return budgets


def encoded_sides(
    ldm: LDM, sides: tuple[tuple[torch.Tensor, torch.Tensor], ...], vae_batch_size: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Each side's (images, labels) as (z(0), labels): what the server encodes a candidate to."""
    return tuple((encode_images(ldm.vae, images, vae_batch_size), y) for images, y in sides)


def attack_max_timestep(args: argparse.Namespace, upload_timestep: int) -> int:
    """The largest t the loss-ratio test draws: the upload's T (as the conditioning was
    learned) or ``--concept-max-timestep`` below it, where a conditioning's effect on the loss
    concentrates (the prompt matters little once z(t) is mostly noise)."""
    cap = args.concept_max_timestep
    return min(cap, upload_timestep) if cap else upload_timestep


def loss_ratio_sides(
    args: argparse.Namespace,
    ldm: LDM,
    states: tuple[torch.Tensor, torch.Tensor],
    sides: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    max_timestep: int,
) -> list[torch.Tensor]:
    """Each side's (members', unseen images') loss-ratio scores, from its (z(0), labels), under
    one client's plain and learned conditioning, with the same ``--concept-draws`` of (t, eps)
    for every side, t up to :func:`attack_max_timestep`."""
    return [
        conditioning_loss_ratio_scores(
            ldm,
            *states,
            latents,
            labels,
            max_timestep=attack_max_timestep(args, max_timestep),
            draws=args.concept_draws,
            generator=torch.Generator().manual_seed(args.seed + 17),
        )
        for latents, labels in sides
    ]


def concept_scores(
    args: argparse.Namespace,
    ldm: LDM,
    concepts: Concepts,
    settings: SynthesisSettings,
    sides: tuple[tuple[torch.Tensor, torch.Tensor], ...],
    max_timestep: int,
) -> list[torch.Tensor]:
    """Each side's loss-ratio scores, from its (z(0), labels), under one client's uploaded S
    and V against the plain prompt they start from (:func:`loss_ratio_sides`)."""
    states = concept_conditionings(ldm, concepts, concept_layout(ldm, concepts, settings))
    return loss_ratio_sides(args, ldm, states, sides, max_timestep)


def concept_attacks(
    args: argparse.Namespace,
    cfg: FedBiPConfig,
    models: dict[int, LDM],
    domains: list[str],
    results: dict,
) -> None:
    """The loss-ratio test on each client's learned concepts at the run's budget (``replicates``
    clients per domain) and overfitted (the positive control, one client per domain), at each
    image size of ``models`` (size: the LDM the clients and the server use there; at 256 px the
    concepts are learned on 4x64x64 latents), into
    ``results[domain]["SIZEpx/concepts/shots=S/epochs=E"]``."""
    own = fedbip_settings(cfg)
    budgets = loss_ratio_budgets(args, cfg.data.shots_per_class, own.concept_epochs)
    settings = SynthesisSettings.from_config(cfg)
    for domain, (size, ldm), (shots, epochs, replicates) in itertools.product(
        domains, models.items(), budgets
    ):
        budget = own.model_copy(update={"concept_epochs": epochs})
        unseen = shapes.test_set(domain, shots * replicates, seed=cfg.seed, size=size)
        members, non_members, losses = [], [], []
        for r in tqdm(range(replicates), desc=f"concepts {domain} {size}px {shots}x{epochs}"):
            client = shapes.client_train_set(
                domain, shots, client_index=r, seed=cfg.seed, size=size
            )
            generator = torch.Generator().manual_seed(args.seed * 1_000_003 + r)
            payload, report = personalize(
                ldm,
                client.images,
                client.labels,
                list(client.classes),
                domain,
                f"{domain}-{r}",
                cfg,
                generator,
                budget,
            )
            sides = ((client.images, client.labels), per_class_chunk(unseen, shots, r))
            timestep = payload.meta.timestep
            own_scores, other_scores = concept_scores(
                args,
                ldm,
                payload.concepts,
                settings,
                encoded_sides(ldm, sides, cfg.ldm.vae_batch_size),
                timestep,
            )
            members.append(own_scores)
            non_members.append(other_scores)
            losses.append([report.concept_losses[0], report.concept_losses[-1]])
        result = membership_result(
            torch.cat(members), torch.cat(non_members), statistic="loss-ratio"
        )
        key = ConditioningSetting(CONCEPTS, shots, epochs, size).key
        results.setdefault(domain, {})[key] = {
            "shots_per_class": shots,
            "concept_epochs": epochs,
            "clients": replicates,
            "draws": args.concept_draws,
            "max_timestep": attack_max_timestep(args, timestep),
            "concept_loss_first_last_epoch": losses,
            "attacks": {CONCEPT_ATTACK: result.summary()},
        }


def condition_attacks(
    args: argparse.Namespace,
    cfg: FedBiPConfig,
    models: dict[int, LDM],
    domains: list[str],
    results: dict,
) -> None:
    """The loss-ratio test on Espresso's uploaded conditions, the client step run by the method
    itself and its upload accepted by the server, at the run's budget (``replicates`` clients
    per domain) and overfitted (the positive control, one client per domain), at each image
    size of ``models`` (size: its LDM), into
    ``results[domain]["SIZEpx/espresso-conditions/shots=S/epochs=E"]``."""
    budgets = loss_ratio_budgets(args, cfg.data.shots_per_class, cfg.settings_of(ESPRESSO).epochs)
    flat = project_run_config()
    for domain, (size, ldm), (shots, epochs, replicates) in itertools.product(
        domains, models.items(), budgets
    ):
        run = FedBiPConfig.from_flat(
            {
                **flat,
                "method": ESPRESSO,
                f"{ESPRESSO}.epochs": epochs,
                "data.image-size": size,
            }
        )
        method = methods.create_for(run)
        server = ServerJob(run, list(shapes.CLASSES), lambda model=ldm: model)
        unseen = shapes.test_set(domain, shots * replicates, seed=run.seed, size=size)
        members, non_members, losses = [], [], []
        for r in tqdm(range(replicates), desc=f"conditions {domain} {size}px {shots}x{epochs}"):
            client = shapes.client_train_set(
                domain, shots, client_index=r, seed=run.seed, size=size
            )
            data = ClientSet(client.images, client.labels, client.classes, domain, f"{domain}-{r}")
            job = ClientJob(
                run,
                data,
                torch.Generator().manual_seed(args.seed * 1_000_003 + r),
                lambda model=ldm: model,
            )
            sent, report = method.upload(job)
            accepted = method.accept(sent, server)
            start = initial_conditions(
                ldm,
                run.data.prompt_template,
                domain,
                list(client.classes),
                method.settings.clusters,
            )
            sides = ((client.images, client.labels), per_class_chunk(unseen, shots, r))
            timestep = accepted.meta.timestep
            own_scores, other_scores = loss_ratio_sides(
                args,
                ldm,
                (start, accepted.content.conditions),
                encoded_sides(ldm, sides, run.ldm.vae_batch_size),
                timestep,
            )
            members.append(own_scores)
            non_members.append(other_scores)
            losses.append([report[SENT_CONCEPT_LOSSES][0], report[SENT_CONCEPT_LOSSES][-1]])
        result = membership_result(
            torch.cat(members), torch.cat(non_members), statistic="loss-ratio"
        )
        key = ConditioningSetting(CONDITIONS, shots, epochs, size).key
        results.setdefault(domain, {})[key] = {
            "shots_per_class": shots,
            "condition_epochs": epochs,
            "clusters": method.settings.clusters,
            "clients": replicates,
            "draws": args.concept_draws,
            "max_timestep": attack_max_timestep(args, timestep),
            "condition_loss_first_last_epoch": losses,
            "attacks": {f"{CONDITIONS}/loss-ratio": result.summary()},
        }


def per_image_and_class_means(
    cfg: FedBiPConfig, ldm: LDM, kind: str, images: torch.Tensor, labels: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """What method ``kind`` makes of each image (N, ...) and what it uploads: the class means
    (C, ...), by the method's own functions and settings."""
    own, classes, generator = cfg.settings_of(kind), len(shapes.CLASSES), torch.Generator()
    generator.manual_seed(seed)
    if kind == "fedpft":
        features = public_encoder(cfg.ldm.model, cfg.classifier.image_size)(images)
        mixture = fit_class_mixtures(features, labels, classes, own, generator)
        return features, torch.einsum("ck,ckd->cd", mixture.weights, mixture.means)
    captioner = load_captioner(own.captioner)
    captions = caption_images(captioner, images, own.captions_per_image, generator)
    repeated = labels.repeat(own.captions_per_image)
    # an image's captions are every len(images)-th (pass-major): their mean is a "class" of one
    own_image = torch.arange(len(images)).repeat(own.captions_per_image)
    per_image = class_conditioning(ldm, captions, own_image, len(images))
    return per_image, class_conditioning(ldm, captions, repeated, classes)


def class_mean_attacks(
    args: argparse.Namespace,
    cfg: FedBiPConfig,
    ldm: LDM,
    kind: str,
    domains: list[str],
    results: dict,
) -> None:
    """The class-mean test on ``kind``'s upload, ``replicates`` clients per domain, into
    ``results[domain]["64px/<kind>"]``."""
    shots, size = cfg.data.shots_per_class, cfg.data.image_size
    for domain in domains:
        reference = shapes.pretrain_set(domain, args.reference_per_class, seed=cfg.seed, size=size)
        public, _ = per_image_and_class_means(
            cfg, ldm, kind, reference.images, reference.labels, args.seed + 1
        )
        centres = LatentReference.of(public, reference.labels).centres
        unseen = shapes.test_set(domain, shots * args.replicates, seed=cfg.seed, size=size)
        members, non_members = [], []
        for r in tqdm(range(args.replicates), desc=f"{kind} {domain}"):
            client = shapes.client_train_set(
                domain, shots, client_index=r, seed=cfg.seed, size=size
            )
            mine, means = per_image_and_class_means(
                cfg, ldm, kind, client.images, client.labels, args.seed * 1_000_003 + r
            )
            others, other_labels = per_class_chunk(unseen, shots, r)
            # the server's own view of a candidate: its own captions (another draw) or features
            candidate, _ = per_image_and_class_means(
                cfg, ldm, kind, client.images, client.labels, args.seed + 2 + r
            )
            theirs, _ = per_image_and_class_means(
                cfg, ldm, kind, others, other_labels, args.seed + 2 + r
            )
            members.append(class_mean_scores(candidate, client.labels, means, centres))
            non_members.append(class_mean_scores(theirs, other_labels, means, centres))
        result = membership_result(
            torch.cat(members), torch.cat(non_members), statistic="class-mean"
        )
        results.setdefault(domain, {})[f"{size}px/{kind}"] = {
            "clients": args.replicates,
            "reference_per_class": args.reference_per_class,
            "attacks": {f"{kind}/class-mean": result.summary()},
        }


def dp_mixture_attacks(
    args: argparse.Namespace, cfg: FedBiPConfig, ldm: LDM, domains: list[str], results: dict
) -> None:
    """The server's tests on fedbip-mixture's DP upload at each ``--dp-epsilon``, ``replicates``
    clients per domain: the mixture tests on its class statistics and the concepts' loss-ratio
    test on its DP-SGD S and V, into ``results[domain]["64px/fedbip-mixture-dp/epsilon=E"]``."""
    flat = {**project_run_config(), "method": "fedbip-mixture"}
    runs = {
        epsilon: FedBiPConfig.from_flat({**flat, "fedbip-mixture.dp-epsilon": epsilon})
        for epsilon in args.dp_epsilon
    }
    run = FedBiPConfig.from_flat(flat)  # what every epsilon shares: sampler, sizes, the fit
    settings = SynthesisSettings.from_config(run)
    t = settings.sampler(ldm).first_timestep(run.synthesis.start_timestep)
    a = float(ldm.scheduler.alphas_cumprod[t].sqrt())
    size, shots = run.data.image_size, run.data.shots_per_class
    for domain in domains:
        reference = shapes.pretrain_set(domain, args.reference_per_class, seed=run.seed, size=size)
        reference_z0 = encode_images(ldm.vae, reference.images, run.ldm.vae_batch_size)
        prior = LatentReference.of(reference_z0, reference.labels)
        rows = noise_instances(
            ldm.scheduler,
            reference_z0,
            reference.labels,
            t,
            **PLAIN,
            generator=torch.Generator().manual_seed(args.seed),
        )
        reference_mixture = fitted_mixture(run, "fedbip-mixture", rows, torch.Generator())
        unseen = shapes.test_set(domain, shots * args.replicates, seed=run.seed, size=size)
        clients = [
            shapes.client_train_set(domain, shots, client_index=r, seed=run.seed, size=size)
            for r in range(args.replicates)
        ]
        # each client's members and its share of the unseen images as (z(0), labels), the same
        # at every epsilon
        sides = [
            encoded_sides(
                ldm,
                ((c.images, c.labels), per_class_chunk(unseen, shots, r)),
                run.ldm.vae_batch_size,
            )
            for r, c in enumerate(clients)
        ]
        for epsilon, private in runs.items():
            method = methods.create_for(private)
            server = ServerJob(private, list(shapes.CLASSES), lambda: ldm)
            pooled: dict[str, tuple[list, list]] = {}
            for r, client in enumerate(tqdm(clients, desc=f"DP upload {domain}")):
                data = ClientSet(
                    client.images, client.labels, client.classes, domain, f"{domain}-{r}"
                )
                generator = torch.Generator().manual_seed(args.seed * 1_000_003 + r)
                blob, _ = method.upload(ClientJob(private, data, generator, lambda: ldm))
                upload = method.accept(blob, server)
                uploaded = from_tensors(upload.tensors, tuple(ldm.latent_shape()))
                (member_z0, labels), (other_z0, other_labels) = sides[r]
                scores = mixture_attack(
                    member_z0,
                    other_z0,
                    labels,
                    other_labels,
                    uploaded,
                    reference_mixture,
                    a,
                    (PLAIN["gamma_mean"], PLAIN["gamma_std"]),
                    prior,
                )
                content = upload.content
                scores[CONCEPT_ATTACK] = tuple(
                    concept_scores(
                        args, ldm, content.concepts, settings, sides[r], content.timestep
                    )
                )
                pool(pooled, scores)
            entry = {
                "epsilon": epsilon,
                "clients": args.replicates,
                "timestep": t,
                "attacks": {
                    f"{DP_MIXTURE}/{name}": membership_result(
                        torch.cat(m), torch.cat(n), statistic=name
                    ).summary()
                    for name, (m, n) in pooled.items()
                },
            }
            results.setdefault(domain, {})[f"{size}px/{DP_MIXTURE}/epsilon={epsilon:g}"] = entry


def classifier_attacks(
    args: argparse.Namespace, cfg: FedBiPConfig, ldm: LDM, domains: list[str], results: dict
) -> None:
    """The loss tests on FedLMG's uploaded classifiers (Local's upload is the same client step),
    ``replicates`` clients per domain, into ``results[domain][classifier_key(...)]``: the loss
    itself and, with ``reference_models``, offline LiRA against classifiers the server trains by
    the same recipe on public images."""
    epochs = {"fedlmg.local-epochs": args.local_epochs} if args.local_epochs else {}
    start = {"classifier.init": args.classifier_init} if args.classifier_init else {}
    run = FedBiPConfig.from_flat({**project_run_config(), "method": CLASSIFIER, **epochs, **start})
    local_epochs = run.settings_of(CLASSIFIER).local_epochs
    method = methods.create_for(run)
    server = ServerJob(run, list(shapes.CLASSES), lambda: ldm)
    size, shots = run.data.image_size, run.data.shots_per_class

    def trained(images: shapes.ImageSet, name: str, seed: int) -> torch.nn.Module:
        data = ClientSet(images.images, images.labels, images.classes, images.domain, name)
        job = ClientJob(run, data, torch.Generator().manual_seed(seed), lambda: ldm)
        return method.accept(method.upload(job)[0], server).content

    def losses(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return evaluate(model, images, labels, run.classifier.image_size).losses

    def reference_models(domain: str) -> list[torch.nn.Module]:
        """Each trained by the client's recipe on its own public images of ``domain``."""
        public = shapes.pretrain_set(
            domain, shots * args.reference_models, seed=run.seed, size=size
        )
        references = []
        for m in tqdm(range(args.reference_models), desc=f"reference models {domain}"):
            images, labels = per_class_chunk(public, shots, m)
            chunk = shapes.ImageSet(images, labels, public.classes, domain)
            references.append(trained(chunk, f"{domain}-reference-{m}", args.seed + 5 + m))
        return references

    for domain in domains:
        references = reference_models(domain) if args.reference_models else []
        unseen = shapes.test_set(domain, shots * args.replicates, seed=run.seed, size=size)
        tests = ("loss", "lira-offline") if references else ("loss",)
        pooled: dict[str, tuple[list, list]] = {name: ([], []) for name in tests}
        for r in tqdm(range(args.replicates), desc=f"classifiers {domain}"):
            client = shapes.client_train_set(
                domain, shots, client_index=r, seed=run.seed, size=size
            )
            uploaded = trained(client, f"{domain}-{r}", args.seed * 1_000_003 + r)
            others = per_class_chunk(unseen, shots, r)
            for side, (images, labels) in enumerate(((client.images, client.labels), others)):
                own = losses(uploaded, images, labels)
                pooled["loss"][side].append(-own)
                if references:
                    theirs = torch.stack([losses(m, images, labels) for m in references])
                    pooled["lira-offline"][side].append(lira_offline_scores(own, theirs))
        key = classifier_key(size, run.classifier.init, local_epochs)
        results.setdefault(domain, {})[key] = {
            "clients": args.replicates,
            "reference_models": args.reference_models,
            "local_epochs": local_epochs,
            "classifier_init": run.classifier.init,
            "attacks": {
                f"{CLASSIFIER}/{name}": membership_result(
                    torch.cat(m), torch.cat(n), statistic=name
                ).summary()
                for name, (m, n) in pooled.items()
            },
        }


def fedavg_attacks(args: argparse.Namespace, kind: str, domains: list[str], results: dict) -> None:
    """The loss tests on every reply of ``replicates`` FedAvg federations of one client a
    domain (federation r: each domain's client r), into ``results[domain][fedavg_key(...)]``.

    Each round every client runs FedAvg's own client step (:meth:`FedAvg.local_update`) from
    the global weights, and Flower's own weighted average makes the next; the server scores its
    client's members and as many unseen images under the model it sent and the reply it got:
    the reply's loss in the first and last round, and the loss drop summed over every round
    (:func:`~fedbip_tools.privacy.loss_drop_scores`)."""
    bench = Bench(Settings(), work=ROOT, results=ROOT / "benchmarks")
    # the benchmark row's own run config (its rounds, precision, schedule), on the world of seed 0
    rows = [
        FedBiPConfig.from_flat({**project_run_config(), **variant_values(bench, v, 0)})
        for v in BENCHMARK_ROWS
        if v.method == "fedavg"
    ]
    run = next(cfg for cfg in rows if cfg.settings_of("fedavg").part == FEDAVG_KINDS[kind])
    if args.fedavg_rounds:
        run = FedBiPConfig.from_flat({**run.to_flat(), "fedavg.rounds": args.fedavg_rounds})
    method = cast(fedavg.FedAvg, methods.create_for(run))
    rounds = method.settings.rounds
    size, shots = run.data.image_size, run.data.shots_per_class

    scorer = method.classifier(run, "random")  # built once: each score loads the part's weights

    def losses(weights: dict[str, torch.Tensor], images: tuple[torch.Tensor, torch.Tensor]):
        method.federated(scorer).load_state_dict(weights)
        return evaluate(scorer, *images, run.classifier.image_size).losses

    unseen = {
        d: shapes.test_set(d, shots * args.replicates, seed=run.seed, size=size) for d in domains
    }
    pooled = {d: {name: ([], []) for name in FEDAVG_TESTS} for d in domains}
    for r in range(args.replicates):
        clients = {
            d: shapes.client_train_set(d, shots, client_index=r, seed=run.seed, size=size)
            for d in domains
        }
        sides = {
            d: ((c.images, c.labels), per_class_chunk(unseen[d], shots, r))
            for d, c in clients.items()
        }
        # the server's start, drawn as FedAvg.run_server draws it (from its own seed)
        torch.manual_seed(args.seed * 1_000_003 + r)
        sent = method.federated(method.classifier(run, run.classifier.init)).state_dict()
        # per domain and side: (rounds, candidates) losses under the sent model and the reply
        before = {d: ([], []) for d in domains}
        after = {d: ([], []) for d in domains}
        for server_round in tqdm(range(1, rounds + 1), desc=f"{kind} federation {r}"):
            replies = []
            for d, client in clients.items():
                data = ClientSet(client.images, client.labels, client.classes, d, f"{d}-{r}")
                stream = args.seed * 1_000_003 + shapes.DOMAINS.index(d) * 1009 + r * 101
                reply = method.local_update(
                    sent, data, run, server_round, torch.Generator().manual_seed(stream)
                )
                for side, images in enumerate(sides[d]):
                    before[d][side].append(losses(sent, images))
                    after[d][side].append(losses(reply, images))
                replies.append(
                    RecordDict(
                        {
                            fedavg.ARRAYS: ArrayRecord(reply),
                            fedavg.METRICS: MetricRecord({SENT_IMAGES: len(data)}),
                        }
                    )
                )
            sent = aggregate_arrayrecords(replies, SENT_IMAGES).to_torch_state_dict()
        for d in domains:
            for side in (0, 1):
                sent_losses, replies_losses = (torch.stack(x[d][side]) for x in (before, after))
                pooled[d]["loss-first"][side].append(-replies_losses[0])
                pooled[d]["loss-last"][side].append(-replies_losses[-1])
                drops = loss_drop_scores(sent_losses, replies_losses)
                pooled[d]["loss-drop"][side].append(drops)
    for d in domains:
        key = fedavg_key(size, run)
        results.setdefault(d, {})[key] = {
            "clients": args.replicates,
            "part": method.settings.part,
            "rounds": rounds,
            "local_epochs": method.settings.local_epochs,
            "classifier_init": run.classifier.init,
            "attacks": {
                f"{kind}/{name}": membership_result(
                    torch.cat(m), torch.cat(n), statistic=name
                ).summary()
                for name, (m, n) in pooled[d].items()
            },
        }


def latent_stats(
    z0: torch.Tensor, labels: torch.Tensor, centres: dict[int, torch.Tensor], a: float
) -> dict:
    """The per-value spread of class-centred latents and |u|, and the Gaussian model's per-row
    signal-to-noise mu = 0.5 a |u| / sqrt(1 - a^2) (the noise alone; what grows with sqrt(D))."""
    u = torch.stack([z.double().flatten() - centres[int(y)] for z, y in zip(z0, labels)])
    norms = u.norm(dim=1)
    return {
        "values": u.shape[1],
        "centred_std": float(u.std()),
        "norm_mean": float(norms.mean()),
        "mu_mean": float((0.5 * a * norms / math.sqrt(1 - a * a)).mean()),
    }


def shown(value: object) -> object:
    """An argument as a recorded command gives it: a path inside the project relative to its
    root, so the command runs from any clone."""
    if isinstance(value, Path) and value.is_relative_to(ROOT):
        return value.relative_to(ROOT)
    return value


def summarize_seeds(paths: list[Path]) -> None:
    """Markdown: every (domain, setting, attack) the records share, AUC mean ± sample std over
    them (one per ``--seed``) and TPR at 1% FPR's mean."""
    records = [json.loads(p.read_text()) for p in paths]
    first = records[0]["results"]
    print(f"seeds {[record_seed(r) for r in records]}")
    print("| domain | setting | attack | AUC mean ± std | TPR at 1% FPR |\n|---|---|---|---|---|")
    for domain, per_domain in first.items():
        for key, entry in per_domain.items():
            for name in entry["attacks"]:
                found = [
                    r["results"].get(domain, {}).get(key, {}).get("attacks", {}).get(name)
                    for r in records
                ]
                if any(f is None for f in found):
                    continue
                aucs = torch.tensor([f["auc"] for f in found], dtype=torch.float64)
                tpr = sum(f["tpr_at_max_fpr"] for f in found) / len(found)
                spread = float(aucs.std()) if len(aucs) > 1 else 0.0
                print(
                    f"| {domain} | {key} | {name} | {float(aucs.mean()):.3f} ± {spread:.3f} "
                    f"| {tpr:.2f} |"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--summarize", type=Path, nargs="+", help="only tabulate these records (one per seed)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "server_attacks.json")
    parser.add_argument("--domains", nargs="+", help="default: the run config's")
    parser.add_argument(
        "--replicates",
        type=int,
        default=3,
        help="clients per domain (96 members each); 0: the conditioning kinds' controls only",
    )
    parser.add_argument("--reference-per-class", type=int, default=50)
    parser.add_argument(
        "--draws", type=int, nargs="+", default=[10], help="K besides the run config's"
    )
    parser.add_argument("--large-size", type=int, default=256, help="0: skip SD's latent size")
    parser.add_argument(
        "--large-model",
        type=Path,
        default=ROOT / "models" / "miniature-ldm-256px",
        help="concepts, conditions: the LDM at --large-size, its UNet trained there "
        f"(pretrain_miniature.py --image-size; on a CPU {ALLOW_CPU_ENV}=1)",
    )
    parser.add_argument(
        "--large-timesteps", type=int, nargs="+", default=None, help="default: 999 and PNDM-25's T"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timesteps",
        type=int,
        nargs="+",
        default=None,
        help="the miniature's T (default: the run's)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where the LDM runs (cuda: fp16, as a GPU run config)"
    )
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--concept-draws", type=int, default=16, help="(t, eps) per candidate")
    parser.add_argument(
        "--concept-max-timestep",
        type=int,
        default=0,
        help="concepts, conditions: draw t ~ U{1..this} (0, or above the upload's T: its T)",
    )
    parser.add_argument(
        "--overfit-shots", type=int, default=4, help="concepts, conditions: 0: no positive control"
    )
    parser.add_argument("--overfit-epochs", type=int, default=200)
    parser.add_argument(
        "--reference-models",
        type=int,
        default=4,
        help="FedLMG: LiRA's reference classifiers (0: the loss test alone)",
    )
    parser.add_argument(
        "--local-epochs",
        type=int,
        default=0,
        help="FedLMG: the client classifier's epochs (0: the run config's; the benchmark's: 150)",
    )
    parser.add_argument(
        "--classifier-init",
        choices=get_args(ClassifierConfig.model_fields["init"].annotation),
        help="FedLMG: the client classifier's start (default: the run config's)",
    )
    parser.add_argument(
        "--fedavg-rounds",
        type=int,
        default=0,
        help="FedAvg: its rounds (0: the benchmark row's, 25)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads")
    parser.add_argument(
        "--dp-epsilon", type=float, nargs="+", default=[4.0], help="the DP kinds' budgets"
    )
    args = parser.parse_args()
    if args.summarize:
        summarize_seeds(args.summarize)
        return
    if not args.replicates and not set(args.kinds) <= set(CONDITIONING_KINDS):
        parser.error(f"--replicates 0 runs only the controls of {', '.join(CONDITIONING_KINDS)}")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    # taken now: the code that runs is the tree as it is at the start
    cfg = FedBiPConfig.from_flat(project_run_config())
    made = provenance.record(ROOT, torch.get_num_threads(), [args.out], model=ROOT / cfg.ldm.model)
    ldm = load_for_run(cfg.ldm.model, args.device, cfg.ldm.half_precision, cfg.data.image_size)
    conditioning_models = {cfg.data.image_size: ldm}
    if args.large_size and set(args.kinds) & set(CONDITIONING_KINDS):
        made["large_model"] = provenance.model_digest(args.large_model)
        conditioning_models[args.large_size] = load_for_run(
            str(args.large_model), args.device, cfg.ldm.half_precision, args.large_size
        )
    default_t = (
        SynthesisSettings.from_config(cfg).sampler(ldm).first_timestep(cfg.synthesis.start_timestep)
    )
    sd = PNDMScheduler.from_pretrained(SD_SCHEDULER, subfolder="scheduler")
    same_schedule = bool(torch.equal(sd.alphas_cumprod, ldm.scheduler.alphas_cumprod))
    large_ts = args.large_timesteps or sorted(
        {999, Sampler.create("pndm", sd, 25, "leading").first_timestep()}, reverse=True
    )
    fedbip = fedbip_settings(cfg)
    draws = sorted({fedbip.latents_per_image, *args.draws})
    mixture_kinds = [kind for kind in args.kinds if kind in MIXTURE_KINDS]
    # fedbip-mixture and Espresso fit mixed same-class pairs (their own gamma); FedLD plain z(T)
    # of each image (no partner)
    zT_mixing = pair_mixing(fedbip)
    mixing = {kind: pair_mixing(cfg.settings_of(kind)) for kind in mixture_kinds}
    domains = args.domains or cfg.data.domain_list
    shots, seed = cfg.data.shots_per_class, cfg.seed
    settings: list[tuple[int, SchedulerMixin, str, list[int]]] = [
        (cfg.data.image_size, ldm.scheduler, "miniature", args.timesteps or [default_t])
    ]
    if args.large_size:
        settings.append((args.large_size, sd, "sd-v1-4", large_ts))
    # K z(T) per image only shapes the row kinds (a DP release takes one per image)
    row_draws = draws if set(args.kinds) & {"zT", *MIXTURE_KINDS} else []
    tasks = sum(len(ts) for *_, ts in settings) * len(row_draws) * len(domains) * args.replicates
    bar = tqdm(total=tasks, desc="uploads attacked", unit="upload")

    results: dict = {}
    if CONCEPTS in args.kinds:
        concept_attacks(args, cfg, conditioning_models, domains, results)
    if CONDITIONS in args.kinds:
        condition_attacks(args, cfg, conditioning_models, domains, results)
    if DP_MIXTURE in args.kinds:
        dp_mixture_attacks(args, cfg, ldm, domains, results)
    if CLASSIFIER in args.kinds:
        classifier_attacks(args, cfg, ldm, domains, results)
    for kind in (k for k in FEDAVG_KINDS if k in args.kinds):
        fedavg_attacks(args, kind, domains, results)
    for kind in set(args.kinds) & set(MEAN_KINDS):
        class_mean_attacks(args, cfg, ldm, kind, domains, results)
    for domain in domains if set(args.kinds) & set(LATENT_KINDS) else []:
        for size, schedule, schedule_name, timesteps in settings:
            encode = lambda images: encode_images(ldm.vae, images, cfg.ldm.vae_batch_size)  # noqa: E731
            reference = shapes.pretrain_set(domain, args.reference_per_class, seed=seed, size=size)
            reference_z0 = encode(reference.images)
            prior = LatentReference.of(reference_z0, reference.labels)
            unseen = shapes.test_set(domain, shots * args.replicates, seed=seed, size=size)
            clients = [
                shapes.client_train_set(domain, shots, client_index=r, seed=seed, size=size)
                for r in range(args.replicates)
            ]
            # the server's encoding of a member is its z0 (encode_images, deterministic)
            client_z0 = [encode(client.images) for client in clients]
            non_members = [per_class_chunk(unseen, shots, r) for r in range(args.replicates)]
            non_member_z0 = [encode(images) for images, _ in non_members]
            for t in timesteps:
                a = float(schedule.alphas_cumprod[t].sqrt())
                for kind in (k for k in DP_RELEASES if k in args.kinds):
                    released = dp_release_attacks(
                        kind,
                        args.dp_epsilon,
                        schedule,
                        t,
                        (reference_z0, reference.labels, prior),
                        [(z, c.labels) for z, c in zip(client_z0, clients)],
                        [(z, y) for z, (_, y) in zip(non_member_z0, non_members)],
                        args.seed * 1_000_003 + shapes.DOMAINS.index(domain) * 1009,
                    )
                    for epsilon, entry in released.items():
                        key = f"{size}px/T={t}/{kind}/epsilon={epsilon:g}"
                        results.setdefault(domain, {})[key] = entry
                for k in row_draws:
                    pooled: dict[str, tuple[list, list]] = {}
                    stats = None
                    server_mixtures = {
                        kind: fitted_mixture(
                            cfg,
                            kind,
                            noise_instances(
                                schedule,
                                reference_z0,
                                reference.labels,
                                t,
                                **mixing[kind],
                                draws=k,
                                generator=torch.Generator().manual_seed(args.seed + k),
                            ),
                            torch.Generator().manual_seed(args.seed + k),
                        )
                        for kind in mixture_kinds
                    }
                    for r, client in enumerate(clients):
                        generator = torch.Generator().manual_seed(
                            args.seed * 1_000_003
                            + shapes.DOMAINS.index(domain) * 1009
                            + r * 101
                            + k
                        )  # the same partners, gammas and noise at every T of a size
                        own = (client_z0[r], non_member_z0[r], client.labels, non_members[r][1])
                        inst = noise_instances(
                            schedule,
                            client_z0[r],
                            client.labels,
                            t,
                            **zT_mixing,
                            draws=k,
                            generator=generator,
                        )
                        scores = {}
                        if "zT" in args.kinds:
                            z_scores = attack(
                                *own,
                                inst.zT,
                                inst.zT_labels,
                                len(client),
                                k,
                                a,
                                (fedbip.gamma_mean, fedbip.gamma_std),
                                prior,
                                generator,
                            )
                            scores.update(z_scores)
                        for kind in mixture_kinds:
                            fit_generator = torch.Generator().manual_seed(
                                generator.initial_seed() + 1
                            )
                            rows = (
                                inst
                                if kind == "fedbip-mixture" and mixing[kind] == zT_mixing
                                else noise_instances(
                                    schedule,
                                    client_z0[r],
                                    client.labels,
                                    t,
                                    **mixing[kind],
                                    draws=k,
                                    generator=fit_generator,
                                )
                            )
                            uploaded = fitted_mixture(cfg, kind, rows, fit_generator)
                            gamma = (mixing[kind]["gamma_mean"], mixing[kind]["gamma_std"])
                            m_scores = mixture_attack(
                                *own, uploaded, server_mixtures[kind], a, gamma, prior
                            )
                            scores.update({f"{kind}/{n}": v for n, v in m_scores.items()})
                        pool(pooled, scores)
                        stats = stats or latent_stats(inst.z0, inst.labels, prior.centres, a)
                        bar.update()
                    key = f"{size}px/T={t}/K={k}"
                    entry = {
                        "latent_shape": list(inst.zT.shape[1:]),
                        "schedule": schedule_name,
                        "timestep": t,
                        "sqrt_abar": a,
                        "latents_per_image": k,
                        "member_latents": stats,
                        "attacks": {},
                    }
                    for name, (m, n) in pooled.items():
                        result = membership_result(
                            torch.cat(m),
                            torch.cat(n),
                            statistic=name.split("/", 1)[1],
                            grouped=name.startswith("oracle"),
                        )
                        entry["attacks"][name] = result.summary()
                    results.setdefault(domain, {})[key] = entry
    bar.close()

    record = {
        "what": "server-side membership tests on uploads (issue 49: "
        + ", ".join(args.kinds)
        + "): members vs unseen images of the same domain and classes, scores pooled over the "
        "domain's clients",
        "command": f"OMP_NUM_THREADS={args.threads} "
        + (f"{ALLOW_CPU_ENV}=1 " if cpu_full_size_allowed() else "")
        + "python scripts/server_attacks.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else shown(v)}"
            for k, v in vars(args).items()
            if k != "out" and v is not None
        ),
        "default_timestep": default_t,
        "miniature_schedule_is_sd_v1_4": same_schedule,
        "large_timesteps": large_ts if args.large_size else [],
        "draws": draws,
        "replicates": args.replicates,
        "members_per_domain": shots * len(shapes.CLASSES) * args.replicates,
        "reference_per_class": args.reference_per_class,
        "seconds": round(time.perf_counter() - started, 1),
        "device": torch.cuda.get_device_name(ldm.device) if ldm.device.type == "cuda" else "cpu",
        "provenance": made,
        "results": results,
    }
    write_json(args.out, record)
    print_table(record)


def print_table(record: dict) -> None:
    """Markdown: domain x size x K rows, AUC +- stderr / TPR@1%FPR of every attack measured."""
    entries = [e for per_domain in record["results"].values() for e in per_domain.values()]
    columns = list(dict.fromkeys(name for e in entries for name in e["attacks"]))
    print("| domain | setting | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 2) + "|")
    for domain, per_domain in record["results"].items():
        for key, entry in per_domain.items():
            cells = [
                f"{a['auc']:.3f}+-{a['auc_stderr']:.3f} / {a['tpr_at_max_fpr']:.3f}"
                if (a := entry["attacks"].get(c))
                else "-"
                for c in columns
            ]
            print(f"| {domain} | {key} | " + " | ".join(cells) + " |")
    print(json.dumps({k: v for k, v in record.items() if k not in ("results",)}, indent=1))


if __name__ == "__main__":
    main()
