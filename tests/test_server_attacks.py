"""The server's membership test on z(T) uploads (fedbip_tools.privacy.zT_membership_scores)
against its definition, on synthetic latents run through the client's own instance step.

Latents are drawn per class (a class mean plus independent per-image variation) and handed to
:func:`fedbip_flwr.instance.personalize_instances` through an identity "VAE", with Stable
Diffusion v1-x's noise schedule: the rows are exactly what a client uploads, only the encoder
is left out (it is not what these tests are about). Checked at both ends, as in
tests/test_privacy_measures.py: nothing to find (AUC within 3 standard errors of 0.5) and
everything to find (large sqrt(abar), or no noise at all: AUC 1).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from diffusers import PNDMScheduler

from fedbip_flwr.instance import InstanceLatents, forward_noise, personalize_instances
from fedbip_flwr.ldm import SD_SCHEDULER_CONFIG
from fedbip_flwr.method_settings import FedLDSettings
from fedbip_flwr.methods import fedld
from fedbip_flwr.mixture import LatentMixture, fit_mixture
from fedbip_tools.privacy import (
    AttackResult,
    LatentReference,
    _row_noise,
    class_mean_scores,
    group_rows,
    lira_offline_scores,
    membership_result,
    mixture_log_density,
    mixture_membership_scores,
    tpr_at_fpr,
    zT_membership_scores,
)

SHAPE = (4, 8, 8)  # 256 values per latent
CLASSES = 3
PER_CLASS = 16  # the default federation's shots per class
SCHEDULE = PNDMScheduler(**SD_SCHEDULER_CONFIG)


class IdentityVAE:
    """What encode_images reads of a VAE, returning its input: "images" are latents here."""

    device, dtype = torch.device("cpu"), torch.float32
    config = SimpleNamespace(scaling_factor=1.0)

    def encode(self, batch: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=batch))


def null_stderr(n1: int, n2: int) -> float:
    """The exact standard error of the AUC when both groups are drawn alike (Mann-Whitney)."""
    return math.sqrt((n1 + n2 + 1) / (12 * n1 * n2))


def draw(
    means: torch.Tensor, per_class: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.arange(len(means)).repeat_interleave(per_class)
    return means[labels] + torch.randn(len(labels), *means.shape[1:], generator=generator), labels


def world(seed: int, shape: tuple[int, ...] = SHAPE) -> dict:
    """Members, as many non-members, and the server's reference, all of the same classes."""
    generator = torch.Generator().manual_seed(seed)
    means = 0.5 * torch.randn(CLASSES, *shape, generator=generator)
    members, labels = draw(means, PER_CLASS, generator)
    non_members, non_labels = draw(means, PER_CLASS, generator)
    others, _ = draw(means, PER_CLASS, generator)  # a client that holds none of the members
    reference, reference_labels = draw(means, 30, generator)
    return {
        "members": members,
        "labels": labels,
        "non_members": non_members,
        "non_labels": non_labels,
        "others": others,
        "reference": LatentReference.of(reference, reference_labels),
        "public": (reference, reference_labels),
    }


def upload(
    members: torch.Tensor, labels: torch.Tensor, timestep: int, draws: int, seed: int = 0
) -> InstanceLatents:
    return personalize_instances(
        IdentityVAE(),
        SCHEDULE,
        members,
        labels,
        timestep,
        draws=draws,
        generator=torch.Generator().manual_seed(seed),
    )


def sqrt_abar(timestep: int) -> float:
    return float(SCHEDULE.alphas_cumprod[timestep].sqrt())


def run(
    seeds,
    timestep: int,
    draws: int,
    *,
    oracle: bool | str = False,
    rows_of_members: bool = True,
    **options,
):
    """Members' and non-members' scores pooled over one client per seed (each scored against its
    own client's upload). ``rows_of_members=False``: the upload is of other images of the same
    classes, so the "members" are no more in it than the non-members."""
    members, non_members = [], []
    for seed in seeds:
        w = world(seed)
        uploaded = w["members"] if rows_of_members else w["others"]
        inst = upload(uploaded, w["labels"], timestep, draws, seed)
        groups = (
            _image_of_row(len(inst.zT), len(w["labels"]), wrong=oracle == "wrong")
            if oracle
            else None
        )
        kwargs = {
            "signal_scale": sqrt_abar(timestep),
            "reference": w["reference"],
            "groups": groups,
            "latents_per_image": draws,
            **options,
        }
        members.append(
            zT_membership_scores(w["members"], w["labels"], inst.zT, inst.zT_labels, **kwargs)
        )
        non_members.append(
            zT_membership_scores(
                w["non_members"], w["non_labels"], inst.zT, inst.zT_labels, **kwargs
            )
        )
    return torch.cat(members), torch.cat(non_members)


