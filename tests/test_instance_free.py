"""Instance-free uploads (FedLD, FedBiP's mixture mode, Espresso): no per-image latent leaves the
client, the server draws z(T) from each class's mixture, and a mixture that z(T) at T could
not come from is refused. Generic upload refusals and the real `flwr run` for both methods are
in test_methods.py (all are in ONE_SHOT)."""

from __future__ import annotations

import json

import pytest
import torch

from fedbip_flwr.methods import audit_upload, create_for
from fedbip_flwr.mixture import MIXTURE_MEANS, MIXTURE_TENSOR_NAMES, MIXTURE_VARIANCES
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import read_tensors
from fedbip_flwr.upload import PayloadError
from tests.helpers import client_job, method_config, own, server_job, tampered

METHODS = ("fedld", "fedbip-mixture", "espresso")


def upload_of(method: str, ldm, **values):
    cfg = method_config(method, **values)
    blob, metrics = create_for(cfg).upload(client_job(cfg, ldm))
    return cfg, blob, metrics


@pytest.mark.parametrize("method", METHODS)
def test_no_per_image_tensor_leaves_and_the_server_synthesizes_from_the_mixture(
    method, tiny_ldm, tmp_path
):
    mixing = method == "fedbip-mixture"  # 2 z(T) per image; FedLD, Espresso: noisings = 2
    values = {"fedbip.latents-per-image": 2} if mixing else {}  # the mixture runs fedbip's step
    cfg, blob, metrics = upload_of(method, tiny_ldm, **values)
    audited = audit_upload(blob, 2**30)
    n = audited.meta.num_examples
    assert set(MIXTURE_TENSOR_NAMES) <= set(audited.tensors)
    assert all(n not in t.shape for name, t in audited.tensors.items() if name != "class_counts"), (
        "a tensor with a row per private image"
    )
    upload = create_for(cfg).accept(blob, server_job(cfg, tiny_ldm))
    assert metrics["mixture-rows"] == 2 * n
    folder = RunFolder(tmp_path)
    shards = create_for(cfg).train_set(
        {upload.client_id: upload}, server_job(cfg, tiny_ldm), folder.shard_path
    )
    labels = torch.cat([read_tensors(p)["labels"] for p in shards[upload.client_id]])
    counts = upload.tensors["class_counts"]
    # the mixture mode: as many images per class as FedBiP makes from this client (count x z(T)
    # per image x passes); the others: their images-per-image x count
    settings = own(cfg)
    per_image = (
        settings.latents_per_image * settings.multiplier if mixing else settings.images_per_image
    )
    assert torch.bincount(labels, minlength=len(counts)).tolist() == (counts * per_image).tolist()
    again = create_for(cfg).train_set(
        {upload.client_id: upload}, server_job(cfg, tiny_ldm), folder.shard_path
    )
    assert again == shards, "a restarted server reuses the keyed shards"


def test_draws_come_from_the_mixture_not_from_fresh_noise(tiny_ldm, tmp_path):
    """Two uploads that differ only in one class's mixture means make different images of that
    class and the same images of every other class."""
    cfg, blob, _ = upload_of("fedld", tiny_ldm)

    def shifted(tensors, _meta):
        tensors[MIXTURE_MEANS] = tensors[MIXTURE_MEANS].clone()
        tensors[MIXTURE_MEANS][0] += 0.05

    images = {}
    for name, data in (("honest", blob), ("shifted", tampered(blob, "fedld", cfg, shifted))):
        upload = create_for(cfg).accept(data, server_job(cfg, tiny_ldm))
        (path,) = create_for(cfg).train_set(
            {upload.client_id: upload},
            server_job(cfg, tiny_ldm),
            RunFolder(tmp_path / name).shard_path,
        )[upload.client_id]
        images[name] = read_tensors(path)
    labels = images["honest"]["labels"]
    same = (images["honest"]["images"] == images["shifted"]["images"]).flatten(1).all(1)
    assert not same[labels == 0].any() and same[labels != 0].all()


