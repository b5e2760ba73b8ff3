"""FedPFT: per-class Gaussian mixtures of the shipped backbone's features up, a linear head
trained on draws from them down (fedbip_flwr/methods/fedpft.py), on the tiny model (whose
backbone is random-init)."""

from __future__ import annotations

import json

import pytest
import sklearn.mixture
import torch

from fedbip_flwr.classifier import backbone_path, evaluate, load_backbone
from fedbip_flwr.clusters import public_encoder
from fedbip_flwr.config import ConfigError
from fedbip_flwr.method_settings import FedPFTSettings
from fedbip_flwr.methods import create, fedpft
from fedbip_flwr.upload import PayloadError, read_header
from tests.helpers import client_job, method_config, server_job, tampered


@pytest.fixture(autouse=True)
def one_thread():
    """The head's steps are tiny: OpenMP threads spinning on a shared machine slow them many
    times over (as conftest.share_cores_between_workers says)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(tiny_model_dir, **values):
    return method_config(
        "fedpft",
        **{"ldm.model": str(tiny_model_dir), **{f"fedpft.{k}": v for k, v in values.items()}},
    )


def upload_of(cfg, partition=0):
    method = create("fedpft", cfg.settings_of("fedpft"))
    blob, metrics = method.upload(client_job(cfg, None, partition))
    return method, blob, metrics


def accept(cfg, blob):
    return create("fedpft", cfg.settings_of("fedpft")).accept(blob, server_job(cfg, None))


def test_the_defaults_are_the_flower_baselines_and_reach_gaussian_mixture(
    tiny_model_dir, monkeypatch
):
    own = FedPFTSettings()
    assert (own.components, own.covariance_type, own.tol, own.max_iter) == (
        1,
        "spherical",
        1e-12,
        1000,
    )
    made = []
    real = sklearn.mixture.GaussianMixture  # looked up when the mixtures are fitted

    def recording(**kwargs):
        made.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(sklearn.mixture, "GaussianMixture", recording)
    upload_of(config(tiny_model_dir))
    assert len(made) == 6, "one mixture per held class"
    assert {(k["n_components"], k["covariance_type"], k["tol"], k["max_iter"]) for k in made} == {
        (1, "spherical", 1e-12, 1000)
    }
    assert len({k["random_state"] for k in made}) == 6, (
        "each class seeded from the client's generator"
    )


def test_the_upload_is_the_classes_feature_mixtures_of_the_frozen_backbone(tiny_model_dir):
    cfg = config(tiny_model_dir)
    _, blob, _ = upload_of(cfg)
    upload = accept(cfg, blob)
    header = {
        k: (v["dtype"], v["shape"]) for k, v in read_header(blob)[0].items() if k != "__metadata__"
    }
    assert header == {
        "class_counts": ("I64", [6]),
        "gmm_weights": ("F32", [6, 1]),
        "gmm_means": ("F32", [6, 1, 512]),
        "gmm_covariances": ("F32", [6, 1]),
    }
    assert len(blob) < 4 * 6 * 514 + 8 * 6 + 2000, "C x K x (D + 2) floats, the counts and a header"
    # K = 1: the fit is each class's mean and spread of the backbone's features, unaugmented
    data = client_job(cfg, None).data
    features = public_encoder(tiny_model_dir, cfg.classifier.image_size)(data.images).double()
    assert (
        upload.tensors["class_counts"].tolist() == torch.bincount(data.labels, minlength=6).tolist()
    )
    for c in range(6):
        rows = features[data.labels == c]
        assert torch.allclose(upload.tensors["gmm_means"][c, 0].double(), rows.mean(0), atol=1e-5)
        spread = rows.var(0, unbiased=False).mean() + fedpft.REG_COVAR
        assert float(upload.tensors["gmm_covariances"][c, 0]) == pytest.approx(
            float(spread), rel=1e-4
        )
    assert upload.meta.encoder == fedpft.encoder_identity(tiny_model_dir)[0]
    assert (upload.meta.image_size, upload.meta.feature_dim) == (32, 512)


def test_diag_covariances_and_a_class_with_fewer_images_than_components(tiny_model_dir):
    cfg = config(tiny_model_dir, **{"covariance-type": "diag", "components": 3})
    _, blob, metrics = upload_of(cfg)
    upload = accept(cfg, blob)
    weights = upload.tensors["gmm_weights"]
    assert tuple(upload.tensors["gmm_covariances"].shape) == (6, 3, 512)
    # every class holds 2 images (data.shots-per-class): 2 fitted components and one of weight 0
    assert bool((weights[:, :2] > 0).all()) and bool((weights[:, 2] == 0).all())
    assert metrics["mixture-smallest-weight"] > 0
    assert torch.equal(upload.tensors["gmm_means"][:, 2], upload.tensors["gmm_means"][:, 0]), (
        "padding copies"
    )


def test_full_covariances_are_refused_when_the_config_is_read():
    with pytest.raises(
        ConfigError, match="'fedpft.covariance-type': 'full' covariances are not supported"
    ):
        method_config("fedpft", **{"fedpft.covariance-type": "full"})
    with pytest.raises(ConfigError, match="set components = 1, not 2"):
        method_config("fedpft", **{"fedpft.dp-epsilon": 4.0, "fedpft.components": 2})


def test_the_server_head_classifies_the_clients_own_images(tiny_model_dir):
    """Behaviour end to end: two clients' uploads -> draws -> the head on the frozen backbone ->
    its accuracy on those clients' own images, far above chance (1/6)."""
    cfg = config(tiny_model_dir)  # the shipped head recipe
    server = server_job(cfg, None)
    uploads = {}
    for partition in (0, 1):
        upload = accept(cfg, upload_of(cfg, partition)[1])
        uploads[upload.client_id] = upload
    models = create("fedpft", cfg.settings_of("fedpft")).final_models(uploads, server)
    assert list(models) == ["global"]
    model, shipped = models["global"], load_backbone(backbone_path(tiny_model_dir)).state_dict()
    assert all(
        torch.equal(t, shipped[n]) for n, t in model.state_dict().items() if not n.startswith("fc.")
    ), "frozen"
    assert tuple(model.fc.weight.shape) == (6, 512)
    jobs = [client_job(cfg, None, p).data for p in (0, 1)]
    images, labels = torch.cat([d.images for d in jobs]), torch.cat([d.labels for d in jobs])
    assert evaluate(model, images, labels, cfg.classifier.image_size).accuracy >= 0.6