def _image_of_row(rows: int, images: int, wrong: bool = False) -> torch.Tensor:
    """The image of every row of a K-draw upload in the client's order (row k N + i: image i);
    ``wrong``: draw k's row of image i put with image i + k of its class instead."""
    image, draw_index = torch.arange(rows) % images, torch.arange(rows) // images
    if not wrong:
        return image
    return image // PER_CLASS * PER_CLASS + (image % PER_CLASS + draw_index) % PER_CLASS


# --- tpr_at_fpr ------------------------------------------------------------------------------------


def test_tpr_at_fpr_on_known_scores() -> None:
    members = torch.tensor([10.0, 9.0, 5.0, 0.5])
    non_members = torch.arange(100, dtype=torch.float64) / 10  # 0.0 .. 9.9
    # FPR <= 1 %: one false positive at most, so the threshold is 9.9: only 10.0 is above it
    assert tpr_at_fpr(members, non_members, 0.01) == 0.25
    # FPR <= 2 %: the threshold may be 9.8 (9.9 and 9.8 false): still only 10.0 is found
    assert tpr_at_fpr(members, non_members, 0.02) == 0.25
    # FPR <= 10 %: threshold 9.0 (9.0 .. 9.9 false, 10 of 100): 10.0 and 9.0 found
    assert tpr_at_fpr(members, non_members, 0.10) == 0.5
    assert tpr_at_fpr(members, non_members, 1.0) == 1.0
    # separated sets: every member at FPR 0
    assert tpr_at_fpr([5.0, 6.0], [1.0, 2.0, 3.0], 0.0) == 1.0
    # FPR below 1 / n allows no false positive: members tied with the best non-member are not found
    assert tpr_at_fpr([3.0, 3.0, 4.0], [3.0, 1.0], 0.4) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="at least one"):
        tpr_at_fpr([], [1.0])


# --- the pieces ----------------------------------------------------------------------------------


def test_group_rows_averages_each_images_rows() -> None:
    rows = torch.arange(12, dtype=torch.float64).view(6, 2)
    labels = torch.tensor([0, 1, 0, 0, 1, 0])
    means, group_labels, counts = group_rows(rows, labels, torch.tensor([0, 1, 2, 0, 1, 2]))
    torch.testing.assert_close(
        means, torch.tensor([[3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], dtype=torch.float64)
    )
    assert group_labels.tolist() == [0, 1, 0] and counts.tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="mixes"):
        group_rows(rows, labels, torch.tensor([0, 0, 1, 1, 2, 2]))


