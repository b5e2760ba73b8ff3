"""The privacy measurements (fedbip_tools.privacy) against their definitions.

Membership statistics are checked at both ends: no leak (members, non-members and synthetic
images drawn alike, AUC within 3 standard errors of 0.5) and total leak (synthetic copies of the
members, AUC 1; copies of the non-members, AUC 0, which pins the sign of the score).
"""

from __future__ import annotations

import math

import pytest
import torch

from fedbip_flwr.shapes import client_train_set
from fedbip_tools.privacy import (
    DATA_RANGE,
    SSIM_K1,
    averaged_reconstructions,
    backbone_features,
    dcr_membership,
    density_ratio_membership,
    loss_membership_inference,
    membership_result,
    nearest_distances,
    psnr,
    reconstruction_score,
    ssim,
)

DOMAIN = "sketch"
SIZE = 32


def images(client_index: int, shots: int, seed: int = 0) -> torch.Tensor:
    return client_train_set(DOMAIN, shots, client_index=client_index, seed=seed, size=SIZE).images


def null_stderr(n1: int, n2: int) -> float:
    """The exact standard error of the AUC when both groups are drawn alike (Mann-Whitney)."""
    return math.sqrt((n1 + n2 + 1) / (12 * n1 * n2))


def test_nearest_distances_match_brute_force_across_chunks() -> None:
    generator = torch.Generator().manual_seed(0)
    queries, references = (
        torch.randn(13, 3, 4, 4, generator=generator),
        torch.randn(29, 3, 4, 4, generator=generator),
    )
    brute = (queries.flatten(1)[:, None] - references.flatten(1)[None]).norm(dim=-1).amin(dim=1)
    # the same 48 squares summed in another order (cdist): <= 48 x 2^-24 = 2.9e-6 relative
    chunked = nearest_distances(queries, references, chunk=5)
    torch.testing.assert_close(chunked, brute, rtol=1e-5, atol=0)


def test_dcr_auc_is_chance_when_the_synthetic_set_holds_no_client_data() -> None:
    # Three disjoint clients of one domain: exchangeable, so membership cannot show.
    members, non_members, synthetic = images(0, 8), images(1, 8), images(2, 16)
    result = dcr_membership(members, non_members, synthetic)
    assert result.space == "pixels"
    # Hanley-McNeil near AUC 0.5 must be the exact null standard error (10 %: |AUC - 0.5| moves it)
    assert result.auc_stderr == pytest.approx(null_stderr(48, 48), rel=0.1)
    assert abs(result.auc - 0.5) < 3 * result.auc_stderr


def test_dcr_flags_copied_members_and_measures_rms_per_pixel() -> None:
    members, non_members = images(0, 4), images(1, 4)
    noise = 0.01 * torch.randn(members.shape, generator=torch.Generator().manual_seed(0))
    synthetic = torch.cat([members + noise, images(2, 4)])
    result = dcr_membership(members, non_members, synthetic)
    assert result.auc == 1.0
    assert result.share_closer == 1.0
    # each member's nearest synthetic image is its own copy: RMS of the noise, 0.01
    # (3 * 32 * 32 values per image: the RMS of one image's noise is within ~3 % of 0.01).
    # float32: members + noise rounds by <= 2^-24 x 1 against noise ~0.01 (6e-6 relative) and
    # the 3072 squares are summed in another order (<= 3072 x 2^-24 = 1.8e-4): rtol 1e-3. The
    # matrix-product distance alone is off by up to 3e-3 here on an AMX Xeon (cancellation).
    torch.testing.assert_close(
        result.member_distances, noise.flatten(1).square().mean(1).sqrt(), rtol=1e-3, atol=1e-5
    )
    assert result.member_distances.mean() == pytest.approx(0.01, rel=0.05)
    assert result.non_member_distances.min() > 10 * result.member_distances.max()


def test_dcr_sign_copies_of_non_members_score_zero() -> None:
    members, non_members = images(0, 4), images(1, 4)
    result = dcr_membership(members, non_members, non_members.clone())
    assert result.auc == 0.0
    assert result.share_closer == 0.0


def test_feature_space_runs_on_the_shipped_backbone() -> None:
    features = backbone_features("models/miniature-ldm")
    members, non_members = images(0, 2), images(1, 2)
    out = features(members)
    assert out.shape == (len(members), 512)
    assert torch.isfinite(out).all()
    # different images, different features: the backbone is not a constant map
    assert torch.cdist(out, out).fill_diagonal_(math.inf).min() > 0
    result = dcr_membership(members, non_members, torch.cat([members, images(2, 2)]), features)
    assert result.space == "features"
    assert result.auc == 1.0 and result.share_closer == 1.0
    assert result.member_distances.max() < 1e-3
    # unit vectors: no two are further apart than 2
    assert 0 < result.non_member_distances.min() and result.non_member_distances.max() <= 2