def test_draws_follow_the_clipped_counts(tiny_model_dir):
    cfg = config(tiny_model_dir, **{"draws-per-image": 3})
    _, blob, _ = upload_of(cfg)

    def more_circles(
        tensors, meta
    ):  # 5 of class 0 (above federation.max-images-per-class 2), as many fewer elsewhere
        tensors["class_counts"] = torch.tensor([5, 2, 2, 0, 0, 3])

    upload = accept(cfg, tampered(blob, "fedpft", cfg, more_circles))
    features, labels = fedpft.drawn_features({upload.client_id: upload}, server_job(cfg, None), 3)
    assert torch.bincount(labels, minlength=6).tolist() == [6, 6, 6, 0, 0, 6]
    assert features.shape == (24, 512)
    means = upload.tensors["gmm_means"][:, 0]
    for c in (0, 1, 2, 5):  # each class's draws lie around its own mean, not another's
        drawn = features[labels == c].mean(0)
        assert int((means - drawn).norm(dim=1).argmin()) == c


def _set(name, index, value):
    def change(tensors, _meta):
        tensors[name] = tensors[name].clone()
        tensors[name][index] = value

    return change


def _reshape(name, rows):
    def change(tensors, _meta):
        tensors[name] = torch.cat([tensors[name], tensors[name][:rows]])

    return change


def _meta(key, value):
    return lambda _t, meta: meta.update({f"fedbip.{key}": json.dumps(value)})