def test_reference_spread_is_the_within_class_covariance_and_whitening_solves_it() -> None:
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(20, 3, 2, 2, generator=generator) + torch.arange(2).repeat(10).view(
        -1, 1, 1, 1
    )
    labels = torch.arange(2).repeat(10)
    reference = LatentReference.of(latents, labels)
    flat = latents.double().flatten(1)
    centred = torch.cat([flat[labels == y] - flat[labels == y].mean(0) for y in (0, 1)])
    torch.testing.assert_close(
        reference.spread.T @ reference.spread, centred.T @ centred / (20 - 2)
    )
    # S^-1 u by Woodbury against a direct solve of S = s^2 I + a^2 k C
    a, mean, std = 0.3, 0.5, 0.1
    k = mean**2 + (1 - mean) ** 2 + 2 * std**2
    covariance = (1 - a * a) * torch.eye(
        12, dtype=torch.float64
    ) + a * a * k * centred.T @ centred / 18
    u = torch.randn(5, 12, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(
        _row_noise(a, mean, std, reference)(u), torch.linalg.solve(covariance, u.T).T
    )


def test_rows_statistic_ignores_the_order_of_the_rows() -> None:
    w = world(0)
    inst = upload(w["members"], w["labels"], 999, draws=2)
    order = torch.randperm(len(inst.zT), generator=torch.Generator().manual_seed(1))
    for statistic in ("likelihood-ratio", "max-correlation"):
        kwargs = {
            "signal_scale": sqrt_abar(999),
            "reference": w["reference"],
            "latents_per_image": 2,
            "statistic": statistic,
        }
        as_given = zT_membership_scores(
            w["members"], w["labels"], inst.zT, inst.zT_labels, **kwargs
        )
        shuffled = zT_membership_scores(
            w["members"], w["labels"], inst.zT[order], inst.zT_labels[order], **kwargs
        )
        torch.testing.assert_close(shuffled, as_given, rtol=1e-9, atol=1e-9)


# --- the attack at both ends -----------------------------------------------------------------------


@pytest.mark.parametrize("statistic", ["likelihood-ratio", "max-correlation"])
def test_positive_control_large_sqrt_abar_finds_the_members(statistic: str) -> None:
    # T = 200: sqrt(abar) = 0.87, each row mostly its two images
    members, non_members = run([0, 1], timestep=200, draws=1, statistic=statistic)
    result = membership_result(members, non_members, statistic=statistic)
    assert result.auc > 0.99
    assert result.tpr_at_max_fpr > 0.5
    # the same scores with membership drawn at random: chance, within 3 standard errors
    pooled = torch.cat([members, non_members])
    order = torch.randperm(len(pooled), generator=torch.Generator().manual_seed(0))
    shuffled = membership_result(pooled[order[: len(members)]], pooled[order[len(members) :]])
    assert shuffled.auc_stderr == pytest.approx(
        null_stderr(len(members), len(non_members)), rel=0.1
    )
    assert abs(shuffled.auc - 0.5) < 3 * shuffled.auc_stderr


def test_an_upload_of_other_images_gives_chance() -> None:
    # the "members" are not in the upload (other images of their classes are): nothing to find,
    # even at T = 200 where the rows are mostly image
    members, non_members = run([0, 1, 2], timestep=200, draws=2, rows_of_members=False)
    result = membership_result(members, non_members)
    assert abs(result.auc - 0.5) < 3 * result.auc_stderr


@pytest.mark.parametrize("statistic", ["likelihood-ratio", "max-correlation"])
def test_without_noise_the_attack_is_perfect(statistic: str) -> None:
    # a schedule with no noise at all (every beta 0: sqrt(abar) = 1, sqrt(1 - abar) = 0): the
    # client's rows are its mixes g z_i + (1 - g) z_i' exactly
    noiseless = PNDMScheduler(num_train_timesteps=1000, trained_betas=[0.0] * 1000)
    w = world(0)
    inst = personalize_instances(
        IdentityVAE(),
        noiseless,
        w["members"],
        w["labels"],
        999,
        generator=torch.Generator().manual_seed(0),
    )
    g = inst.gammas.view(-1, 1, 1, 1)
    torch.testing.assert_close(inst.zT, g * inst.z0 + (1 - g) * inst.z0[inst.partners])
    kwargs = {"signal_scale": 1.0, "reference": w["reference"], "statistic": statistic}
    members = zT_membership_scores(w["members"], w["labels"], inst.zT, inst.zT_labels, **kwargs)
    non_members = zT_membership_scores(
        w["non_members"], w["non_labels"], inst.zT, inst.zT_labels, **kwargs
    )
    result = membership_result(members, non_members)
    assert result.auc == 1.0 and result.tpr_at_max_fpr == 1.0


def test_oracle_grouping_beats_rows_as_given_at_k_above_one() -> None:
    # T = 999 with K = 10 rows per image: averaging an image's rows cuts their noise by sqrt(10),
    # where the best single row of the rows as given carries one row's worth
    seeds = range(4)
    rows = membership_result(*run(seeds, 999, draws=10, statistic="max-correlation"))
    oracle = membership_result(*run(seeds, 999, draws=10, oracle=True, statistic="max-correlation"))
    assert rows.auc < 0.7  # not saturated: there is room to improve
    assert oracle.auc - rows.auc > 3 * math.hypot(rows.auc_stderr, oracle.auc_stderr)


def test_likelihood_ratio_uses_the_grouping() -> None:
    # The rows-as-given likelihood ratio already adds up every row that carries a member, so the
    # order adds less to it (measured: 0.75 -> 0.78 here, 0.66 -> 0.69 on the 64 px shapes at
    # K = 10); it must still add, and a wrong grouping (each group one row of each of K images
    # of the class) must take it away.
    seeds = range(12)
    rows = membership_result(*run(seeds, 999, draws=10))
    oracle = membership_result(*run(seeds, 999, draws=10, oracle=True))
    wrong = membership_result(*run(seeds, 999, draws=10, oracle="wrong"))
    assert oracle.auc > rows.auc > wrong.auc
    assert oracle.auc - wrong.auc > 2 * math.hypot(oracle.auc_stderr, wrong.auc_stderr)


def test_whitening_is_no_worse_and_scores_are_finite_at_the_default() -> None:
    seeds = range(4)
    whitened = membership_result(*run(seeds, 999, draws=2))
    plain = membership_result(*run(seeds, 999, draws=2, whiten=False))
    for result in (whitened, plain):
        assert (
            torch.isfinite(result.member_scores).all()
            and torch.isfinite(result.non_member_scores).all()
        )
    assert whitened.auc > plain.auc - 2 * plain.auc_stderr


# --- the mixture uploads (fedbip-mixture, FedLD) -----------------------------------------------


def fitted(inst: InstanceLatents, seed: int) -> LatentMixture:
    """fedbip-mixture's fit: 4 Gaussians per class, at most one per 4 rows."""
    generator = torch.Generator().manual_seed(seed)
    return fit_mixture(inst.zT, inst.zT_labels, CLASSES, 4, generator, rows_per_component=4)


def run_mixture(
    seeds, timestep: int, statistic: str, rows_of_members: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`run`, against the mixture fitted to each client's z(T) (2 per image); the
    server's reference mixture is fitted the same way to z(T) it makes from its public images."""
    members, non_members = [], []
    for seed in seeds:
        w = world(seed)
        uploaded = w["members"] if rows_of_members else w["others"]
        mixture = fitted(upload(uploaded, w["labels"], timestep, 2, seed), seed)
        kwargs = {
            "signal_scale": sqrt_abar(timestep),
            "reference": w["reference"],
            "reference_mixture": fitted(upload(*w["public"], timestep, 2, seed + 50), seed + 50),
            "statistic": statistic,
        }
        members.append(mixture_membership_scores(w["members"], w["labels"], mixture, **kwargs))
        non_members.append(
            mixture_membership_scores(w["non_members"], w["non_labels"], mixture, **kwargs)
        )
    return torch.cat(members), torch.cat(non_members)


def test_mixture_log_density_is_scikit_learns() -> None:
    from sklearn.mixture import GaussianMixture

    rows = torch.randn(40, 6, generator=torch.Generator().manual_seed(0)).double()
    gm = GaussianMixture(3, covariance_type="diag", random_state=0).fit(rows.numpy())
    mixture = LatentMixture(
        torch.from_numpy(gm.weights_)[None],
        torch.from_numpy(gm.means_)[None],
        torch.from_numpy(gm.covariances_)[None],
        (1, 2, 3),
    )
    points = torch.randn(7, 6, generator=torch.Generator().manual_seed(1)).double()
    ours = mixture_log_density(mixture, points, torch.zeros(7, dtype=torch.long))
    assert torch.allclose(ours, torch.from_numpy(gm.score_samples(points.numpy())), atol=1e-9)
    # a padding component (weight 0) changes nothing, wherever it sits
    padded = LatentMixture(
        torch.cat([mixture.weights, torch.zeros(1, 1, dtype=torch.float64)], 1),
        torch.cat([mixture.means, points[:1, None]], 1),
        torch.cat([mixture.variances, torch.full((1, 1, 6), 1e-6, dtype=torch.float64)], 1),
        (1, 2, 3),
    )
    assert torch.allclose(mixture_log_density(padded, points, torch.zeros(7).long()), ours)


@pytest.mark.parametrize("statistic", ["likelihood-ratio", "mean-filter"])
def test_mixture_attack_finds_members_at_large_sqrt_abar(statistic: str) -> None:
    # T = 200: each component's mean is mostly its few rows' images
    members, non_members = run_mixture([0, 1], 200, statistic)
    assert membership_result(members, non_members).auc > 0.85


@pytest.mark.parametrize("statistic", ["likelihood-ratio", "mean-filter"])
def test_mixture_of_other_images_gives_chance(statistic: str) -> None:
    result = membership_result(*run_mixture([0, 1, 2], 200, statistic, rows_of_members=False))
    assert abs(result.auc - 0.5) < 3 * result.auc_stderr


def test_mixture_likelihood_ratio_needs_the_reference_mixture() -> None:
    w = world(0)
    mixture = fitted(upload(w["members"], w["labels"], 200, 2), 0)
    with pytest.raises(ValueError, match="reference_mixture"):
        mixture_membership_scores(
            w["members"], w["labels"], mixture, signal_scale=0.5, reference=w["reference"]
        )


# --- per-class means (FedPFT, OSCAR) --------------------------------------------------------------


@pytest.mark.parametrize("own", [True, False])
def test_class_mean_test_finds_the_images_a_mean_was_taken_of(own: bool) -> None:
    # 16 members per class in 256 values: each moves its class's mean by 1/16 of its offset
    aucs = []
    for seed in range(3):
        w = world(seed)
        averaged = w["members"] if own else w["others"]
        means = torch.stack([averaged[w["labels"] == y].mean(0) for y in range(CLASSES)])
        kwargs = {"uploaded_means": means, "centres": w["reference"].centres}
        aucs.append(
            membership_result(
                class_mean_scores(w["members"], w["labels"], **kwargs),
                class_mean_scores(w["non_members"], w["non_labels"], **kwargs),
            )
        )
    pooled = membership_result(
        torch.cat([a.member_scores for a in aucs]), torch.cat([a.non_member_scores for a in aucs])
    )
    if own:
        assert pooled.auc > 0.9
    else:
        assert abs(pooled.auc - 0.5) < 3 * pooled.auc_stderr


def test_offline_lira_takes_away_each_candidates_difficulty() -> None:
    """Candidates differ in how hard any model of the domain finds them (a loss spread far
    wider than what training on one changes): the plain loss test barely sees members, LiRA
    against reference models that share the difficulty does; without a member effect it finds
    nothing."""
    g = torch.Generator().manual_seed(0)
    n, references = 400, 4
    member = torch.arange(n) < n // 2
    difficulty = torch.rand(n, generator=g) * 4.0 + 0.05  # per-candidate loss any model gets

    def losses(shift: torch.Tensor) -> torch.Tensor:
        return (difficulty - shift + 0.1 * torch.randn(n, generator=g)).clamp_min(1e-3)

    reference = torch.stack([losses(torch.zeros(n)) for _ in range(references)])
    trained = losses(0.4 * member)
    lira = lira_offline_scores(trained, reference)
    plain = membership_result(-trained[member], -trained[~member]).auc
    found = membership_result(lira[member], lira[~member]).auc
    assert found > 0.95 and found > plain + 0.2, (found, plain)
    untouched = lira_offline_scores(losses(torch.zeros(n)), reference)
    result = membership_result(untouched[member], untouched[~member])
    assert abs(result.auc - 0.5) < 4 * null_stderr(n // 2, n // 2)
    with pytest.raises(ValueError, match="at least two"):
        lira_offline_scores(trained, reference[:1])
    with pytest.raises(ValueError, match="not"):
        lira_offline_scores(trained[:10], reference)


# --- DP class statistics (FedLD's and the mixture mode's DP uploads) -------------------------------


def run_dp_release(shape: tuple[int, ...], epsilon: float) -> AttackResult:
    """The mean-filter test against FedLD's DP release (its own guarantee at this latent size)
    of each client's one z(T) per image at T = 200, where a class mean still carries each of
    its 16 images."""
    members, non_members = [], []
    for seed in range(3):
        w = world(seed, shape)
        guarantee = fedld.dp_stats_guarantee(FedLDSettings(dp_epsilon=epsilon), math.prod(shape))
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(w["members"].shape, generator=generator)
        z_t = forward_noise(SCHEDULE, w["members"], 200, noise)
        alpha_bar = sqrt_abar(200) ** 2
        mixture, _, _ = fedld.private_mixture(
            z_t, w["labels"], CLASSES, guarantee, 4, alpha_bar, generator, False
        )
        public = upload(*w["public"], 200, 1, seed + 50)
        kwargs = {
            "signal_scale": sqrt_abar(200),
            "reference": w["reference"],
            "reference_mixture": fitted(public, seed + 50),
            "statistic": "mean-filter",
            "gamma_mean": 1.0,
            "gamma_std": 0.0,
        }
        members.append(mixture_membership_scores(w["members"], w["labels"], mixture, **kwargs))
        non_members.append(
            mixture_membership_scores(w["non_members"], w["non_labels"], mixture, **kwargs)
        )
    return membership_result(torch.cat(members), torch.cat(non_members))


@pytest.mark.parametrize("shape", [SHAPE, (4, 16, 16)], ids=["256 values", "1024 values"])
def test_the_dp_release_hides_members_its_noiseless_mean_gives_away(shape) -> None:
    """At any latent size: the clip, and with it the noise, grows with sqrt(D) as a member's
    signal in the class mean does, so epsilon, not D, bounds the test. The positive control:
    the release at epsilon 100 (the most a run config accepts), whose noise is small."""
    assert run_dp_release(shape, 100.0).auc > 0.75, "positive control"
    hidden = run_dp_release(shape, 1.0)
    assert abs(hidden.auc - 0.5) < 3 * hidden.auc_stderr
