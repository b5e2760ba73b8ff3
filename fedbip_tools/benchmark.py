"""The methods benchmark: every method side by side, each run through the real ``flwr run``.

Issues 18 and 20. For every seed and every variant (a method of the registry plus run-config
values, e.g. FedBiP-L = ``fedbip`` with 10 z(T) per private image), one simulation of the same three clients
(sketch, quickdraw, painting of the shapes world, one client each) runs on Flower with the same
seed, client data, test sets and classifier recipe; every classifier gets the same number of
SGD steps (``classifier-steps``; Local's per-client classifiers and FedAvg's rounds are sized to
the same budget). The measurements come from what each run leaves in its folder: accuracy per
domain (metrics.json), upload bytes and client seconds (clients.json), server seconds, the
training set (training-set.json), which the fidelity judges (:mod:`fedbip_tools.judges`) label,
and the classifier, whose membership-inference gaps are measured on the clients' real images.

Variants that differ only in what the server does with the same uploads (FedLMG's distillation
modes) start from a copy of the other variant's run
folder: the ServerApp resumes from the uploads on disk and reuses every shard made under the
same key, exactly as a restarted server does.

Results are cached per seed (``benchmarks/methods/seed-N.json``, with the settings they were
made with and each row's provenance: commit, machine kind, library versions, date;
:mod:`fedbip_tools.provenance`), so an interrupted benchmark resumes and seeds can run as
separate processes; every invocation summarizes all cached seeds into
``benchmarks/methods.json`` and a section of docs/benchmarks/methods.md, and draws one picture per client
domain with a row per method. A row is averaged only over seeds of one machine kind unless
asked otherwise, and every comparison the docs draw is the paired per-seed difference with its
95% interval.

    fedbip benchmark --seeds 0 1 2
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from diffusers import PNDMScheduler
from scipy import stats

from fedbip_flwr import dataset, methods, shapes
from fedbip_flwr.classifier import (
    ShardImages,
    backbone_path,
    batches_per_epoch,
    evaluate,
    load_classifier_bytes,
)
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.instance import upload_order
from fedbip_flwr.ldm import load_for_run
from fedbip_flwr.method_settings import FedBiPSettings
from fedbip_flwr.methods.base import ServerJob
from fedbip_flwr.paths import project_dir, resolve
from fedbip_flwr.results import SENT_SECONDS
from fedbip_flwr.results import read as read_results
from fedbip_flwr.sampler import Sampler
from fedbip_flwr.seeds import client_seed
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import write_json
from fedbip_flwr.viz import image_grid

from . import provenance
from .judges import Judges, load_judges
from .machine import this_machine
from .privacy import (
    Features,
    averaged_reconstructions,
    backbone_features,
    dcr_membership,
    density_ratio_membership,
    loss_membership_inference,
    reconstruction_score,
)
from .simulation import SimulationError, run_simulation, run_status, stop_local_superlink
from .upload_attacks import REFERENCE_PER_CLASS, Candidates, ServerView, attack_upload, upload_test

log = logging.getLogger(__name__)
MARKER = "methods"
PICTURE_COLUMNS = 10


@dataclass(frozen=True)
class Settings:
    """Everything a cached result depends on, except the seed: the default federation's run
    config (sampler, concepts, the upload's shape) pinned, so tuning the default leaves every
    cached row as it is, with the classifier's budget and start the same for every row."""

    domains: tuple[str, ...] = ("sketch", "quickdraw", "painting")
    classifier_steps: int = 300
    fedavg_local_epochs: int = 2
    mia_per_domain: int = 96
    run_config: dict[str, Any] = field(
        default_factory=lambda: {
            "shots-per-class": 16,
            "test-per-class": 100,
            "scheduler": "unipc",
            "timestep-spacing": "trailing",
            "num-inference-steps": 5,
            "guidance-scale": 4.0,
            "fedbip.concept-epochs": 10,
            "fedbip-mixture.concept-epochs": 10,
            # the default federation's upload: 2 z(T) per image, each denoised once
            **{f"{m}.{k}": v for m in FEDBIP_FAMILY for k, v in TWO_ZT_PER_IMAGE.items()},
            # the paper's classifier starts pretrained (ImageNet); the miniature's public start
            "classifier-init": "pretrained",
            "classifier-image-size": 64,
            "classifier-schedule": "cosine",
            # float32: rows compare across machines, and the judges are float32 too
            "classifier-precision": "float32",
            "classifier-precise-bn": True,
        }
    )

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Variant:
    """One row of the tables: a registered method with its own run-config values."""

    name: str
    values: dict[str, Any]
    reuse: str = ""  # a variant whose uploads (and shards) this one starts from
    sized: Callable[[Settings, int], dict[str, Any]] | None = None  # budget-dependent values

    @property
    def method(self) -> str:
        return self.values["method"]

    def run_values(self, settings: Settings, images_per_client: int) -> dict[str, Any]:
        extra = self.sized(settings, images_per_client) if self.sized else {}
        return {**self.values, **extra}


def local_epochs(settings: Settings, n: int) -> int:
    """Each client's own classifier (Local, FedLMG's guides) gets the global budget in steps."""
    return math.ceil(settings.classifier_steps / batches_per_epoch(n, 64))


def local_budget(settings: Settings, n: int) -> dict[str, Any]:
    return {"local.epochs": local_epochs(settings, n)}


def fedlmg_budget(settings: Settings, n: int) -> dict[str, Any]:
    return {"fedlmg.local-epochs": local_epochs(settings, n)}


def fedavg_budget(settings: Settings, n: int) -> dict[str, Any]:
    """FedAvg's rounds such that its SGD steps, summed over clients, meet the budget."""
    per_round = len(settings.domains) * settings.fedavg_local_epochs * batches_per_epoch(n, 64)
    return {
        "fedavg.rounds": math.ceil(settings.classifier_steps / per_round),
        "fedavg.local-epochs": settings.fedavg_local_epochs,
    }


FEDBIP_FAMILY = ("fedbip", "fedbip-mixture")  # the methods whose tables hold FedBiP's keys
TWO_ZT_PER_IMAGE = {"latents-per-image": 2, "multiplier": 1}


def _zt_per_image(method: str, k: int, **more: Any) -> dict[str, Any]:
    """A FedBiP-family row uploading ``k`` independent z(T) per image, each denoised once."""
    return {"method": method, f"{method}.latents-per-image": k, f"{method}.multiplier": 1, **more}


def _dp(method: str, epsilon: float) -> dict[str, Any]:
    own = _zt_per_image(method, 2) if method in FEDBIP_FAMILY else {"method": method}
    return {**own, f"{method}.dp-epsilon": epsilon}


RANDOM_START = {"classifier-init": "random"}
# One name per variant, used by the benchmark, its records and the docs. FedBiP-S / M / L upload
# 2 / 5 / 10 independent z(T) per private image (each its own partner, gamma and noise) and
# denoise each once: the paper's image counts, made the way its authors' code makes FedBiP-L
# (a fresh latent for every synthetic image).
VARIANTS: tuple[Variant, ...] = (
    Variant("Central", {"method": "central"}),
    Variant("Prompts-only", {"method": "prompts-only"}),
    Variant("FedBiP-S", _zt_per_image("fedbip", 2)),
    Variant("FedBiP-M", _zt_per_image("fedbip", 5)),
    Variant("FedBiP-L", _zt_per_image("fedbip", 10)),
    Variant("FedBiP-mixture", _zt_per_image("fedbip-mixture", 2)),
    Variant("FedBiP-mixture-DP eps 4", _dp("fedbip-mixture", 4.0)),
    Variant("FedLD", {"method": "fedld"}),
    Variant("Espresso", {"method": "espresso"}),
    Variant("OSCAR", {"method": "oscar"}),
    Variant("FedPFT", {"method": "fedpft"}),
    Variant("FedLMG-FT", {"method": "fedlmg", "fedlmg.global": "ft"}, sized=fedlmg_budget),
    # the world's contract (fedbip_tools.world): the floor and the ceiling from a random start
    Variant("Central, random start", {"method": "central", **RANDOM_START}),
    Variant("Prompts-only, random start", {"method": "prompts-only", **RANDOM_START}),
    # ablations (the paper's Table 3): the concepts alone, the z(T) alone; the paper's FedBiP-S
    Variant(
        "concept-only", _zt_per_image("fedbip", 2, **{"fedbip.synthesis-start": "fresh-noise"})
    ),
    Variant("instance-only", _zt_per_image("fedbip", 2, **{"fedbip.concept-epochs": 0})),
    Variant(
        "FedBiP-S, 2 passes of one z(T)",
        {"method": "fedbip", "fedbip.latents-per-image": 1, "fedbip.multiplier": 2},
    ),
    Variant(
        "FedBiP-S, 4 concepts per class", _zt_per_image("fedbip", 2, **{"fedbip.class-clusters": 4})
    ),
    Variant("FedBiP-mixture-DP eps 1", _dp("fedbip-mixture", 1.0)),
    Variant("FedBiP-mixture-DP eps 16", _dp("fedbip-mixture", 16.0)),
    Variant("FedLD-DP eps 4", _dp("fedld", 4.0)),
    Variant("Espresso without Z-Sampling", {"method": "espresso", "espresso.z-sampling": False}),
    Variant("FedLMG-MD", {"method": "fedlmg", "fedlmg.global": "md"}, "FedLMG-FT", fedlmg_budget),
    Variant("FedLMG-SD", {"method": "fedlmg", "fedlmg.global": "sd"}, "FedLMG-FT", fedlmg_budget),
    # references beside the one-shot methods
    Variant("Local", {"method": "local"}, sized=local_budget),
    Variant("FedAvg", {"method": "fedavg"}, sized=fedavg_budget),
    # the Flower FedPFT baseline's comparison: FedAvg of a linear head on FedPFT's frozen encoder
    Variant("FedAvg-head", {"method": "fedavg", "fedavg.part": "head"}, sized=fedavg_budget),
)
# The headline rows (issue 89), run by default; FedLMG-FT, whose guided synthesis costs about 45
# CPU-minutes a seed, last.
HEADLINE = (
    "Central",
    "Prompts-only",
    "FedBiP-S",
    "FedBiP-L",
    "FedBiP-mixture",
    "FedBiP-mixture-DP eps 4",
    "FedLD",
    "Espresso",
    "OSCAR",
    "FedPFT",
    "Central, random start",
    "Prompts-only, random start",
    "FedLMG-FT",
)
# What records made before the names were made one per variant called a row (they named two
# variants "FedBiP-L", and the public start apart): resolved when such a record is read.
LEGACY_NAMES = {
    "FedBiP-S (2 z(T) per image)": "FedBiP-S",
    "FedBiP-M (5 z(T) per image)": "FedBiP-M",
    "FedBiP-L (10 z(T) per image)": "FedBiP-L",
    "FedBiP-S": "FedBiP-S, 2 passes of one z(T)",
    "FedBiP-M": "FedBiP-M, 5 passes of one z(T)",
    "FedBiP-L": "FedBiP-L, 10 passes of one z(T)",
    "FedBiP-mixture (2 z(T) per image)": "FedBiP-mixture",
    "FedBiP-S 4 concepts per class (2 z(T) per image)": "FedBiP-S, 4 concepts per class",
    "FedBiP-mixture-DP epsilon 4": "FedBiP-mixture-DP eps 4",
    "FedBiP-mixture-DP epsilon 1": "FedBiP-mixture-DP eps 1",
    "FedBiP-mixture-DP epsilon 16": "FedBiP-mixture-DP eps 16",
    "FedLD-DP epsilon 4": "FedLD-DP eps 4",
}
NAMES_VERSION = 2  # seed caches without it name rows as LEGACY_NAMES says
# sees no client image: the DCR AUC the member and non-member images give by themselves
NO_DATA_CONTROL = "Prompts-only"
# the paper's ablation order, best first (its Tables 1 and 3): each row against the next
ABLATION = ("FedBiP-L", "FedBiP-M", "FedBiP-S", "instance-only", "concept-only", "Prompts-only")
# the comparisons the README and BENCHMARKS.md draw, as (row A, row B): A minus B
COMPARISONS: tuple[tuple[str, str], ...] = (
    # FedBiP as the default federation uploads against the floor and the ceiling
    ("FedBiP-S", "Prompts-only"),
    ("FedBiP-S", "Central"),
    ("FedBiP-L", "Prompts-only"),
    ("FedBiP-L", "Central"),
    ("FedBiP-L", "FedBiP-S"),
    # the peers, each against FedBiP as the default federation uploads
    *(("FedBiP-S", peer) for peer in ("FedLD", "Espresso", "OSCAR", "FedPFT", "FedLMG-FT")),
    ("OSCAR", "Prompts-only"),  # what the uploaded caption encodings add to the class names
    # the mixture mode, and what its DP guarantee costs
    ("FedBiP-S", "FedBiP-mixture"),
    ("FedBiP-S", "FedBiP-mixture-DP eps 4"),
    ("FedBiP-mixture", "FedBiP-mixture-DP eps 4"),
    ("FedBiP-mixture-DP eps 4", "Prompts-only"),
    *zip(ABLATION, ABLATION[1:]),
)
NOT_DISTINGUISHABLE = "not distinguishable at this budget"


def variant(name: str) -> Variant:
    for v in VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(v.name for v in VARIANTS)}")


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def available(names: Sequence[str]) -> list[Variant]:
    """The named variants whose method this installation has (FedAvg runs Flower's own)."""
    known = set(methods.names())
    return [v for v in map(variant, names) if v.method in known]