def flat(images: torch.Tensor) -> torch.Tensor:
    """A feature map that is the pixels themselves."""
    return images.flatten(1)


def test_domias_finds_members_a_synthetic_set_crowds_around() -> None:
    # the synthetic set: two noisy copies of every member beside as many other images; the
    # reference: public images of the domain (another client's). Chance for the set of other
    # images alone, and for the same scores with membership drawn at random.
    members, non_members, reference = images(0, 8), images(1, 8), images(3, 16)
    generator = torch.Generator().manual_seed(0)
    copies = members.repeat(2, 1, 1, 1)
    copies = copies + 0.05 * torch.randn(copies.shape, generator=generator)
    crowded = density_ratio_membership(
        members, non_members, torch.cat([copies, images(2, 16)]), reference, flat
    )
    assert crowded.auc > 0.9, crowded.auc
    assert crowded.tpr_at_max_fpr > 0.3
    unrelated = density_ratio_membership(
        members, non_members, torch.cat([images(2, 16), images(4, 16)]), reference, flat
    )
    assert abs(unrelated.auc - 0.5) < 3 * unrelated.auc_stderr
    pooled = torch.cat([crowded.member_scores, crowded.non_member_scores])
    order = torch.randperm(len(pooled), generator=generator)
    half = len(crowded.member_scores)
    shuffled = membership_result(pooled[order[:half]], pooled[order[half:]])
    assert abs(shuffled.auc - 0.5) < 3 * shuffled.auc_stderr


def test_psnr_matches_its_definition() -> None:
    a = images(0, 1)
    assert torch.isinf(psnr(a, a)).all()
    shifts = torch.linspace(0.05, 0.3, len(a))
    b = a + shifts[:, None, None, None]  # MSE of image i is shifts[i]^2
    expected = 10 * torch.log10(DATA_RANGE**2 / shifts.double().square())
    torch.testing.assert_close(psnr(a, b), expected, rtol=1e-6, atol=1e-6)
    assert psnr(a, a + 0.1)[0].item() == pytest.approx(10 * math.log10(4 / 0.01), rel=1e-6)


def test_ssim_is_one_for_identical_symmetric_and_below_one_otherwise() -> None:
    a = images(0, 1)
    torch.testing.assert_close(ssim(a, a), torch.ones(len(a), dtype=torch.float64))
    b = a + 0.2 * torch.randn(a.shape, generator=torch.Generator().manual_seed(0))
    assert (ssim(a, b) < 1).all()
    torch.testing.assert_close(ssim(a, b), ssim(b, a))


def test_ssim_of_flat_images_is_the_luminance_term() -> None:
    # no variance anywhere: SSIM = (2 c1 c2 + C1) / (c1^2 + c2^2 + C1), with C1 = (K1 * 2)^2
    c_a, c_b = 0.5, -0.25
    a, b = torch.full((1, 3, 16, 16), c_a), torch.full((1, 3, 16, 16), c_b)
    c1 = (SSIM_K1 * DATA_RANGE) ** 2
    expected = (2 * c_a * c_b + c1) / (c_a**2 + c_b**2 + c1)
    assert ssim(a, b).item() == pytest.approx(expected, rel=1e-9)