def _as_diag(tensors, meta):
    """A diag upload, consistent in itself, where the server asks for spherical ones."""
    _meta("covariance_type", "diag")(tensors, meta)
    spherical = tensors["gmm_covariances"]
    tensors["gmm_covariances"] = torch.full((*spherical.shape, 512), fedpft.REG_COVAR)


HOSTILE = {
    "negative variance": (_set("gmm_covariances", (0, 0), -1.0), "below the fit's floor"),
    "zero variance": (_set("gmm_covariances", (1, 0), 0.0), "below the fit's floor"),
    "weights not summing to 1": (_set("gmm_weights", (2, 0), 0.5), "sum to 1 \\+- 0.5"),
    "negative weight": (_set("gmm_weights", (2, 0), -1.0), "negative weight"),
    "a class row too many": (_reshape("gmm_means", 1), "gmm_means has shape \\[7, 1, 512\\]"),
    "a class weight row too many": (_reshape("gmm_weights", 1), "gmm_weights has shape \\[7, 1\\]"),
    "NaN mean": (_set("gmm_means", (0, 0, 3), float("nan")), "NaN or Inf"),
    "infinite variance": (_set("gmm_covariances", (0, 0), float("inf")), "NaN or Inf"),
    "negative mean": (_set("gmm_means", (3, 0, 7), -0.5), "never negative"),
    "mean beyond any feature": (_set("gmm_means", (3, 0, 7), 5e3), "above any feature's"),
    "variance beyond the range's spread": (
        _set("gmm_covariances", (4, 0), 1e6),
        "class 4, component 0 has a variance above",
    ),
    "another encoder": (
        _meta("encoder", "0123456789abcdef"),
        "encoder '0123456789abcdef' does not match",
    ),
    "another covariance type": (_as_diag, "covariance type 'diag' does not match"),
    "another image size": (_meta("image_size", 64), "image size 64 does not match"),
    "negative count": (_set("class_counts", 0, -2), "must be non-negative"),
}


@pytest.mark.parametrize("lie", sorted(HOSTILE))
def test_hostile_uploads_are_refused_with_a_reason(lie, tiny_model_dir):
    cfg = config(tiny_model_dir)
    _, blob, _ = upload_of(cfg)
    accept(cfg, blob)  # the honest one passes
    change, reason = HOSTILE[lie]
    with pytest.raises(PayloadError, match=reason):
        accept(cfg, tampered(blob, "fedpft", cfg, change))


def test_the_dp_upload_states_its_guarantee_and_the_server_checks_it(tiny_model_dir):
    cfg = config(tiny_model_dir, **{"dp-epsilon": 8.0})
    _, blob, metrics = upload_of(cfg)
    upload = accept(cfg, blob)
    release = upload.meta.dp
    assert metrics == {"dp-epsilon": 8.0} and release.epsilon == 8.0 and release.releases == 3
    assert sorted(release.covers) == ["class_counts", "gmm_covariances", "gmm_means", "gmm_weights"]
    plain_blob = upload_of(config(tiny_model_dir))[1]
    plain = accept(config(tiny_model_dir), plain_blob)
    assert not torch.allclose(upload.tensors["gmm_means"], plain.tensors["gmm_means"], atol=1e-2), (
        "noised"
    )
    with pytest.raises(PayloadError, match="states no guarantee"):
        accept(cfg, plain_blob)
    assert (
        accept(config(tiny_model_dir), blob).meta.dp is not None
    )  # a run without DP takes a DP upload

    def understated(_tensors, meta):
        dp = json.loads(meta["fedbip.dp"])
        meta["fedbip.dp"] = json.dumps({**dp, "epsilon": 1.0})

    with pytest.raises(PayloadError, match="claims epsilon 1, but its noise multiplier"):
        accept(config(tiny_model_dir), tampered(blob, "fedpft", cfg, understated))
    stricter = config(tiny_model_dir, **{"dp-epsilon": 4.0})
    with pytest.raises(PayloadError, match="weaker than the run's"):
        accept(stricter, blob)