# ------------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class Bench:
    settings: Settings
    work: Path  # run folders and FLWR_HOMEs (big: shards)
    results: Path  # benchmarks/ (cached results, summary, pictures)
    threads: int = 2
    timeout_s: float = 6 * 3600

    def seed_folder(self, seed: int) -> Path:
        return self.work / f"seed-{seed}"

    def cache(self, seed: int) -> Path:
        return self.results / "methods" / f"seed-{seed}.json"


# DOMIAS's reference: the base model's public images of a client's domain (its pretraining split)
DOMIAS_REFERENCE_PER_CLASS = 50
# what a row records of its own run, kept when it is measured again from a folder
RUN_RECORD = frozenset({"server_seconds", "client_seconds", "upload_bytes", "fedavg_rounds"})
SERVER_ATTACK = "server_attack"  # a row's key for the server's test on its uploads
JUDGES = "judges_on_real"  # a row's key: the real-image accuracy of the judges that judged it
NON_MEMBER_CLIENT = 1  # the shapes world's second client of a domain: images no client here holds


def base_values(bench: Bench, seed: int) -> dict[str, Any]:
    """The run config every variant of a seed shares."""
    return {
        **bench.settings.run_config,
        "domains": ",".join(bench.settings.domains),
        "classifier-steps": bench.settings.classifier_steps,
        "seed": seed,
        "replayable-client-noise": True,  # a benchmark replays the same clients for every method
        "evaluation": "server",
        "output-dir": str(bench.seed_folder(seed)),
    }


def copy_uploads(source: RunFolder, target: RunFolder) -> None:
    """Start ``target`` from ``source``'s round: its uploads and shards (hard links), never its
    results, so the ServerApp resumes after the round."""
    if target.root.exists():
        shutil.rmtree(target.root)
    target.root.mkdir(parents=True)
    for folder in (source.payloads, source.shards):
        if folder.exists():
            shutil.copytree(folder, target.root / folder.name, copy_function=os.link)
    for path in (source.clients, source.uploaders):
        if path.exists():
            shutil.copy2(path, target.root / path.name)


def variant_values(bench: Bench, v: Variant, seed: int) -> dict[str, Any]:
    """The run config of the variant's run for ``seed``."""
    images = bench.settings.run_config["shots-per-class"] * len(dataset_classes())
    return {**base_values(bench, seed), **v.run_values(bench.settings, images)}