def test_ssim_matches_a_window_by_window_evaluation_of_the_definition() -> None:
    # Wang et al. 2004, eqs. 13-15: Gaussian-weighted moments of every 11 x 11 window (std 1.5),
    # C1 = (0.01 L)^2, C2 = (0.03 L)^2 with L = 2, averaged over windows and channels.
    generator = torch.Generator().manual_seed(0)
    a = torch.rand(1, 3, 13, 14, generator=generator) * 2 - 1
    b = (a + 0.3 * torch.randn(a.shape, generator=generator)).clamp(-1, 1)
    offsets = torch.arange(11, dtype=torch.float64) - 5
    weights = torch.exp(-(offsets[:, None] ** 2 + offsets[None] ** 2) / (2 * 1.5**2))
    weights = weights / weights.sum()
    c1, c2 = (0.01 * 2) ** 2, (0.03 * 2) ** 2
    values = []
    for channel in range(3):
        for top in range(13 - 10):
            for left in range(14 - 10):
                x = a[0, channel, top : top + 11, left : left + 11].double()
                y = b[0, channel, top : top + 11, left : left + 11].double()
                mx, my = (weights * x).sum(), (weights * y).sum()
                vx, vy = (weights * (x - mx) ** 2).sum(), (weights * (y - my) ** 2).sum()
                cxy = (weights * (x - mx) * (y - my)).sum()
                values.append(
                    (2 * mx * my + c1) * (2 * cxy + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
                )
    assert ssim(a, b).item() == pytest.approx(float(torch.stack(values).mean()), rel=1e-9)


def test_reconstruction_score_compares_with_the_unrelated_baseline() -> None:
    originals, unrelated = images(0, 1), images(1, 1)  # same classes, row for row
    reconstructions = originals + 0.05 * torch.randn(
        originals.shape, generator=torch.Generator().manual_seed(0)
    )
    score = reconstruction_score(reconstructions, originals, unrelated)
    assert score.psnr == pytest.approx(float(psnr(reconstructions, originals).mean()))
    assert score.baseline_ssim == pytest.approx(float(ssim(reconstructions, unrelated).mean()))
    assert score.psnr > score.baseline_psnr + 10
    assert score.ssim > score.baseline_ssim
    assert math.isinf(reconstruction_score(originals, originals, unrelated).psnr)


def test_averaging_an_images_reconstructions_keeps_the_image_and_loses_the_noise() -> None:
    """k rows of each private image, in any order: their mean is image i with the noise's
    variance divided by k, so it reconstructs better than one row, as PSNR says (+10 log10 k)."""
    originals, unrelated = images(0, 2), images(1, 2)
    n, k = len(originals), 16
    generator = torch.Generator().manual_seed(0)
    rows = originals.repeat(k, 1, 1, 1) + 0.3 * torch.randn(
        (k * n, *originals.shape[1:]), generator=generator
    )
    order = torch.randperm(k * n, generator=generator)
    averaged = averaged_reconstructions(rows[order], torch.arange(n).repeat(k)[order], n)
    assert averaged.shape == originals.shape
    # 16-row means, perhaps summed in another order: <= 16 x 2^-24 x max|row| (~2.5), 2.4e-6,
    # under the default atol 1e-5
    torch.testing.assert_close(averaged[1], rows[1::n].mean(0))
    one, mean = (
        reconstruction_score(rows[:n], originals, unrelated),
        reconstruction_score(averaged, originals, unrelated),
    )
    # an image's MSE is a mean of 3072 squared normal draws (2.6 % standard error, 0.11 dB): the
    # mean PSNR of 12 images has 0.03 dB, the difference 0.05 dB; 0.5 dB is 10 standard errors
    assert mean.psnr - one.psnr == pytest.approx(10 * math.log10(k), abs=0.5)
    assert mean.psnr - mean.baseline_psnr > one.psnr - one.baseline_psnr
    with pytest.raises(ValueError, match="each of the 12 private images"):
        averaged_reconstructions(rows[: n - 1], torch.arange(n - 1), n)


def test_loss_attack_separated_and_identical_losses() -> None:
    separated = loss_membership_inference([0.1, 0.2, 0.3], [1.0, 2.0, 3.0, 4.0])
    assert separated.auc == 1.0 and separated.tpr_at_max_fpr == 1.0
    generator = torch.Generator().manual_seed(0)
    members, non_members = (
        torch.rand(500, generator=generator),
        torch.rand(500, generator=generator),
    )
    alike = loss_membership_inference(members, non_members)
    assert alike.auc_stderr == pytest.approx(null_stderr(500, 500), rel=0.05)
    assert abs(alike.auc - 0.5) < 3 * alike.auc_stderr


def test_tpr_at_one_percent_fpr_on_a_constructed_case() -> None:
    # 100 non-members at losses 1..100; 5 members below all of them, 5 between the lowest two,
    # 10 far above. Flagging losses <= 1.5 catches 10 of 20 members and 1 of 100 non-members
    # (FPR exactly 1 %); any threshold further up costs a second false positive.
    non_members = torch.arange(1, 101, dtype=torch.float64)
    members = torch.tensor([0.5] * 5 + [1.5] * 5 + [50.5] * 10, dtype=torch.float64)
    result = loss_membership_inference(members, non_members)
    assert result.max_fpr == 0.01
    assert result.tpr_at_max_fpr == 0.5
    assert loss_membership_inference(members, non_members, max_fpr=0.005).tpr_at_max_fpr == 0.25


def test_tpr_at_low_fpr_keeps_thresholds_on_a_straight_stretch_of_the_curve() -> None:
    # One member below every non-member, then 20 members tied one to one with the lowest 20
    # non-members: the ROC points after the first lie on one line, and the one at FPR 1 %
    # (2 of 21 members) is exactly what roc_curve's default drop_intermediate would drop.
    non_members = torch.arange(1, 101, dtype=torch.float64)
    members = torch.cat(
        [torch.tensor([0.5], dtype=torch.float64), torch.arange(1, 21, dtype=torch.float64)]
    )
    assert loss_membership_inference(members, non_members).tpr_at_max_fpr == pytest.approx(2 / 21)
