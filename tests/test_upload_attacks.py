"""The server's membership test on each kind of upload it receives (fedbip_tools.upload_attacks),
run on real uploads: each method's client step on a tiny model, taken in by its own acceptance.

Both ends are checked where the upload kind allows: a FedBiP upload noised only lightly (a low
start timestep keeps most of each image) gives its members away, and the same test against an
upload of other images of the domain finds nothing; Central's upload is the images themselves.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedbip_flwr import shapes
from fedbip_flwr.methods import create_for
from fedbip_tools.upload_attacks import (
    REFERENCE_PER_CLASS,
    TESTS,
    Candidates,
    ServerView,
    attack_upload,
    upload_test,
)
from tests.helpers import client_job, method_config, server_job

SHOTS = 8  # 48 members a side: standard error of an AUC about 0.06


def candidates(cfg) -> Candidates:
    """Partition 0's private images against as many unseen images of its domain and classes."""
    members = client_job(cfg, None).data
    others = shapes.client_train_set(members.domain, SHOTS, 1, cfg.seed, cfg.data.image_size)
    return Candidates(members, others)


def view(cfg, ldm, domain: str) -> ServerView:
    public = shapes.pretrain_set(domain, REFERENCE_PER_CLASS // 10, cfg.seed, cfg.data.image_size)
    return ServerView(cfg, lambda: ldm, public)


def accepted(cfg, ldm, data=None):
    job = client_job(cfg, ldm)
    if data is not None:
        job = type(job)(cfg, data, job.generator, job.ldm)
    blob, _ = create_for(cfg).upload(job)
    return create_for(cfg).accept(blob, server_job(cfg, ldm))


def test_every_one_shot_upload_of_an_image_has_a_test_and_prompts_only_none():
    assert upload_test("prompts-only") is None and upload_test("fedavg") is None
    assert set(TESTS) == {
        "fedbip",
        "fedbip-mixture",
        "fedld",
        "espresso",
        "fedpft",
        "oscar",
        "fedlmg",
        "local",
        "central",
    }


def test_lightly_noised_z_t_give_the_members_away_and_other_images_give_nothing(tiny_ldm):
    """The positive control (fails if the scores were shuffled or the test ignored the rows)
    and the negative one (an upload of images no candidate is among)."""
    cfg = method_config(
        "fedbip", **{"data.shots-per-class": SHOTS, "synthesis.start-timestep": 100}
    )
    c = candidates(cfg)
    found = attack_upload(accepted(cfg, tiny_ldm), c, view(cfg, tiny_ldm, c.members.domain))
    assert found.auc >= 0.9, found.summary()
    assert (len(found.member_scores), len(found.non_member_scores)) == (6 * SHOTS, 6 * SHOTS)
    third = shapes.client_train_set(c.members.domain, SHOTS, 2, cfg.seed, cfg.data.image_size)
    third = type(c.members)(third.images, third.labels, third.classes, third.domain, "third")
    nothing = attack_upload(
        accepted(cfg, tiny_ldm, third), c, view(cfg, tiny_ldm, c.members.domain)
    )
    assert abs(nothing.auc - 0.5) < 4 * nothing.auc_stderr, nothing.summary()


def test_centrals_upload_is_the_images_so_every_member_is_found(tiny_ldm):
    cfg = method_config("central", **{"data.shots-per-class": SHOTS})
    c = candidates(cfg)
    found = attack_upload(accepted(cfg, tiny_ldm), c, view(cfg, tiny_ldm, c.members.domain))
    assert found.auc == 1.0 and found.tpr_at_max_fpr == 1.0


@pytest.mark.parametrize("method", ["fedbip-mixture", "fedld", "fedpft", "oscar", "local"])
def test_each_kind_scores_every_candidate_from_its_accepted_upload(method, tiny_ldm):
    cfg = method_config(method, **{"data.shots-per-class": SHOTS})
    c = candidates(cfg)
    found = attack_upload(accepted(cfg, tiny_ldm), c, view(cfg, tiny_ldm, c.members.domain))
    assert found.statistic == TESTS[method].statistic
    scores = torch.cat([found.member_scores, found.non_member_scores])
    assert len(scores) == 12 * SHOTS and bool(torch.isfinite(scores).all())
    assert 0 <= found.auc <= 1 and math.isfinite(found.auc_stderr)