def run_variant(bench: Bench, v: Variant, seed: int) -> RunFolder:
    """One ``flwr run`` of the variant; its run folder once the run completed."""
    seed_folder = bench.seed_folder(seed)
    folder = run_folder(bench, seed, v.name)
    if v.reuse:
        copy_uploads(run_folder(bench, seed, v.reuse), folder)
    elif folder.root.exists():
        shutil.rmtree(folder.root)
    values = {**variant_values(bench, v, seed), "run-name": folder.root.name}
    home = seed_folder / "flwr-home"
    threads = str(bench.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    log.info("seed %d: %s", seed, v.name)
    try:
        run_id, output = run_simulation(
            home, values, len(bench.settings.domains), bench.timeout_s, project_dir(), env=env
        )
        status = run_status(home, run_id)
    finally:
        stop_local_superlink(home)
    if status != "finished:completed" or not folder.metrics.exists():
        raise SimulationError(f"{v.name}, seed {seed}: run {status}\n{output[-3000:]}")
    return folder


def dataset_classes() -> list[str]:
    return dataset.class_names(FedBiPConfig().data)


# --------------------------------------------------------------------------- measurements
def measure(folder: RunFolder, judges: Judges, settings: Settings) -> dict[str, Any]:
    """What one finished run shows: accuracy, bytes, seconds, fidelity, privacy."""
    record = read_results(folder.metrics)
    cfg = FedBiPConfig.from_recorded(record.config)
    result: dict[str, Any] = {
        "per_domain": record.accuracy.per_domain,
        "mean": record.accuracy.mean,
        # the round is the clients' time, counted as theirs
        "server_seconds": record.seconds.model_dump(exclude_none=True, exclude={"round"}),
        "sgd_steps": cfg.classifier_steps,
    }
    if record.clients is not None:
        outcomes = [c for c in record.clients if c.status in ("accepted", "kept")]
        result["upload_bytes"] = {c.client_id: c.payload_bytes for c in outcomes}
        result["client_seconds"] = {
            c.client_id: (c.metrics or {}).get(SENT_SECONDS) for c in outcomes
        }
    else:  # FedAvg: what it federates (the whole model, or the head) goes up from every client each round
        sent = methods.create_for(cfg).federated(load_classifier(folder, cfg)).state_dict()
        weights = sum(t.numel() * t.element_size() for t in sent.values())
        result["upload_bytes"] = {"every client": weights * cfg.settings_of("fedavg").rounds}
        result["fedavg_rounds"] = cfg.settings_of("fedavg").rounds
    clients = client_sets(cfg)
    if folder.training_set.exists():
        shards = folder.training_shards()
        result["num_images"] = sum(len(ShardImages(paths, 0)) for paths in shards.values())
        result["fidelity"], result["nearest_real"], result["dcr"] = {}, {}, {}
        result[JUDGES] = judges.accuracy_on_real  # judges differ between machines: which judged
        # a base model without a shipped backbone (the tests' tiny one) is measured in pixels only
        features = backbone_features(cfg.model) if backbone_path(cfg.model).is_file() else None
        for client_id, paths in sorted(shards.items()):
            data = ShardImages(paths, judges.size)
            images, labels = data[torch.arange(len(data))]
            domain = clients[client_id].domain
            result["fidelity"][domain] = judges.fidelity(images, labels, domain)
            result["nearest_real"][domain] = nearest_real_distance(
                images, clients[client_id].images
            )
            result["dcr"][domain] = distance_membership(images, clients[client_id], cfg, features)
        if reconstructs_images(cfg):
            result["reconstruction"] = {
                clients[c].domain: reconstruction(
                    ShardImages(paths, cfg.image_size), clients[c], cfg
                )
                for c, paths in sorted(shards.items())
            }
    if upload_test(cfg.method) and folder.persisted_payloads():
        result[SERVER_ATTACK] = server_attacks(folder, cfg, clients)
    if folder.classifier.exists():
        model = load_classifier(folder, cfg)
        result["mia_gap"], result["mia"] = membership_inference(
            model, cfg, clients, settings.mia_per_domain
        )
    return result


def load_classifier(folder: RunFolder, cfg: FedBiPConfig) -> torch.nn.Module:
    return load_classifier_bytes(folder.classifier.read_bytes(), dataset.class_names(cfg.data))


def client_sets(cfg: FedBiPConfig) -> dict[str, dataset.ClientSet]:
    """The benchmark's clients, one per domain, exactly as the simulation's nodes load them."""
    sets = [dataset.load_client_data(cfg.data, p) for p in range(len(cfg.domain_list))]
    return {s.client_id: s for s in sets}


def unseen_images(domain: str, cfg: FedBiPConfig, size: int) -> shapes.ImageSet:
    """As many images of ``domain`` as a client holds, of the same classes in the same order,
    that no client of the run holds: every membership test's non-members."""
    return shapes.client_train_set(domain, cfg.shots_per_class, NON_MEMBER_CLIENT, cfg.seed, size)


def distance_membership(
    synthetic: torch.Tensor,
    members: dataset.ClientSet,
    cfg: FedBiPConfig,
    features: Features | None,
) -> dict[str, float]:
    """Does a client's synthetic set give away which images it holds? Its private images
    (members) against as many unseen images of the same domain and classes (another client
    index of the shapes world: non-members), each one's distance to its nearest synthetic image
    (:func:`fedbip_tools.privacy.dcr_membership`), in pixels and in the public backbone's
    features: membership AUC (0.5: nothing given away) and the share of members nearer than
    every non-member; and in features DOMIAS's density ratio against the LDM's public images
    of the domain (:func:`fedbip_tools.privacy.density_ratio_membership`), AUC and TPR at 1%
    FPR."""
    synthetic = (
        synthetic.float() / 127.5 - 1.0 if synthetic.dtype == torch.uint8 else synthetic.float()
    )
    size = members.images.shape[-1]
    if synthetic.shape[-1] != size:
        synthetic = F.interpolate(synthetic, size=(size, size), mode="bilinear", antialias=True)
    non_members = unseen_images(members.domain, cfg, size)
    pixels = dcr_membership(members.images, non_members.images, synthetic)
    out = {"pixel_auc": pixels.auc, "pixel_share": pixels.share_closer}
    if features is not None:
        feature = dcr_membership(members.images, non_members.images, synthetic, features)
        out.update(feature_auc=feature.auc, feature_share=feature.share_closer)
        public = shapes.pretrain_set(members.domain, DOMIAS_REFERENCE_PER_CLASS, cfg.seed, size)
        domias = density_ratio_membership(
            members.images, non_members.images, synthetic, public.images, features
        )
        out.update(domias_auc=domias.auc, domias_tpr=domias.tpr_at_max_fpr)
    return out


def server_attacks(
    folder: RunFolder, cfg: FedBiPConfig, clients: Mapping[str, dataset.ClientSet]
) -> dict[str, dict[str, float]]:
    """The server's membership test on each upload the run accepted, read back from the run
    folder through the method's own acceptance (:mod:`fedbip_tools.upload_attacks`): the
    client's private images against as many unseen images of its domain and classes (DCR's
    non-members), referenced by public images of the domain. Per domain: AUC, its standard
    error and TPR at 1% FPR."""
    ldm = functools.cache(
        lambda: load_for_run(cfg.model, "cpu", cfg.half_precision, cfg.image_size)
    )
    server = ServerJob(cfg, dataset.class_names(cfg.data), ldm)
    method = methods.one_shot_for(cfg)
    out = {}
    for client_id, path in folder.persisted_payloads().items():
        members = clients[client_id]
        size = members.images.shape[-1]
        public = shapes.pretrain_set(members.domain, REFERENCE_PER_CLASS, cfg.seed, size)
        others = unseen_images(members.domain, cfg, size)
        upload = method.accept(path.read_bytes(), server)
        found = attack_upload(upload, Candidates(members, others), ServerView(cfg, ldm, public))
        out[members.domain] = {
            "auc": found.auc,
            "auc_stderr": found.auc_stderr,
            "tpr_at_low_fpr": found.tpr_at_max_fpr,
            "members": len(found.member_scores),
        }
    return out


def nearest_real_distance(synthetic: torch.Tensor, real: torch.Tensor) -> float:
    """Mean over synthetic images of the RMS pixel distance (in [-1, 1]) to the closest real
    image of the same client: how close a method's images come to what it must not reveal."""
    synthetic = synthetic.float() / 127.5 - 1.0 if synthetic.dtype == torch.uint8 else synthetic
    if synthetic.shape[-2:] != real.shape[-2:]:
        synthetic = F.interpolate(synthetic, size=real.shape[-2:], mode="bilinear", antialias=True)
    a, b = synthetic.flatten(1).float(), real.flatten(1).float()
    return float((torch.cdist(a, b).min(dim=1).values / math.sqrt(a.shape[1])).mean())


def balanced(labels: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of up to ``n`` examples, the same number from every class."""
    classes = labels.unique()
    per_class = max(1, n // len(classes))
    return torch.cat([torch.nonzero(labels == c).flatten()[:per_class] for c in classes])


def membership_inference(
    model: torch.nn.Module, cfg: FedBiPConfig, clients: Mapping[str, dataset.ClientSet], n: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Does the global classifier tell the clients' private images from unseen ones?

    Members: up to ``n`` class-balanced private images per client; non-members: as many unseen
    test images of each client's domain. First, non-member minus member mean loss / entropy
    (paper Sec. 5.5), averaged over clients (about 0: nothing told apart). Second, a
    loss-threshold attack on all clients' members and non-members pooled (hundreds per side,
    one model): AUC with its standard error and the true-positive rate at 1% false positives.
    """
    tests = dataset.load_test_sets(cfg.data, cfg.domain_list)
    gaps: dict[str, list[float]] = {"loss": [], "entropy": []}
    member_losses, other_losses = [], []
    for data in clients.values():
        test = tests[data.domain]
        inside, outside = balanced(data.labels, n), balanced(test.labels, n)
        member = evaluate(
            model, data.images[inside], data.labels[inside], cfg.classifier_image_size
        )
        other = evaluate(
            model, test.images[outside], test.labels[outside], cfg.classifier_image_size
        )
        gaps["loss"].append(other.mean_loss - member.mean_loss)
        gaps["entropy"].append(other.mean_entropy - member.mean_entropy)
        member_losses.append(member.losses)
        other_losses.append(other.losses)
    members, others = torch.cat(member_losses), torch.cat(other_losses)
    attack = loss_membership_inference(members, others)
    pooled = {
        "auc": attack.auc,
        "auc_stderr": attack.auc_stderr,
        "tpr_at_low_fpr": attack.tpr_at_max_fpr,
        "low_fpr": attack.max_fpr,
        "members": len(members),
        "non_members": len(others),
    }
    return {k: statistics.fmean(v) for k, v in gaps.items()}, pooled


def reconstructs_images(cfg: FedBiPConfig) -> bool:
    """Whether the server's synthetic rows are its reconstructions of given private images:
    FedBiP denoising uploaded z(T), each row from one private image."""
    own = cfg.settings_of(cfg.method)
    return isinstance(own, FedBiPSettings) and own.synthesis_start == "uploaded"


def row_sources(client_id: str, n: int, cfg: FedBiPConfig, rows: int) -> torch.Tensor:
    """Which of its ``n`` private images each of a client's ``rows`` synthetic images comes from: pass p's
    image j is denoised from upload row j, which is drawn row ``order[j]``
    (:func:`~fedbip_flwr.instance.upload_order`), from image ``order[j] % N``. The order is
    replayed from the client's generator, which the benchmark's ``replayable-client-noise``
    lets it do (an oracle: a server without that flag cannot)."""
    if not cfg.replayable_client_noise:
        raise ValueError(
            "the server's reconstructions are matched to their images by replaying the "
            "client's upload order: the run needs replayable-client-noise"
        )
    uploaded = n * cfg.settings_of(cfg.method).latents_per_image
    if rows % uploaded:
        raise ValueError(
            f"{client_id}: {rows} synthetic images are not whole passes over {uploaded} z(T)"
        )
    generator = torch.Generator().manual_seed(client_seed(cfg.seed, client_id))
    return (upload_order(uploaded, generator) % n).repeat(rows // uploaded)


def reconstruction(
    data: ShardImages, client: dataset.ClientSet, cfg: FedBiPConfig
) -> dict[str, float]:
    """The server's reconstructions of each of the client's N private images scored by PSNR and
    SSIM against that image and, as the baseline of knowing only the class, against an image of
    the same class no client holds (the shapes world's NON_MEMBER_CLIENT, in the same class
    order). Two reconstructions: one image (the first synthetic image made from image i), and
    the mean of all ``images_averaged`` images made from image i (keys ``averaged_*``), which is
    what a server that knew which rows come from one image could do (:func:`row_sources`)."""
    n = len(client.images)
    size = client.images.shape[-1]
    unrelated = unseen_images(client.domain, cfg, size)
    if not torch.equal(unrelated.labels, client.labels):
        raise ValueError(f"{client.client_id}: the baseline images are not in its class order")
    every = pixels_like(data[torch.arange(len(data))][0], client.images)
    sources = row_sources(client.client_id, n, cfg, len(every))
    first = torch.stack([every[(sources == i).nonzero()[0, 0]] for i in range(n)])
    scored = reconstruction_score(
        averaged_reconstructions(every, sources, n), client.images, unrelated.images
    )
    return {
        **asdict(reconstruction_score(first, client.images, unrelated.images)),
        **{f"averaged_{k}": v for k, v in asdict(scored).items()},
        "images_averaged": len(data) // n,
    }


def pixels_like(images: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Synthetic rows as float in [-1, 1] at the reference images' size."""
    out = images.float() / 127.5 - 1.0 if images.dtype == torch.uint8 else images.float()
    size = reference.shape[-1]
    return (
        out
        if out.shape[-1] == size
        else F.interpolate(out, size=(size, size), mode="bilinear", antialias=True)
    )


# ---------------------------------------------------------------------------------- seeds
def run_seed(
    bench: Bench, seed: int, names: Sequence[str], judges: Judges, *, remeasure: bool = False
) -> dict[str, Any]:
    """Every named variant for one seed (reused ones after their source), cached as it goes;
    a cached row made on another model than the project's is made again on it.
    ``remeasure``: a cached row whose run folder is still here is measured again from it (new
    columns without a new run); a row whose folder is gone stays as cached."""
    cache = bench.cache(seed)
    stored = json.loads(cache.read_text()) if cache.exists() else {}
    if stored.get("settings") != bench.settings.digest():
        stored = {"settings": bench.settings.digest(), "names": NAMES_VERSION, "results": {}}
    results = named(stored)["results"]
    root = project_dir() or Path.cwd()
    model = provenance.model_digest(root / FedBiPConfig().model)  # the LDM every run loads
    for v in ordered(available(names)):
        if v.name in results and results[v.name].get("model") == model:
            if remeasure and (
                measured := measure_again(bench, seed, v.name, results[v.name], judges)
            ):
                results[v.name] = measured
                write_json(cache, stored)
            continue
        if v.name in results:
            log.info("seed %d: %s was made on model %s; remaking it on %s", seed, v.name,
                     results[v.name].get("model", provenance.UNRECORDED), model)  # fmt: skip
        made = provenance.record(root, bench.threads, [bench.results])
        started, load = time.perf_counter(), os.getloadavg()[0]
        folder = run_variant(bench, v, seed)
        results[v.name] = {
            **measure(folder, judges, bench.settings),
            "wall_seconds": time.perf_counter() - started,
            "load_average": (load + os.getloadavg()[0]) / 2,  # seconds mean little under load
            "provenance": made,  # as the run started: the code it ran
            "model": model,
        }
        write_json(cache, stored)
        log.info("seed %d: %s mean accuracy %.3f", seed, v.name, results[v.name]["mean"])
    return results


def measure_again(
    bench: Bench, seed: int, name: str, cached: dict[str, Any], judges: Judges
) -> dict[str, Any] | None:
    """The cached row with every measurement taken again from its run folder, or None where the
    folder is gone or holds another run (its accuracy is not the row's)."""
    folder = run_folder(bench, seed, name)
    if not folder.metrics.exists():
        log.info("seed %d: %s has no run folder here; kept as cached", seed, name)
        return None
    found = read_results(folder.metrics).accuracy.per_domain  # before the costly measurements
    if found != cached["per_domain"]:
        log.warning(
            "seed %d: %s's run folder holds another run (accuracy %s, cached %s); kept as cached",
            seed,
            name,
            found,
            cached["per_domain"],
        )
        return None
    measured = measure(folder, judges, bench.settings)
    log.info("seed %d: %s measured again from its run folder", seed, name)
    # the folder may hold a later run of the same settings (same accuracy): the seconds and
    # bytes stay those of the run the row records
    return {**cached, **{k: v for k, v in measured.items() if k not in RUN_RECORD}}


def ordered(chosen: Sequence[Variant]) -> list[Variant]:
    """Sources before the variants that reuse them (added if not chosen)."""
    out: list[Variant] = []
    for v in chosen:
        for needed in (variant(v.reuse),) if v.reuse else ():
            if needed not in out:
                out.append(needed)
        if v not in out:
            out.append(v)
    return out


def cached_seeds(bench: Bench) -> dict[int, dict[str, Any]]:
    """Every seed's cached results made with this benchmark's settings."""
    runs = {}
    for path in sorted((bench.results / "methods").glob("seed-*.json")):
        stored = json.loads(path.read_text())
        if stored.get("settings") == bench.settings.digest():
            runs[int(path.stem.removeprefix("seed-"))] = named(stored)["results"]
    return runs


def named(stored: dict[str, Any]) -> dict[str, Any]:
    """A seed cache with its rows under today's names (:data:`LEGACY_NAMES` for one written
    before them), marked so."""
    if stored.get("names") != NAMES_VERSION:
        stored["results"] = {LEGACY_NAMES.get(k, k): v for k, v in stored["results"].items()}
        stored["names"] = NAMES_VERSION
    return stored


# -------------------------------------------------------------------------------- summary
def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def _average(values: list[Any]) -> Any:
    """Mean over seeds of numbers, or of (nested) dicts of numbers, key by key; None (a dash in
    the tables) for whatever some seed did not measure, so that no mean is of fewer seeds than
    the row's accuracy."""
    if not values or any(v is None for v in values):
        return None
    if isinstance(values[0], dict):
        shared = [k for k in values[0] if all(k in v for v in values)]
        return {k: _average([v[k] for v in values]) for k in shared} or None
    return statistics.fmean(values)


def summarize(
    runs: Mapping[int, Mapping[str, Any]], *, mix_machine_kinds: bool = False
) -> dict[str, Any]:
    """Per variant: per-domain and mean accuracy (mean and sample std over seeds), the mean over
    seeds of every other measurement, and what the seeds were made with. A row whose seeds span
    machine kinds raises :class:`~fedbip_tools.provenance.MixedMachineKinds` unless
    ``mix_machine_kinds``."""
    out: dict[str, Any] = {}
    for v in VARIANTS:
        seeds = sorted(s for s, r in runs.items() if v.name in r)
        if not seeds:
            continue
        rows = [runs[s][v.name] for s in seeds]
        domains = list(rows[0]["per_domain"])
        means = [r["mean"] for r in rows]
        entry = {
            "seeds": seeds,
            "made_with": provenance.made_with({s: runs[s][v.name] for s in seeds}),
            "per_domain": {d: statistics.fmean(r["per_domain"][d] for r in rows) for d in domains},
            "per_domain_std": {d: _std([r["per_domain"][d] for r in rows]) for d in domains},
            "mean": statistics.fmean(means),
            "std": _std(means),
        }
        for key in (
            set().union(*rows)
            - entry.keys()
            - {"per_domain", "mean", "provenance", "model", SERVER_ATTACK, JUDGES}
        ):
            entry[key] = _average([r.get(key) for r in rows])
        if entry.get("fidelity"):
            entry[JUDGES] = {str(s): r.get(JUDGES) for s, r in zip(seeds, rows)}
        if attacked := {s: r[SERVER_ATTACK] for s, r in zip(seeds, rows) if SERVER_ATTACK in r}:
            entry[SERVER_ATTACK] = server_attack_summary(attacked)
        if entry.get("mia_gap"):
            entry["mia_gap_std"] = {
                k: _std([r["mia_gap"][k] for r in rows]) for k in entry["mia_gap"]
            }
        if all("mia" in r for r in rows):
            entry["mia_auc_std"] = _std([r["mia"]["auc"] for r in rows])
        out[v.name] = entry
    provenance.refuse_mixed_models({name: e["made_with"] for name, e in out.items()})
    if not mix_machine_kinds:
        provenance.refuse_mixed({name: e["made_with"] for name, e in out.items()})
    return out


def server_attack_summary(per_seed: Mapping[int, Mapping[str, Mapping[str, float]]]) -> dict:
    """The server's test on the uploads over the seeds whose run folders it was run on (not
    every seed's may be: it needs the accepted uploads): per domain AUC mean and sample std,
    TPR at 1% FPR mean, and which seeds."""
    domains = set.intersection(*(set(d) for d in per_seed.values()))
    return {
        "seeds": sorted(per_seed),
        "per_domain": {
            d: {
                "auc": statistics.fmean(r[d]["auc"] for r in per_seed.values()),
                "auc_std": _std([r[d]["auc"] for r in per_seed.values()]),
                "auc_stderr": statistics.fmean(r[d]["auc_stderr"] for r in per_seed.values()),
                "tpr_at_low_fpr": statistics.fmean(
                    r[d]["tpr_at_low_fpr"] for r in per_seed.values()
                ),
            }
            for d in sorted(domains)
        },
    }


# The server's tests on each row's upload kind made by ``scripts/server_attacks.py`` (one record
# per seed of the clients' randomness): at the run's latent size (4x16x16) and at Stable
# Diffusion's (the world rendered at 256 px through the miniature's encoder, frozen since the first
# model, so both LDMs' latents are bit for bit the same, and noised with SD v1-4's schedule). A
# latent upload depends on the encoder, the schedule, T, the z(T) per image (and a DP release on
# its epsilon), not on what a run learned: a row takes its kind's figures where its run folders are
# gone (4x16x16) or never had that size (4x64x64).
ATTACK_RECORDS = (
    "server_attacks.json",
    "server_attacks_seed1.json",
    "server_attacks_seed2.json",
    "server_attacks_mixtures.json",
    "server_attacks_means.json",
    "server_attacks_t961_seed0.json",
    "server_attacks_t961_seed1.json",
    "server_attacks_t961_seed2.json",
    "server_attacks_sd_seed0.json",
    "server_attacks_sd_seed1.json",
    "server_attacks_sd_seed2.json",
    "server_attacks_classifier_seed0.json",
    "server_attacks_classifier_seed1.json",
    "server_attacks_classifier_seed2.json",
    "server_attacks_classifier_pretrained_seed0.json",
    "server_attacks_classifier_pretrained_seed1.json",
    "server_attacks_classifier_pretrained_seed2.json",
    "server_attacks_fedavg_seed0.json",
    "server_attacks_fedavg_seed1.json",
    "server_attacks_fedavg_seed2.json",
)
LARGE_SIZE = 256  # px: 4x64x64 latents through the miniature's 4x downsampling VAE
# the statistic each latent upload kind is tested with, as scripts/server_attacks.py names it
STAND_IN_ATTACKS = {
    "fedbip": "rows/likelihood-ratio",
    "fedbip-mixture": "fedbip-mixture/mean-filter",
    "fedld": "fedld/mean-filter",
    "espresso": "espresso/mean-filter",
}
# a DP upload's class statistics, released by the method's own code at the record's size
DP_STAND_INS = {"fedld": "fedld-dp", "fedbip-mixture": "fedbip-mixture-dp-stats"}
# a mean per class of what the server can compute from an image (the public backbone's features,
# the shipped captioner's states): the same at any image size, so made at the run's only
MEAN_STAND_INS = ("fedpft", "oscar")
# the client's own classifier (Local's upload, FedLMG's guide: one client step): its recipe on the
# same world's images, not the LDM; images at the run's size only, no latent to scale
CLASSIFIER_STAND_INS = ("local", "fedlmg")
CLASSIFIER_ATTACK = "fedlmg/loss"  # as scripts/server_attacks.py names the loss test
# FedAvg's replies, every round (kept by no run folder: the records simulate its rounds with its
# own client step and Flower's average): kind -> what travels (fedavg.part), and the statistic
# a row is given: the last round's reply's loss, the strongest of the three the records hold
# (chosen after measuring; the loss drop fixed before it was weaker: BENCHMARKS.md)
FEDAVG_KINDS = {"fedavg": "all", "fedavg-head": "head"}
FEDAVG_ATTACK = "loss-last"
RECORD_ONLY_TESTS = {"fedavg": "last round's reply loss"}
SERVER_ATTACK_STAND_IN = "server_attack_stand_in"  # a row's key for its kind's run-size figures
SERVER_ATTACK_LARGE = "server_attack_large"  # a row's key for the figures at SD's latent size


def stand_in_setting(bench: Bench, v: Variant, timestep: int, size: int) -> tuple[str, str] | None:
    """The record key and attack standing in for the row's upload at ``size`` px, or None:
    images, or a classifier, FedAvg's replies or a class mean at SD's latent size."""
    if v.method in MEAN_STAND_INS:
        return None if size >= LARGE_SIZE else (f"{size}px/{v.method}", f"{v.method}/class-mean")
    if v.method in (*CLASSIFIER_STAND_INS, *RECORD_ONLY_TESTS) and size >= LARGE_SIZE:
        return None
    cfg = FedBiPConfig.from_flat(variant_values(bench, v, 0))
    own = cfg.settings_of(v.method)
    if v.method == "fedavg":
        kind = next(k for k, part in FEDAVG_KINDS.items() if part == own.part)
        return fedavg_key(size, cfg), f"{kind}/{FEDAVG_ATTACK}"
    if v.method in CLASSIFIER_STAND_INS:
        epochs = getattr(own, "local_epochs", None) or own.epochs
        return classifier_key(size, cfg.classifier_init, epochs), CLASSIFIER_ATTACK
    if getattr(own, "private", False):
        kind = DP_STAND_INS[v.method]
        return f"{size}px/T={timestep}/{kind}/epsilon={own.dp_epsilon:g}", f"{kind}/mean-filter"
    attack = STAND_IN_ATTACKS.get(v.method)
    if attack is None:
        return None
    draws = getattr(own, "latents_per_image", None) or own.noisings
    return f"{size}px/T={timestep}/K={draws}", attack


def classifier_key(size: int, init: str, epochs: int) -> str:
    """A server_attacks record's key for a client classifier's upload: its start and epochs."""
    return f"{size}px/classifier/init={init}/epochs={epochs}"


def fedavg_key(size: int, cfg: FedBiPConfig) -> str:
    """A server_attacks record's key for a FedAvg run's replies: what travels, from where, and
    how many rounds of how many local epochs (a head always starts on the public backbone)."""
    own = cfg.settings_of("fedavg")
    start = "pretrained" if own.part == "head" else cfg.classifier_init
    return (
        f"{size}px/fedavg/part={own.part}/init={start}/rounds={own.rounds}"
        f"/local-epochs={own.local_epochs}"
    )


def record_seed(record: Mapping[str, Any]) -> int:
    """The ``--seed`` a server_attacks record was made with (0 where the command left it out)."""
    words = record["command"].split()
    return int(words[words.index("--seed") + 1]) if "--seed" in words else 0


def stand_in_attacks(
    bench: Bench, timestep: int, size: int, names: Sequence[str]
) -> dict[str, dict]:
    """Per row with a stand-in at ``size`` px: its kind's AUC over the records' seeds (the
    first record of a seed that holds it), summarized as :func:`server_attack_summary` does."""
    records = [
        json.loads(path.read_text())
        for path in (bench.results / name for name in ATTACK_RECORDS)
        if path.exists()
    ]
    out = {}
    for name in names:
        setting = stand_in_setting(bench, variant(name), timestep, size)
        if setting is None:
            continue
        key, attack = setting
        per_seed: dict[int, dict[str, dict[str, float]]] = {}
        for record in records:
            found = {
                domain: {
                    "auc": a["auc"],
                    "auc_stderr": a["auc_stderr"],
                    "tpr_at_low_fpr": a["tpr_at_max_fpr"],
                }
                for domain, settings in record["results"].items()
                if (a := settings.get(key, {}).get("attacks", {}).get(attack))
            }
            if found:
                per_seed.setdefault(record_seed(record), found)
        if per_seed:
            out[name] = {**server_attack_summary(per_seed), "setting": key, "attack": attack}
    return out


# The server's loss-ratio test on the conditioning learnt beside the latents (FedBiP's S and V,
# Espresso's conditions): scripts/server_attacks.py's records, the first record of a seed that
# holds a cell counting. At SD's latent size only on the UNet continued at 256 px
# (CONDITIONING_LARGE_MODEL, named by its digest in a record's provenance): the shipped UNet,
# trained at 4x16x16, fails the test's positive control there.
CONDITIONING_RECORDS = (
    "server_attacks_concepts_h200_seed0.json",
    "server_attacks_concepts_h200_seed1.json",
    "server_attacks_concepts_h200_seed2.json",
    "server_attacks_concepts_256px_control_seed0.json",
    "server_attacks_concepts_256px_control_painting_seed1.json",
    "server_attacks_concepts_256px_control_quickdraw_seed0.json",
    "server_attacks_concepts_256px_control_quickdraw_seed1.json",
    "server_attacks_concepts_256px_control_sketch_seed0.json",
    "server_attacks_concepts_256px_control_sketch_seed1.json",
    "server_attacks_concepts_256px_painting_seed0.json",
    "server_attacks_concepts_256px_painting_seed1.json",
    "server_attacks_concepts_256px_painting_seed2.json",
    "server_attacks_concepts_256px_quickdraw_seed0.json",
    "server_attacks_concepts_256px_quickdraw_seed1.json",
    "server_attacks_concepts_256px_quickdraw_seed2.json",
    "server_attacks_concepts_256px_sketch_seed0.json",
    "server_attacks_concepts_256px_sketch_seed1.json",
    "server_attacks_concepts_256px_sketch_seed2.json",
    "server_attacks_conditions_seed0.json",
    "server_attacks_conditions_seed1.json",
    "server_attacks_conditions_seed2.json",
    "server_attacks_conditions_256px_control_seed0.json",
    "server_attacks_conditions_256px_control_painting_seed1.json",
    "server_attacks_conditions_256px_control_quickdraw_seed0.json",
    "server_attacks_conditions_256px_control_sketch_seed0.json",
    "server_attacks_conditions_256px_painting_seed0.json",
    "server_attacks_conditions_256px_painting_seed1.json",
    "server_attacks_conditions_256px_painting_seed2.json",
    "server_attacks_conditions_256px_quickdraw_seed0.json",
    "server_attacks_conditions_256px_quickdraw_seed1.json",
    "server_attacks_conditions_256px_quickdraw_seed2.json",
    "server_attacks_conditions_256px_sketch_seed0.json",
    "server_attacks_conditions_256px_sketch_seed1.json",
    "server_attacks_conditions_256px_sketch_seed2.json",
    "server_attacks_dp_seed0.json",
    "server_attacks_dp_seed1.json",
    "server_attacks_dp_seed2.json",
)
CONDITIONING_LARGE_MODEL = Path("models") / "miniature-ldm-256px"
# the DP mixture mode's concepts (DP-SGD under the rest of the upload's epsilon): its records key
# an upload by its epsilon, the concepts' test one of the upload's attacks
DP_MIXTURE = "fedbip-mixture-dp"
CONCEPT_ATTACK = "concepts/loss-ratio"  # the loss-ratio test on uploaded S and V
DP_CONCEPTS_METHOD = methods.fedbip_mixture.FedBiPMixture.name
CONDITIONING_TESTS = {
    "concepts": "FedBiP's concepts",
    DP_MIXTURE: "fedbip-mixture-DP's concepts",
    "espresso-conditions": "Espresso's conditions",
}


class ConditioningSetting(NamedTuple):
    """A conditioning test's budget and image size, as a server_attacks record keys it."""

    test: str  # a key of CONDITIONING_TESTS
    shots: int  # per class
    epochs: int
    px: int
    epsilon: float | None = None  # a DP upload's

    @property
    def key(self) -> str:
        return f"{self.px}px/{self.test}/shots={self.shots}/epochs={self.epochs}"

    @classmethod
    def of(cls, key: str) -> ConditioningSetting:
        _, test, *budget = key.split("/")
        shots, epochs = (int(part.split("=")[1]) for part in budget)
        return cls(test, shots, epochs, key_px(key))


def key_px(key: str) -> int:
    """The image size of a server_attacks record key (``SIZEpx/...``)."""
    return int(key.split("/")[0].removesuffix("px"))


@dataclass
class ConditioningCell:
    """One domain's loss-ratio test on one conditioning kind, budget and size, per seed."""

    auc: dict[int, float]
    tpr_at_low_fpr: dict[int, float]
    kinds: set[str]  # the machine kinds (a GPU by name) the seeds ran on

    def text(self) -> str:
        """AUC (± sample std over seeds, where more than one) / mean TPR at 1% FPR (seeds)."""
        aucs = list(self.auc.values())
        spread = f" ± {_std(aucs):.3f}" if len(aucs) > 1 else ""
        seeds = ", ".join(map(str, sorted(self.auc)))
        tpr = statistics.fmean(self.tpr_at_low_fpr.values())
        return f"{statistics.fmean(aucs):.3f}{spread} / {tpr:.2f} ({seeds})"


def conditioning_result(
    key: str, entry: Mapping[str, Any], dp_budget: tuple[int, int]
) -> tuple[ConditioningSetting, Mapping[str, Any]]:
    """A record entry's setting and loss-ratio result; a DP upload's (keyed
    ``SIZEpx/fedbip-mixture-dp/epsilon=E``) trained on ``dp_budget`` (shots, epochs)."""
    if "epsilon" not in entry:
        ((_, found),) = entry["attacks"].items()
        return ConditioningSetting.of(key), found
    setting = ConditioningSetting(DP_MIXTURE, *dp_budget, key_px(key), entry["epsilon"])
    return setting, entry["attacks"][f"{DP_MIXTURE}/{CONCEPT_ATTACK}"]


def conditioning_attacks(
    bench: Bench, large_model: str
) -> dict[ConditioningSetting, dict[str, ConditioningCell]]:
    """Per setting, per domain, the loss-ratio test's
    figures over the seeds of :data:`CONDITIONING_RECORDS`; a cell at SD's latent size only
    from a record made on ``large_model`` (a digest). A DP upload's concepts are trained on the
    mixture mode's budget in the run config."""
    cfg = FedBiPConfig.from_flat({**base_values(bench, 0), "method": DP_CONCEPTS_METHOD})
    dp_budget = cfg.shots_per_class, cfg.settings_of(DP_CONCEPTS_METHOD).concept_epochs
    out: dict[ConditioningSetting, dict[str, ConditioningCell]] = {}
    for path in (bench.results / name for name in CONDITIONING_RECORDS):
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        seed, made = record_seed(record), record["provenance"]
        kind = made["machine"]["kind"] if record["device"] == "cpu" else record["device"]
        for domain, settings in record["results"].items():
            for key, entry in settings.items():
                setting, found = conditioning_result(key, entry, dp_budget)
                if setting.px >= LARGE_SIZE and made.get("large_model") != large_model:
                    continue
                cell = out.setdefault(setting, {}).setdefault(
                    domain, ConditioningCell({}, {}, set())
                )
                if seed not in cell.auc:
                    cell.auc[seed] = found["auc"]
                    cell.tpr_at_low_fpr[seed] = found["tpr_at_max_fpr"]
                    cell.kinds.add(kind)
    return out


def conditioning_table(bench: Bench, domains: Sequence[str]) -> str:
    """One line per conditioning kind, budget and latent size the records hold."""
    large_model = provenance.model_digest(project_dir() / CONDITIONING_LARGE_MODEL)
    found = conditioning_attacks(bench, large_model)
    lines = [
        "| upload | budget | latents | " + " | ".join(domains) + " | machine kinds |",
        "|---" * (len(domains) + 4) + "|",
    ]
    tests = list(CONDITIONING_TESTS)
    for (test, shots, epochs, px, epsilon), cells in sorted(
        found.items(), key=lambda item: (tests.index(item[0].test), item[0].epochs, item[0].px)
    ):
        latents = "4x16x16" if px < LARGE_SIZE else f"4x64x64, UNet continued at {LARGE_SIZE} px"
        texts = [cells[d].text() if d in cells else "–" for d in domains]
        kinds = ", ".join(sorted(set().union(*(c.kinds for c in cells.values()))))
        dp = f", DP-SGD, upload epsilon {epsilon:g}" if epsilon is not None else ""
        budget = f"{shots} shots, {epochs} epochs{dp}"
        lines.append(
            f"| {CONDITIONING_TESTS[test]} | {budget} | {latents} | {' | '.join(texts)} | {kinds} |"
        )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Difference:
    """Row ``a`` minus row ``b`` seed by seed, with the mean and its 95% t-interval's
    half-width (None from one seed)."""

    a: str
    b: str
    per_seed: dict[int, float]
    mean: float
    half_width: float | None

    @property
    def distinguishable(self) -> bool:
        """Whether the interval leaves out 0."""
        return self.half_width is not None and abs(self.mean) > self.half_width


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Mean and half-width of the two-sided t-interval over ``values`` (two or more)."""
    n = len(values)
    quantile = float(stats.t.ppf((1 + level) / 2, n - 1))
    return statistics.fmean(values), quantile * statistics.stdev(values) / math.sqrt(n)


def paired(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two rows of a seed compare: made on one machine kind, with one model."""
    return provenance.kind(a) == provenance.kind(b) and a.get("model") == b.get("model")


def paired_difference(runs: Mapping[int, Mapping[str, Any]], a: str, b: str) -> Difference | None:
    """Mean accuracy of ``a`` minus ``b`` over the seeds that have both made on one machine
    kind with one model; None where no seed has."""
    per_seed = {
        seed: rows[a]["mean"] - rows[b]["mean"]
        for seed, rows in sorted(runs.items())
        if a in rows and b in rows and paired(rows[a], rows[b])
    }
    if not per_seed:
        return None
    values = list(per_seed.values())
    mean, half = t_interval(values) if len(values) > 1 else (values[0], None)
    return Difference(a, b, per_seed, mean, half)


def differences(runs: Mapping[int, Mapping[str, Any]]) -> list[Difference]:
    """The paired differences of :data:`COMPARISONS` that some seed has both rows of."""
    found = (paired_difference(runs, a, b) for a, b in COMPARISONS)
    return [d for d in found if d is not None]


@dataclass(frozen=True)
class Sampling:
    """The sampler every row of the benchmark samples with, and its start timestep T."""

    scheduler: str
    steps: int
    spacing: str
    timestep: int


def sampling(bench: Bench) -> Sampling:
    """What the benchmark's pinned run config samples with, T from its model's noise schedule."""
    cfg = FedBiPConfig.from_flat({**base_values(bench, 0), "method": "fedbip"})
    noise = PNDMScheduler.from_config(
        PNDMScheduler.load_config(str(resolve(cfg.model)), subfolder="scheduler")
    )
    steps, spacing = cfg.num_inference_steps, cfg.timestep_spacing
    sampler = Sampler.create(cfg.scheduler, noise, steps, spacing)
    return Sampling(str(cfg.scheduler), steps, spacing, sampler.first_timestep(cfg.start_timestep))


# --------------------------------------------------------------------------------- report
def pct(mean: float, std: float | None = None) -> str:
    return f"{100 * mean:.1f}" + (f" ± {100 * std:.1f}" if std is not None else "")


def kilobytes(entry: Mapping[str, Any]) -> str:
    sizes = list((entry.get("upload_bytes") or {}).values())
    return f"{statistics.fmean(sizes) / 1e3:,.1f}" if sizes else "–"


def seconds(values: Mapping[str, Any] | None) -> str:
    numbers = [v for v in (values or {}).values() if v is not None]
    return f"{statistics.fmean(numbers):.0f}" if numbers else "–"


def accuracy_heading(s: Sampling) -> str:
    return (
        f"### Accuracy (%): sampler `{s.scheduler}` ({s.spacing} spacing), {s.steps} steps, "
        f"T = {s.timestep}\n"
    )


def accuracy_table(summary: Mapping[str, Any], names: Sequence[str]) -> str:
    """Accuracy, bytes and seconds per row, with what its seeds were made with."""
    domains = list(next(iter(summary.values()))["per_domain"])
    lines = [
        "| method | "
        + " | ".join(domains)
        + " | mean | domain fidelity (%), "
        + " / ".join(domains)
        + " | upload per client (kB) | client s | server s | load | seeds | made with |",
        "|---|" + "---|" * (len(domains) + 8),
    ]
    for name in (n for n in names if n in summary):
        e = summary[name]
        cells = [pct(e["per_domain"][d], e["per_domain_std"][d]) for d in domains]
        judged = domain_fidelity_cell(e.get("fidelity"), domains)
        server = sum(v for v in (e.get("server_seconds") or {}).values() if v is not None)
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | **{pct(e['mean'], e['std'])}** | {judged} | {kilobytes(e)} "
            f"| {seconds(e.get('client_seconds'))} | {server:.0f} | {e.get('load_average', float('nan')):.1f} "
            f"| {len(e['seeds'])} | {provenance.cell(e['made_with'])} |"
        )
    return "\n".join(lines) + "\n"


def domain_fidelity_cell(
    fidelity: Mapping[str, Mapping[str, float]] | None, domains: Sequence[str]
) -> str:
    """The share of each domain's synthetic images the judges place in it, beside accuracy:
    a row can score well with images that are not in its clients' domains."""
    if not fidelity or any(d not in fidelity for d in domains):
        return "–"
    return " / ".join(f"{100 * fidelity[d]['domain']:.0f}" for d in domains)


def signed(points: float) -> str:
    return f"{points:+.1f}"


def differences_table(found: Sequence[Difference]) -> str:
    """One line per comparison: per-seed differences, their mean and 95% interval (points)."""
    lines = ["| A − B | seeds | per seed | mean | 95% interval | |", "|---|---|---|---|---|---|"]
    for d in found:
        per_seed = ", ".join(f"{s}: {signed(100 * v)}" for s, v in d.per_seed.items())
        interval = "–"
        if d.half_width is not None:
            low, high = 100 * (d.mean - d.half_width), 100 * (d.mean + d.half_width)
            interval = f"[{signed(low)}, {signed(high)}]"
        higher = d.a if d.mean > 0 else d.b
        verdict = f"{higher} higher" if d.distinguishable else NOT_DISTINGUISHABLE
        cells = [f"{d.a} − {d.b}", str(len(d.per_seed)), per_seed, signed(100 * d.mean), interval]
        lines.append("| " + " | ".join([*cells, verdict]) + " |")
    return "\n".join(lines) + "\n"


def console_lines(summary: Mapping[str, Any]) -> list[str]:
    """The summary as the command prints it: accuracy and, per row, what made its seeds."""
    return [
        f"{name:32s} {100 * e['mean']:5.1f} ± {100 * e['std']:4.1f}  ({len(e['seeds'])} seeds)  "
        f"{provenance.full_text(e['made_with'])}"
        for name, e in summary.items()
    ]


def judges_cell(judged: Mapping[str, Mapping[str, float] | None]) -> str:
    """The judges' accuracy on real images (class / domain, %) per seed of a row, seeds that
    share judges together; a dash for seeds judged before rows recorded it."""
    groups: dict[str, list[str]] = {}
    for seed, on_real in judged.items():
        text = f"{100 * on_real['class']:.1f} / {100 * on_real['domain']:.1f}" if on_real else "–"
        groups.setdefault(text, []).append(seed)
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(
        f"{text} (seed{'s' * (len(seeds) > 1)} {', '.join(seeds)})"
        for text, seeds in groups.items()
    )


def fidelity_table(summary: Mapping[str, Any]) -> str:
    names = [n for n, e in summary.items() if e.get("fidelity")]
    if not names:
        return ""
    domains = list(summary[names[0]]["fidelity"])
    lines = [
        "| method | " + " | ".join(domains) + " | images | judges on real images (%) |",
        "|---|" + "---|" * (len(domains) + 2),
    ]
    for name in names:
        e = summary[name]
        fid = e["fidelity"]
        cells = (f"{100 * fid[d]['class']:.0f} / {100 * fid[d]['domain']:.0f}" for d in domains)
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {e['num_images']:.0f} | "
            f"{judges_cell(e.get(JUDGES, {}))} |"
        )
    return "\n".join(lines) + "\n"


def privacy_table(summary: Mapping[str, Any]) -> str:
    lines = [
        "| method | MIA loss gap | MIA entropy gap | MIA AUC, pooled | TPR at 1% FPR | nearest real (RMS) | "
        "DCR AUC, pixels | DCR AUC, features | members nearer than every non-member (pixels) | "
        "DOMIAS AUC, features | "
        "reconstruction PSNR (dB), own / same-class | SSIM, own / same-class | "
        "mean of an image's reconstructions, PSNR (dB) own / same-class |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in summary.items():
        if not e.get("mia_gap"):
            continue
        gap = e["mia_gap"]
        std = e["mia_gap_std"]
        near = e.get("nearest_real")
        near = f"{statistics.fmean(near.values()):.3f}" if near else "–"
        cells = dcr_cells(e, summary.get(NO_DATA_CONTROL))
        lines.append(
            f"| {name} | {gap['loss']:+.3f} ± {std['loss']:.3f} | "
            f"{gap['entropy']:+.3f} ± {std['entropy']:.3f} | {' | '.join(attack_cells(e))} | {near} | "
            f"{' | '.join(cells)} | {' | '.join(reconstruction_cells(e.get('reconstruction')))} |"
        )
    return "\n".join(lines) + "\n"


def server_attack_cells(found: Mapping[str, Any] | None, domains: Sequence[str]) -> list[str]:
    """AUC (± its std over seeds, where more than one) / TPR at 1% FPR per domain; a dash where
    not measured."""
    if not found:
        return ["–"] * len(domains)
    spread = len(found["seeds"]) > 1
    return [
        f"{a['auc']:.3f}"
        + (f" ± {a['auc_std']:.3f}" if spread else "")
        + f" / {a['tpr_at_low_fpr']:.2f}"
        if (a := found["per_domain"].get(d))
        else "–"
        for d in domains
    ]


def server_attack_table(summary: Mapping[str, Any], domains: Sequence[str]) -> str:
    """One line per row whose upload the server can test: at the run's latents from its run
    folders (else from its upload kind's records), and at SD's latent size from its upload
    kind's records; then the rows without."""
    lines = [
        "| method | the server's test | "
        + " | ".join(f"{d}, 4x16x16" for d in domains)
        + " | 4x16x16: seeds (of the row's) | "
        + " | ".join(f"{d}, 4x64x64" for d in domains)
        + " | 4x64x64: records' seeds |",
        "|---" * (2 * len(domains) + 4) + "|",
    ]
    untestable = []
    for name, e in summary.items():
        method = variant(name).method
        test = upload_test(method)
        statistic = test.statistic if test else RECORD_ONLY_TESTS.get(method)
        if statistic is None:
            untestable.append(name)
            continue
        found, large = e.get(SERVER_ATTACK), e.get(SERVER_ATTACK_LARGE)
        stand_in = e.get(SERVER_ATTACK_STAND_IN)
        if found and len(found["seeds"]) >= len(stand_in["seeds"] if stand_in else []):
            seeds = f"run folders {', '.join(map(str, found['seeds']))} ({len(e['seeds'])})"
        elif found := stand_in:
            seeds = f"records {', '.join(map(str, found['seeds']))}"
        else:
            seeds = f"none ({len(e['seeds'])})"
        large_seeds = ", ".join(map(str, large["seeds"])) if large else "–"
        cells = [
            *server_attack_cells(found, domains),
            seeds,
            *server_attack_cells(large, domains),
            large_seeds,
        ]
        lines.append(f"| {name} | {statistic} | {' | '.join(cells)} |")
    lines.append("")
    if untestable:
        lines.append(f"No test (class counts only): {', '.join(untestable)}.")
    return "\n".join(lines) + "\n"


def dcr_cells(entry: Mapping[str, Any], control: Mapping[str, Any] | None) -> list[str]:
    """DCR membership AUC in pixels and features, the members' share nearer than every
    non-member, and DOMIAS's AUC, means over clients; each AUC with its difference from the no-data control's on
    the same seeds, since the member and non-member images alone set where an AUC sits."""

    def mean(e: Mapping[str, Any] | None, key: str) -> float | None:
        dcr = (e or {}).get("dcr")
        return (
            statistics.fmean(d[key] for d in dcr.values())
            if dcr and all(key in d for d in dcr.values())
            else None
        )

    cells = []
    for key in ("pixel_auc", "feature_auc", "pixel_share", "domias_auc"):
        value = mean(entry, key)
        base = (
            mean(control, key)
            if control and control["seeds"] == entry["seeds"] and key != "pixel_share"
            else None
        )
        cells.append(
            "–"
            if value is None
            else f"{value:.3f}" + (f" ({value - base:+.3f})" if base is not None else "")
        )
    return cells


def attack_cells(entry: Mapping[str, Any]) -> list[str]:
    """The pooled loss attack's AUC (mean ± std over seeds) and TPR at its low FPR; dashes
    unless every seed of the row measured it."""
    mia = entry.get("mia")
    if mia is None or "mia_auc_std" not in entry:
        return ["–", "–"]
    return [f"{mia['auc']:.3f} ± {entry['mia_auc_std']:.3f}", f"{mia['tpr_at_low_fpr']:.3f}"]


def reconstruction_cells(per_domain: Mapping[str, Mapping[str, float]] | None) -> list[str]:
    """PSNR and SSIM of the server's reconstructions against the images and against the
    same-class baseline, means over clients, one image and then the mean of all of an image's
    (with how many); dashes where the server holds no per-image latent or a row predates the
    averaged column."""
    if not per_domain:
        return ["–", "–", "–"]
    mean = {
        k: statistics.fmean(d[k] for d in per_domain.values())
        for k in next(iter(per_domain.values()))
    }
    cells = [
        f"{mean['psnr']:.2f} / {mean['baseline_psnr']:.2f}",
        f"{mean['ssim']:.3f} / {mean['baseline_ssim']:.3f}",
    ]
    if "images_averaged" not in mean:
        return [*cells, "–"]
    return [
        *cells,
        f"{mean['averaged_psnr']:.2f} / {mean['averaged_baseline_psnr']:.2f} "
        f"(mean of {mean['images_averaged']:.0f})",
    ]


PUBLISHED = """\
| paper (its own setting) | numbers, average top-1 % |
|---|---|
| FedBiP, DomainNet 10 classes, 6 domains, SD v1-4 (its Table 1, 3) | FedAvg 61.49, Central 73.42, FGL 61.69, FedBiP-S / M / L 61.51 / 64.86 / 67.82; quickdraw: FedAvg 16.26, FedBiP-L 51.85; ablation: no personalization 60.22, both levels 67.65 |
| OSCAR, DomainNet 90 classes (its Table I) | OSCAR 37.60; quickdraw 10.02 |
| FedLMG, DomainNet 90 classes (its Table 1) | Ceiling 36.89, FedAvg 29.09, Prompts Only 28.61, FedLMG FT / SD / MD 34.28 / 35.90 / 35.99 |
"""


def markdown(
    summary: Mapping[str, Any],
    bench: Bench,
    command: str,
    judged: Mapping[str, Mapping[str, float]],
    found: Sequence[Difference],
    sampled: Sampling,
) -> str:
    s = bench.settings
    cfg = s.run_config
    order = [v.name for v in VARIANTS]
    return f"""## Every method side by side on the miniature world

Command: `{command}` (one `flwr run` per method and seed on Flower's simulation engine, three
SuperNodes; `OMP_NUM_THREADS={bench.threads}`). Clients: {", ".join(s.domains)} (one each,
{cfg["shots-per-class"]} images per class, 6 classes, chance 16.7%); test sets
{cfg["test-per-class"]} images per class per domain, held by the server. Every global classifier
is ResNet-18 ({cfg["classifier-init"]} init) trained for exactly {s.classifier_steps} SGD steps
(batch 64); Local's per-client classifiers and FedLMG's guiding classifiers get as many; FedAvg
runs as many rounds of {s.fedavg_local_epochs} local epochs as make {s.classifier_steps} steps
summed over clients. Sampling: {cfg["num-inference-steps"]} steps, guidance
{cfg["guidance-scale"]} for every method that samples (OSCAR's s = guidance - 1); concepts:
{cfg["fedbip.concept-epochs"]} epochs. Fresh-noise methods make as many images per client as FedBiP-S.
Accuracy is mean ± sample std over seeds; domain fidelity: the share of each domain's synthetic
images the judges below place in that domain (100 for Central's real images; –: no synthetic
set); seconds are means (client: one client's whole upload
step; server: model load, synthesis, classifier), with the machine's mean load average while
each ran (2 cores: above 2, the seconds are inflated by other work). Made with: the machine
kind of the row's seeds (`unrecorded`: cached before results carried it), the digest of the
LDM they ran (`provenance.model_digest`; seeds of two models are never averaged), how many
commits they span and their dates; a row of mixed kinds says so (`{provenance.MIX_FLAG}`).

{accuracy_heading(sampled)}
{accuracy_table(summary, order)}
- References: Central uploads the images themselves (not private); Local scores each client's
  own classifier on every domain; FedAvg uploads its weights every round.
- Ablations of FedBiP: concept-only (learned S, V; fresh noise), instance-only (z(T); concepts
  left at their words, no learning). FedBiP-S / M / L upload two / five / ten independent
  z(T) per private image (each its own partner, gamma and noise) and denoise each once;
  "FedBiP-S, 2 passes of one z(T)" makes as many images from half the upload, as the paper's
  multiplier does.

### Paired differences in mean accuracy (points)

Every comparison the README and this file draw: row A minus row B seed by seed, over the seeds
that have both rows made on one machine kind, with the mean and its 95% t-interval (n - 1
degrees of freedom). Where the interval spans 0, the two are {NOT_DISTINGUISHABLE}. The
ablation lines take the paper's order ({", ".join(ABLATION)}), each row against the next.

{differences_table(found)}
### What the synthetic images show: class / domain fidelity (%)

Two ResNet-18 judges trained on real images of all five domains (a split no seed uses) label
every synthetic image: class fidelity is the share judged as the class it was made for, domain
fidelity the share judged as its client's domain. Central's row judges the real images it
trained on. The judges are trained where the benchmark runs, from one seed, to other weights on
other machines (float32 differs between kinds, and between CPUs of one kind), so each row
names the judges that judged its seeds by their accuracy on held-out real images, class /
domain (–: judged before rows recorded it). The latest judges of each kind: {judges_text(judged)}.

{fidelity_table(summary)}
### Privacy: membership inference and nearness to the clients' images

Gaps are non-member minus member mean loss / entropy of the global classifier
({s.mia_per_domain} class-balanced images per client each), mean ± std over seeds; 0 = members
look like unseen images. MIA AUC, pooled: a loss-threshold attack on every client's members
against as many unseen test images of their domains, all in one set ({s.mia_per_domain} per
client per side), mean ± std over seeds (0.5 = nothing told apart; standard error about 0.024
at 288 per side), and its true-positive rate at 1% false positives. Nearest real: mean RMS
pixel distance (images in [-1, 1]) from each synthetic image to its client's closest real
image. DCR: each member's and non-member's distance to the nearest synthetic image of its
client, as a membership AUC and the share of members nearer than every non-member; in brackets
the AUC's difference from {NO_DATA_CONTROL}'s on the same seeds, which sees no client image (the
member and non-member images alone move an AUC off 0.5 by a few hundredths).
Rows recorded before 97630ea took a DCR distance as cdist's own (|a|^2 + |b|^2 - 2ab), not
the difference to the neighbour it finds: on both EPYC kinds that is off by at most 0.08% at
close pairs (600 random 3x64x64 images, 96 queries at noise 0.01; far pairs 3e-7), so such an
AUC can move only by the share of member / non-member pairs that close; none was remade.
Reconstruction: where the server's synthetic image i is denoised from private image i's z(T)
(FedBiP), its PSNR and SSIM against image i and against an image of the same class no client
holds (what knowing the class alone gives); then the same for the mean of all the server's
images of image i (every z(T) of it, every pass), which averages out what differs between them
(partner, gamma, noise, concept shift) and keeps what they share. A dash: not measured on every
seed of that row (rows cached before the column existed), or no such thing to measure.

{privacy_table(summary)}
### The server's membership test on each upload it received

What the party that receives the uploads can tell, before it synthesizes anything: each
client's accepted upload, read back from the run folder through the method's own acceptance,
tested by the server with the strongest test this project has for that kind of upload
(`fedbip_tools.upload_attacks`; z(T) rows: the whitened likelihood ratio, rows in the order
uploaded; mixtures: the matched filter on each class's mean; a mean per class of features or
caption states: the class-mean test; a classifier: its loss; images: the nearest uploaded
image). Members: the client's {cfg["shots-per-class"] * 6} private images; non-members: as many
unseen images of its domain and classes; reference: {REFERENCE_PER_CLASS} public images per
class of the domain. AUC (0.5: nothing told apart; standard error about 0.04 at 96 a side),
mean ± sample std over the seeds measured (no spread from one), and TPR at 1% FPR.
4x16x16: the run's own upload (T = the sampler's first step) where the row's run folders are
still here (`--remeasure`: "run folders", which seeds of how many); where records hold more
seeds, or there are no run folders ("records"), the row's
upload kind made by the client code from the same world by `scripts/server_attacks.py` (z(T)
rows or a class mixture of them at this T and as many z(T) per image as the row uploads; a DP
row: its method's class statistics under its epsilon; 288 members a side), which depends on
the encoder, the schedule, T and K, not on what the run learned; a client's classifier (Local,
FedLMG): the client step trained by the row's recipe, its start and local epochs, on the same
world's client images, one client (96 members) a domain and seed; FedAvg's replies (kept by no
run folder): the row's rounds replayed by its client step and Flower's average, the last round's
reply's loss, one client a domain and seed. 4x64x64, Stable Diffusion's
latent size: the same from the world rendered at {LARGE_SIZE} px through the miniature's encoder
and noised with SD v1-4's schedule, the last column naming the records' seeds of the clients'
randomness: it stands in for SD's latent size and schedule, not for SD's VAE on photographs.
Records: {", ".join(f"`{r}`" for r in ATTACK_RECORDS)}. A dash: at 4x64x64 not a latent upload
(images, a classifier, FedAvg's replies, features and caption states: no latent size to scale),
or no record. Each row takes its latent upload's test; the learned conditioning beside it,
FedBiP's concepts and Espresso's conditions, is tested apart by the loss-ratio test (the table
after this one), the DP mixture mode's concepts too (DP-SGD under the rest of the upload's
epsilon).

{server_attack_table(summary, sorted(s.domains))}
The loss-ratio test on the conditioning uploaded beside the latents (`scripts/server_attacks.py
--kinds concepts espresso-conditions`, commands in docs/benchmarks/privacy.md): AUC
(± sample std over seeds) / mean TPR at 1% FPR (the seeds). {cfg["shots-per-class"]} shots,
{cfg["fedbip.concept-epochs"]} epochs: the run's budget, 3 clients a domain, 288 members a side;
4 shots, 200 epochs: the test's positive control, overfitted, one client, 24 a side. At 4x64x64
the control fails on the shipped UNet, trained at 4x16x16, so the figures there are on a UNet
continued at {LARGE_SIZE} px (`{CONDITIONING_LARGE_MODEL}`), where the conditions' control
passes on every domain and the concepts' on painting only: it fails on quickdraw and is weak on
sketch (within 1.5 standard errors, about 0.08 at 24 a side, of chance), so the concepts'
default-budget figures there bound little. A dash: not measured. Records: {", ".join(f"`{r}`" for r in CONDITIONING_RECORDS)}.

{conditioning_table(bench, sorted(s.domains))}
Pictures: `benchmarks/pictures/methods-<domain>.png`, one row per method (first seed).

### Published figures (other data: not comparable cell by cell)

The papers' numbers come from Stable Diffusion on DomainNet; FedLMG and OSCAR use 90 classes,
FedBiP 10. What carries over is the ordering, not the values.

{PUBLISHED}"""


def run_folder(bench: Bench, seed: int, name: str) -> RunFolder:
    return RunFolder(bench.seed_folder(seed) / slug(name))


def pictures(bench: Bench, seed: int, names: Sequence[str]) -> list[Path]:
    """Per client domain: its real images, then a row per method that made a training set."""
    out = []
    cfg = FedBiPConfig.from_flat({**base_values(bench, seed), "method": "fedbip"})
    clients = client_sets(cfg)
    for client_id, data in sorted(clients.items()):
        rows, labels = [data.images[:: max(1, len(data.labels) // PICTURE_COLUMNS)]], ["real"]
        for name in names:
            folder = run_folder(bench, seed, name)
            if not folder.training_set.exists():
                continue
            shards = folder.training_shards().get(client_id)
            if not shards:
                continue
            images = ShardImages(shards, 0)
            rows.append(images.read(torch.linspace(0, len(images) - 1, PICTURE_COLUMNS).long()))
            labels.append(name[:11])
        path = bench.results / "pictures" / f"methods-{data.domain}.png"
        out.append(image_grid(rows, path, row_labels=labels, columns=PICTURE_COLUMNS))
    return out


def write_section(path: Path, text: str, marker: str = MARKER) -> None:
    """Replace this benchmark's section of BENCHMARKS.md, leaving the others alone."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    body = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{text}{end}\n"
    if start in body:
        body = body[: body.index(start)] + block + body[body.index(end) + len(end) + 1 :]
    else:
        body = body.rstrip() + "\n\n" + block
    path.write_text(body)


def report(
    bench: Bench, command: str, benchmarks_md: Path, *, mix_machine_kinds: bool = False
) -> dict[str, Any]:
    """Summarize every cached seed into methods.json, the methods page and the pictures; refuses
    (:class:`~fedbip_tools.provenance.MixedMachineKinds`) to average a row over machine kinds
    unless ``mix_machine_kinds``."""
    runs = cached_seeds(bench)
    if not runs:
        raise ValueError(f"no results under {bench.results / 'methods'} for these settings")
    summary = summarize(runs, mix_machine_kinds=mix_machine_kinds)
    found, sampled = differences(runs), sampling(bench)
    run_size = FedBiPConfig.from_flat(base_values(bench, 0)).image_size
    for key, size in ((SERVER_ATTACK_STAND_IN, run_size), (SERVER_ATTACK_LARGE, LARGE_SIZE)):
        for name, attacked in stand_in_attacks(
            bench, sampled.timestep, size, list(summary)
        ).items():
            summary[name][key] = attacked
    judged = json.loads(judges_record(bench).read_text())
    write_json(
        bench.results / "methods.json",
        {
            "settings": asdict(bench.settings),
            "names": NAMES_VERSION,
            "command": command,
            "judges_on_real": judged,
            "torch": torch.__version__,
            "threads": bench.threads,
            "sampling": asdict(sampled),
            "methods": summary,
            "differences": [asdict(d) for d in found],
        },
    )
    write_section(benchmarks_md, markdown(summary, bench, command, judged, found, sampled))
    first = min(runs)
    names = [v.name for v in VARIANTS if v.name in runs[first]]
    pictured = [n for n in names if "num_images" in runs[first][n]]  # rows that made images
    gone = [n for n in pictured if not run_folder(bench, first, n).training_set.exists()]
    if gone:  # drawing now would drop their rows from the pictures
        log.warning(
            "pictures kept as they are: seed %d's run folders of %s are gone",
            first,
            ", ".join(gone),
        )
    else:
        pictures(bench, first, names)
    return summary


def judges_record(bench: Bench) -> Path:
    """The judges' accuracy on held-out real images per machine kind, kept beside the results
    (the judges' weights, 90 MB, stay in the work folder: they are retrained in minutes from a
    fixed seed)."""
    return bench.results / "methods" / "judges.json"


def record_judges(bench: Bench, on_real: Mapping[str, float]) -> None:
    """Keep ``on_real`` as the latest judges of this machine's kind (each row records the judges
    that judged it: :data:`JUDGES`)."""
    path = judges_record(bench)
    kept = json.loads(path.read_text()) if path.exists() else {}
    write_json(path, {**kept, this_machine().kind: dict(on_real)})


def judges_text(judged: Mapping[str, Mapping[str, float]]) -> str:
    """``98.8% (class) and 99.8% (domain) on the AVX512+bf16 kind; ...``."""
    return "; ".join(
        f"{100 * on_real['class']:.1f}% (class) and {100 * on_real['domain']:.1f}% (domain) "
        f"on the {kind} kind"
        for kind, on_real in sorted(judged.items())
    )


def run(
    bench: Bench, seeds: Sequence[int], names: Sequence[str], *, remeasure: bool = False
) -> None:
    judges = load_judges(bench.work / "judges.safetensors")
    record_judges(bench, judges.accuracy_on_real)
    for seed in seeds:
        run_seed(bench, seed, names, judges, remeasure=remeasure)
