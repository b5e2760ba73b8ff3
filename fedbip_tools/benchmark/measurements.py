"""What one finished run shows, read from its run folder (:func:`measure`): accuracy per domain,
upload bytes, seconds, the fidelity judges' labels of its training set (:mod:`fedbip_tools.judges`),
and the privacy tests on its clients' images: membership inference on the classifier, DCR and
DOMIAS on the synthetic images, the server's test on the uploads, and the server's
reconstructions of the private images."""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F

from fedbip_flwr import dataset, methods, shapes
from fedbip_flwr.classifier import ShardImages, backbone_path, evaluate, load_classifier_bytes
from fedbip_flwr.config import DataDescription, FedBiPConfig
from fedbip_flwr.instance import upload_order
from fedbip_flwr.ldm import load_for_run
from fedbip_flwr.method_settings import FedBiPSettings
from fedbip_flwr.methods.base import ServerJob
from fedbip_flwr.results import SENT_SECONDS
from fedbip_flwr.results import read as read_results
from fedbip_flwr.seeds import client_seed
from fedbip_flwr.server import RunFolder

from ..judges import Judges
from ..privacy import (
    Features,
    averaged_reconstructions,
    backbone_features,
    dcr_membership,
    density_ratio_membership,
    loss_membership_inference,
    reconstruction_score,
)
from ..upload_attacks import REFERENCE_PER_CLASS, Candidates, ServerView, attack_upload, upload_test
from .settings import Settings

# DOMIAS's reference: the base model's public images of a client's domain (its pretraining split)
DOMIAS_REFERENCE_PER_CLASS = 50


SERVER_ATTACK = "server_attack"  # a row's key for the server's test on its uploads
JUDGES = "judges_on_real"  # a row's key: the real-image accuracy of the judges that judged it
NON_MEMBER_CLIENT = 1  # the shapes world's second client of a domain: images no client here holds


def measure(folder: RunFolder, judges: Judges, settings: Settings) -> dict[str, Any]:
    """What one finished run shows: accuracy, bytes, seconds, fidelity, privacy."""
    record = read_results(folder.metrics)
    cfg = FedBiPConfig.from_recorded(record.config)
    result: dict[str, Any] = {
        "per_domain": record.accuracy.per_domain,
        "mean": record.accuracy.mean,
        # the round is the clients' time, counted as theirs
        "server_seconds": record.seconds.model_dump(exclude_none=True, exclude={"round"}),
        "sgd_steps": cfg.classifier.steps,
    }
    if record.clients is not None:
        outcomes = [c for c in record.clients if c.status in ("accepted", "kept")]
        result["upload_bytes"] = {c.client_id: c.payload_bytes for c in outcomes}
        result["client_seconds"] = {
            c.client_id: (c.metrics or {}).get(SENT_SECONDS) for c in outcomes
        }
    else:  # FedAvg: what it federates (the whole model, or the head) goes up from every client each round
        model = load_classifier(folder, cfg.data_description)
        sent = methods.create_for(cfg).federated(model).state_dict()
        weights = sum(t.numel() * t.element_size() for t in sent.values())
        result["upload_bytes"] = {"every client": weights * cfg.settings_of("fedavg").rounds}
        result["fedavg_rounds"] = cfg.settings_of("fedavg").rounds
    clients = client_sets(cfg.data_description)
    if folder.training_set.exists():
        shards = folder.training_shards()
        result["num_images"] = sum(len(ShardImages(paths, 0)) for paths in shards.values())
        result["fidelity"], result["nearest_real"], result["dcr"] = {}, {}, {}
        result[JUDGES] = judges.accuracy_on_real  # judges differ between machines: which judged
        # a base model without a shipped backbone (the tests' tiny one) is measured in pixels only
        base = cfg.ldm.model
        features = backbone_features(base) if backbone_path(base).is_file() else None
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
                    ShardImages(paths, cfg.data.image_size), clients[c], cfg
                )
                for c, paths in sorted(shards.items())
            }
    if upload_test(cfg.method) and folder.persisted_payloads():
        result[SERVER_ATTACK] = server_attacks(folder, cfg, clients)
    if folder.classifier.exists():
        model = load_classifier(folder, cfg.data_description)
        result["mia_gap"], result["mia"] = membership_inference(
            model, cfg, clients, settings.mia_per_domain
        )
    return result


def load_classifier(folder: RunFolder, data: DataDescription) -> torch.nn.Module:
    return load_classifier_bytes(folder.classifier.read_bytes(), dataset.class_names(data))


def client_sets(data: DataDescription) -> dict[str, dataset.ClientSet]:
    """The benchmark's clients, one per domain, exactly as the simulation's nodes load them."""
    sets = [dataset.load_client_data(data, p) for p in range(len(data.domains))]
    return {s.client_id: s for s in sets}


def unseen_images(domain: str, data: DataDescription, size: int) -> shapes.ImageSet:
    """As many images of ``domain`` as a client holds, of the same classes in the same order,
    that no client of the run holds: every membership test's non-members."""
    return shapes.client_train_set(domain, data.shots_per_class, NON_MEMBER_CLIENT, data.seed, size)


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
    non_members = unseen_images(members.domain, cfg.data_description, size)
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
        lambda: load_for_run(cfg.ldm.model, "cpu", cfg.ldm.half_precision, cfg.data.image_size)
    )
    server = ServerJob(cfg, dataset.class_names(cfg.data_description), ldm)
    method = methods.one_shot_for(cfg)
    out = {}
    for client_id, path in folder.persisted_payloads().items():
        members = clients[client_id]
        size = members.images.shape[-1]
        public = shapes.pretrain_set(members.domain, REFERENCE_PER_CLASS, cfg.seed, size)
        others = unseen_images(members.domain, cfg.data_description, size)
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
    tests = dataset.load_test_sets(cfg.data_description, cfg.data.domain_list)
    gaps: dict[str, list[float]] = {"loss": [], "entropy": []}
    member_losses, other_losses = [], []
    for data in clients.values():
        test = tests[data.domain]
        inside, outside = balanced(data.labels, n), balanced(test.labels, n)
        member = evaluate(
            model, data.images[inside], data.labels[inside], cfg.classifier.image_size
        )
        other = evaluate(
            model, test.images[outside], test.labels[outside], cfg.classifier.image_size
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
    replayed from the client's generator, which the benchmark's
    ``federation.replayable-client-noise`` lets it do (an oracle: a server without that flag
    cannot)."""
    if not cfg.federation.replayable_client_noise:
        raise ValueError(
            "the server's reconstructions are matched to their images by replaying the "
            "client's upload order: the run needs federation.replayable-client-noise"
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
    unrelated = unseen_images(client.domain, cfg.data_description, size)
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