SCALED = {
    "means shifted far off": lambda t, m: t.update({MIXTURE_MEANS: t[MIXTURE_MEANS] + 50.0}),
    "variances blown up": lambda t, m: t.update({MIXTURE_VARIANCES: t[MIXTURE_VARIANCES] * 400.0}),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("lie", sorted(SCALED))
def test_a_mixture_z_t_at_t_cannot_come_from_is_refused(method, lie, tiny_ldm):
    cfg, blob, _ = upload_of(method, tiny_ldm)
    with pytest.raises(PayloadError, match="no EM fit to z\\(T\\) rows noised to T gives it"):
        create_for(cfg).accept(tampered(blob, method, cfg, SCALED[lie]), server_job(cfg, tiny_ldm))


def test_the_server_refuses_another_component_count_and_outsized_concepts(tiny_ldm):
    cfg, blob, _ = upload_of("fedbip-mixture", tiny_ldm)
    other = method_config("fedbip-mixture", **{"fedbip-mixture.components": 2})
    with pytest.raises(PayloadError, match="components 4 does not match the server's 2"):
        create_for(other).accept(blob, server_job(other, tiny_ldm))

    def scaled(tensors, _meta):
        tensors["class_concepts"] = tensors["class_concepts"] * 1000

    with pytest.raises(PayloadError, match="class_concepts|V_"):
        create_for(cfg).accept(
            tampered(blob, "fedbip-mixture", cfg, scaled), server_job(cfg, tiny_ldm)
        )


def test_a_dp_upload_says_what_it_guarantees_and_releases_noisy_class_means(tiny_ldm):
    from fedbip_flwr.dp import noise_multiplier_for

    cfg, blob, _ = upload_of("fedld", tiny_ldm, **{"fedld.dp-epsilon": 4.0})
    upload = create_for(cfg).accept(blob, server_job(cfg, tiny_ldm))
    release = audit_upload(blob, 2**30).meta.dp
    assert (release.epsilon, release.delta, release.releases) == (4.0, 1e-5, 2)
    assert release.noise_multiplier == pytest.approx(noise_multiplier_for(4.0, 1e-5, 2))
    assert (
        set(release.covers) == {"class_counts", *MIXTURE_TENSOR_NAMES} and release.replayable_noise
    )
    mixture = upload.content
    assert torch.equal(mixture.variances, torch.ones_like(mixture.variances))
    assert mixture.weights[:, 0].eq(1).all() and mixture.weights[:, 1:].eq(0).all()


def test_the_private_class_means_are_the_clipped_means_plus_noise_of_the_calibrated_scale():
    """Many rows per class, so the noise on a mean (sigma C / n) is small against the
    tolerance; alpha_bar large, so no mean is shrunk; two classes only, the third absent."""
    from fedbip_flwr.dp import noise_multiplier_for
    from fedbip_flwr.method_settings import FedLDSettings
    from fedbip_flwr.methods.fedld import STATS_RELEASES, private_mixture, stats_guarantee

    generator = torch.Generator().manual_seed(0)
    n, dim = 4000, 16
    z_t = torch.randn(2 * n, 1, 4, 4, generator=generator) * 0.5 + torch.arange(2 * n).ge(n).view(
        -1, 1, 1, 1
    )
    labels = torch.arange(2 * n).ge(n).long()
    own = FedLDSettings(dp_epsilon=4.0, dp_clip=1.25)
    sigma = noise_multiplier_for(own.dp_epsilon, own.dp_delta, STATS_RELEASES)
    guarantee = stats_guarantee(own, own.dp_epsilon, own.dp_delta, sigma, dim)
    mixture, counts, release = private_mixture(
        z_t, labels, 3, guarantee, own.components, 0.5, generator, replayable=False
    )
    clip = 1.25 * dim**0.5
    assert release.clip == clip and not release.replayable_noise
    scale = release.noise_multiplier * clip / n  # the std of the noise on one coordinate of a mean
    for c in range(2):
        rows = z_t[labels == c].flatten(1)
        clipped = rows * (clip / rows.norm(dim=1, keepdim=True)).clamp(max=1.0)
        deviation = mixture.means[c, 0].flatten() - clipped.mean(0)
        assert deviation.abs().max() < 6 * scale + 6 * release.noise_multiplier / n
        # and the noise is there: 16 coordinates' RMS is within [0.5, 2] of its std (a release
        # without noise, or with far less, fails here)
        assert 0.5 * scale < deviation.square().mean().sqrt() < 2 * scale
        assert abs(int(counts[c]) - n) <= 6 * release.noise_multiplier + 1
    assert int(counts[2]) <= 6 * release.noise_multiplier + 1, "an absent class: its count is noise"


def test_fedbip_inspect_and_report_show_the_guarantee(tiny_ldm, tmp_path, capsys):
    from fedbip_flwr.report import _what_left
    from fedbip_tools.cli import main

    _, blob, _ = upload_of("fedld", tiny_ldm, **{"fedld.dp-epsilon": 4.0})
    path = RunFolder(tmp_path).payloads / "sketch-0.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(blob)
    assert main(["inspect", str(path)]) == 0
    assert '"epsilon": 4.0' in capsys.readouterr().out
    (row,) = [line for line in _what_left(tmp_path) if line.startswith("| sketch-0")]
    assert "(4, 1e-05)-DP per one private image" in row and "`mixture_means` [6, 4, 1024]" in row


# --- FedBiP's mixture mode under one DP budget --------------------------------------------------


@pytest.fixture(scope="module")
def private_mixture(tiny_model_dir):
    """One (4, 1e-5)-DP fedbip-mixture upload on the tiny model (13 DP-SGD steps), its run
    config and the model, made once for the module."""
    from fedbip_flwr.ldm import load_ldm

    ldm = load_ldm(tiny_model_dir)
    cfg, blob, metrics = upload_of("fedbip-mixture", ldm, **{"fedbip-mixture.dp-epsilon": 4.0})
    return cfg, blob, metrics, ldm


def test_a_private_fedbip_mixture_upload_states_one_guarantee_for_all_it_holds(private_mixture):
    from fedbip_flwr.concepts import initial_concepts, prompt_layout
    from fedbip_flwr.dp import composed_epsilon, dp_sgd_event, gaussian_releases
    from fedbip_flwr.methods.fedbip_mixture import FedBiPMixture

    cfg, blob, metrics, ldm = private_mixture
    release = audit_upload(blob, 2**30).meta.dp
    assert release.covers == list(FedBiPMixture.tensor_names)
    sgd = release.concepts
    assert (sgd.sample_rate, sgd.steps, sgd.clip, sgd.covers) == (
        0.08,
        13,
        1e-3,
        ["domain_concept", "class_concepts"],
    )
    assert release.releases == 2 and release.delta == 1e-5
    # the accountant's epsilon for every release made, composed: all of the budget, never more
    assert 4.0 * (1 - 1e-3) < release.epsilon <= 4.0
    assert release.epsilon == composed_epsilon(
        1e-5,
        dp_sgd_event(0.08, sgd.noise_multiplier, 13),
        gaussian_releases(release.noise_multiplier, 2),
    )
    assert metrics == {"dp-epsilon": release.epsilon}, (
        "no loss curve or timing of the private images"
    )
    upload = create_for(cfg).accept(blob, server_job(cfg, ldm))
    mixture, concepts = upload.content.mixture, upload.content.concepts
    assert torch.equal(mixture.variances, torch.ones_like(mixture.variances))
    assert mixture.weights[:, 0].eq(1).all() and mixture.weights[:, 1:].eq(0).all()
    meta = upload.meta
    layout = prompt_layout(
        ldm.tokenizer,
        meta.prompt_template,
        meta.n_s,
        meta.n_v,
        upload.domain,
        meta.class_names,
        warn=False,
    )
    s0, v0 = initial_concepts(ldm, layout, own(cfg).concept_space)
    assert not torch.equal(concepts.domain, s0) and not torch.equal(concepts.classes, v0)


def test_a_non_private_fedbip_mixture_header_is_as_before_and_a_dp_run_refuses_it(
    tiny_ldm, private_mixture
):
    from fedbip_flwr.upload import read_header

    cfg, blob, _ = upload_of("fedbip-mixture", tiny_ldm)
    assert "fedbip.dp" not in read_header(blob)[1], "a non-DP header gains no key"
    private_cfg = private_mixture[0]
    with pytest.raises(
        PayloadError, match=r"the run asks for \(4, 1e-05\)-DP uploads .* states no guarantee"
    ):
        create_for(private_cfg).accept(blob, server_job(private_cfg, tiny_ldm))


def _dp(change):
    """A lie about the header's guarantee: ``change`` edits its JSON object."""

    def edit(_tensors, meta):
        dp = json.loads(meta["fedbip.dp"])
        change(dp)
        meta["fedbip.dp"] = json.dumps(dp)

    return edit


GUARANTEE_LIES = {
    "epsilon understated": (_dp(lambda d: d.update(epsilon=d["epsilon"] / 2)), "claims epsilon 2"),
    "epsilon above the run's": (
        _dp(lambda d: d.update(epsilon=d["epsilon"] * 1.5)),
        "weaker than the run's",
    ),
    "statistics' noise overstated": (
        _dp(lambda d: d.update(noise_multiplier=d["noise_multiplier"] * 2)),
        "claims epsilon .* give",
    ),
    "DP-SGD's noise overstated": (
        _dp(lambda d: d["concepts"].update(noise_multiplier=d["concepts"]["noise_multiplier"] * 2)),
        "claims epsilon",
    ),
    "fewer steps": (
        _dp(lambda d: d["concepts"].update(steps=1)),
        "DP-SGD steps 1 does not match the server's 13",
    ),
    "another sample rate": (
        _dp(lambda d: d["concepts"].update(sample_rate=0.04)),
        "DP-SGD sample rate 0.04",
    ),
    "a tensor left uncovered": (
        _dp(lambda d: d["covers"].remove("class_concepts")),
        r"does not cover \['class_concepts'\]",
    ),
    "DP-SGD's parameters missing": (
        _dp(lambda d: d.pop("concepts")),
        "fedbip.dp.concepts' is invalid: Field required",
    ),
    "epsilon missing": (
        _dp(lambda d: d.pop("epsilon")),
        "fedbip.dp.epsilon' is invalid: Field required",
    ),
    "a noise multiplier too small to account": (
        _dp(lambda d: d["concepts"].update(noise_multiplier=0.01)),
        "greater than or equal to 0.05",
    ),
}


@pytest.mark.parametrize("lie", sorted(GUARANTEE_LIES))
def test_a_tampered_guarantee_is_refused(lie, private_mixture):
    cfg, blob, _, ldm = private_mixture
    change, message = GUARANTEE_LIES[lie]
    with pytest.raises(PayloadError, match=message):
        create_for(cfg).accept(tampered(blob, "fedbip-mixture", cfg, change), server_job(cfg, ldm))


def test_a_server_without_a_dp_budget_still_refuses_an_overstated_epsilon(private_mixture):
    """A claim larger than the parameters give is refused too: the header says what they give."""
    _, blob, _, ldm = private_mixture
    plain = method_config("fedbip-mixture")
    create_for(plain).accept(blob, server_job(plain, ldm))  # the honest one is taken
    lie = tampered(
        blob, "fedbip-mixture", plain, _dp(lambda d: d.update(epsilon=d["epsilon"] * 1.5))
    )
    with pytest.raises(PayloadError, match="claims epsilon 6, .* give 4 at"):
        create_for(plain).accept(lie, server_job(plain, ldm))


def test_fedbip_inspect_and_report_show_the_mixture_guarantee(private_mixture, tmp_path, capsys):
    from fedbip_flwr.report import _what_left
    from fedbip_tools.cli import main

    _, blob, _, _ = private_mixture
    path = RunFolder(tmp_path).payloads / "sketch-0.safetensors"
    path.parent.mkdir(parents=True)
    path.write_bytes(blob)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert '"sample_rate": 0.08' in out and '"steps": 13' in out
    (row,) = [line for line in _what_left(tmp_path) if line.startswith("| sketch-0")]
    assert (
        "-DP per one private image" in row
        and "domain_concept, class_concepts by DP-SGD (q 0.08, 13 steps" in row
    )


def test_private_concepts_need_one_concept_per_class(tiny_ldm):
    cfg = method_config(
        "fedbip-mixture",
        **{"fedbip-mixture.dp-epsilon": 4.0, "fedbip.class-clusters": 2},
    )
    with pytest.raises(ValueError, match="needs fedbip.class-clusters = 1"):
        create_for(cfg).upload(client_job(cfg, tiny_ldm))


# --- Espresso: per-sub-cluster conditions and Z-Sampling -------------------------------------------


def test_espresso_learns_one_condition_per_sub_cluster_and_leaves_the_rest_at_the_plain_prompt(
    tiny_ldm,
):
    from fedbip_flwr.conditions import initial_conditions

    cfg, blob, metrics = upload_of(
        "espresso", tiny_ldm, **{"espresso.clusters": 3, "data.shots-per-class": 2}
    )
    upload = create_for(cfg).accept(blob, server_job(cfg, tiny_ldm))
    conditions, counts = upload.content.conditions, upload.content.counts
    start = initial_conditions(
        tiny_ldm, cfg.data.prompt_template, upload.domain, server_job(cfg, tiny_ldm).class_names, 3
    )
    moved = (conditions - start).abs().flatten(2).amax(-1) > 0
    # a class of n images has min(n, J) sub-clusters, each trained; the others keep c0
    assert moved.sum(1).tolist() == counts.clamp(max=3).tolist()
    assert not moved[:, 2].any(), "2 shots per class: the third sub-cluster has no image"
    assert sum(metrics["sub-cluster-sizes"]) == upload.meta.num_examples


def test_a_server_draws_a_condition_of_the_images_class_among_its_learned_ones():
    from fedbip_flwr.clusters import condition_rows

    counts, labels = torch.tensor([1, 9, 0]), torch.arange(3).repeat_interleave(400)
    rows = condition_rows(counts, 4, labels, seed=0)
    assert torch.equal(rows // 4, labels)
    chosen = [sorted((rows[labels == c] % 4).unique().tolist()) for c in range(3)]
    assert chosen == [[0], [0, 1, 2, 3], [0]]
    assert torch.equal(rows, condition_rows(counts, 4, labels, seed=0))


def test_espresso_refuses_conditions_beyond_their_learnings_reach_and_another_cluster_count(
    tiny_ldm,
):
    cfg, blob, _ = upload_of("espresso", tiny_ldm)

    def pushed(tensors, _meta):
        tensors["conditions"] = tensors["conditions"].clone()
        tensors["conditions"][1, 0, 3, 5] += 10.0

    with pytest.raises(PayloadError, match="sub-cluster 0 moved .* beyond"):
        create_for(cfg).accept(tampered(blob, "espresso", cfg, pushed), server_job(cfg, tiny_ldm))
    other = method_config("espresso", **{"espresso.clusters": 2})
    with pytest.raises(PayloadError, match="clusters 4 does not match the server's 2"):
        create_for(other).accept(blob, server_job(other, tiny_ldm))


@pytest.mark.parametrize("method", METHODS)
def test_a_domain_the_server_does_not_hold_is_refused(method, tiny_ldm):
    """The domain phrase becomes prompt text on the server: only the run's domains are taken."""
    cfg, blob, _ = upload_of(method, tiny_ldm)

    def elsewhere(_tensors, meta):
        meta["fedbip.domain"] = '"photo of a dog"'

    with pytest.raises(PayloadError, match="is not one of the server's domains"):
        create_for(cfg).accept(tampered(blob, method, cfg, elsewhere), server_job(cfg, tiny_ldm))


def claim_more(extra: list[int]):
    """A client that adds ``extra[c]`` to its count of class c (num_examples kept as it was)."""

    def change(tensors, _meta):
        counts = tensors["class_counts"]
        tensors["class_counts"] = counts + torch.tensor(extra + [0] * (len(counts) - len(extra)))

    return change


def claim_total(extra: int):
    """A client that claims ``extra`` more images of its first class, num_examples to match."""

    def change(tensors, meta):
        claim_more([extra])(tensors, meta)
        meta["fedbip.num_examples"] = json.dumps(int(tensors["class_counts"].sum()))

    return change


@pytest.mark.parametrize("method", METHODS)
def test_claimed_image_counts_are_held_to_max_images_per_client(method, tiny_ldm):
    """The counts decide how many images the server makes (and Espresso's condition reach): a
    claim above run config federation.max-images-per-client, in all or for one class, is refused
    before the mixture is read; a claim at the cap is taken."""
    cfg, blob, _ = upload_of(method, tiny_ldm)
    counts = audit_upload(blob, 2**30).tensors["class_counts"]
    n = int(counts.sum())
    assert int(counts.max()) < n - 1, "a per-class claim within the caps below"
    at_cap = method_config(method, **{"federation.max-images-per-client": n})
    assert create_for(at_cap).accept(blob, server_job(at_cap, tiny_ldm)).meta.num_examples == n
    below = method_config(method, **{"federation.max-images-per-client": n - 1})
    with pytest.raises(
        PayloadError,
        match=f"class_counts in all claims {n} images, above run config "
        f"federation.max-images-per-client {n - 1}",
    ):
        create_for(below).accept(blob, server_job(below, tiny_ldm))
    one_class = (
        f"class_counts of class 'circle' claims {int(counts[0]) + 10**9} images, above run config"
    )
    with pytest.raises(PayloadError, match=f"{one_class} federation.max-images-per-client 100000"):
        create_for(cfg).accept(
            tampered(blob, method, cfg, claim_total(10**9)), server_job(cfg, tiny_ldm)
        )
    # four counts of 2**62 more sum, in int64, to the honest num_examples; not in Python's ints
    with pytest.raises(PayloadError, match=r"class_counts \[4611686018427387\d+, .* must sum to"):
        create_for(cfg).accept(
            tampered(blob, method, cfg, claim_more([2**62] * 4)), server_job(cfg, tiny_ldm)
        )
    negative = [-int(counts[0]) - 1, int(counts[0]) + 1]
    with pytest.raises(PayloadError, match="class_counts .* must be non-negative"):
        create_for(cfg).accept(
            tampered(blob, method, cfg, claim_more(negative)), server_job(cfg, tiny_ldm)
        )
