"""FedBiP's J class concepts per class (run config fedbip.class-clusters): one V per sub-cluster
of a class's images, each z(T) denoised with its own image's sub-cluster's concept; alone and with
the mixture mode."""

from __future__ import annotations

import pytest
import torch

from fedbip_flwr.concepts import initial_concepts, prompt_layout
from fedbip_flwr.methods import audit_upload, create_for
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import read_tensors
from fedbip_flwr.upload import PayloadError
from tests.helpers import client_job, method_config, own, server_job, tampered

J = 3


def upload_of(method: str, ldm, **values):
    cfg = method_config(method, **{"fedbip.class-clusters": J, "data.shots-per-class": 4, **values})
    job = client_job(cfg, ldm)
    blob, _ = create_for(cfg).upload(job)
    return cfg, job, blob


def test_one_concept_per_sub_cluster_and_each_z_t_tagged_with_its_images(tiny_ldm):
    cfg, job, blob = upload_of("fedbip", tiny_ldm, **{"fedbip.latents-per-image": 2})
    upload = create_for(cfg).accept(blob, server_job(cfg, tiny_ldm))
    payload, classes = upload.content, len(job.data.classes)
    assert payload.meta.class_clusters == J and payload.class_concepts.shape[0] == classes * J
    rows = torch.bincount(payload.concept_rows, minlength=classes * J).view(classes, J)
    # the rows are uploaded in a random order; the 2 z(T) of an image share its sub-cluster
    assert (rows % 2 == 0).all(), "a sub-cluster holds whole images, 2 rows each"
    sizes = rows // 2
    assert (sizes > 0).all(), "4 images per class fill all 3 sub-clusters"
    assert torch.equal(sizes.sum(1), torch.bincount(job.data.labels, minlength=classes))
    # every row was learned: it moved from the class name it started from
    names = [name for name in job.data.classes for _ in range(J)]
    layout = prompt_layout(
        tiny_ldm.tokenizer,
        cfg.data.prompt_template,
        cfg.data.n_s,
        cfg.data.n_v,
        job.data.domain,
        names,
    )
    _, v0 = initial_concepts(tiny_ldm, layout, own(cfg).concept_space)
    assert ((payload.class_concepts - v0).flatten(1).abs().amax(1) > 0).all()
    assert "latent_clusters" in audit_upload(blob, 2**30).tensors


def test_each_z_t_is_denoised_with_its_sub_clusters_concept(tiny_ldm, tmp_path):
    """Moving z(T) to another sub-cluster changes their images and no other."""
    cfg, _, blob = upload_of("fedbip", tiny_ldm)
    server = server_job(cfg, tiny_ldm)
    images = {}
    for name, data in (
        ("as sent", blob),
        ("moved", tampered(blob, "fedbip", cfg, _move_first_two)),
    ):
        upload = create_for(cfg).accept(data, server)
        (path, *_) = create_for(cfg).train_set(
            {upload.client_id: upload}, server, RunFolder(tmp_path / name).shard_path
        )[upload.client_id]
        images[name] = read_tensors(path)["images"]
    same = (images["as sent"] == images["moved"]).flatten(1).all(1)
    assert not same[:2].any() and same[2:].all()


def _move_first_two(tensors, _meta):
    tensors["latent_clusters"] = tensors["latent_clusters"].clone()
    tensors["latent_clusters"][:2] = (tensors["latent_clusters"][:2] + 1) % J


def test_the_server_refuses_another_cluster_count_and_out_of_range_sub_clusters(tiny_ldm):
    cfg, _, blob = upload_of("fedbip", tiny_ldm)
    one = method_config("fedbip", **{"data.shots-per-class": 4})
    with pytest.raises(PayloadError, match="class_clusters 3 does not match the server's 1"):
        create_for(one).accept(blob, server_job(one, tiny_ldm))

    def beyond(tensors, _meta):
        tensors["latent_clusters"] = tensors["latent_clusters"] + J

    with pytest.raises(PayloadError, match=r"latent_clusters must lie in \[0, 3\)"):
        create_for(cfg).accept(tampered(blob, "fedbip", cfg, beyond), server_job(cfg, tiny_ldm))

    def dropped(tensors, _meta):
        del tensors["latent_clusters"]

    with pytest.raises(PayloadError, match="missing tensor"):
        create_for(cfg).accept(tampered(blob, "fedbip", cfg, dropped), server_job(cfg, tiny_ldm))


def test_the_mixture_mode_draws_among_the_learned_sub_cluster_concepts(tiny_ldm, tmp_path):
    cfg, job, blob = upload_of("fedbip-mixture", tiny_ldm)
    server = server_job(cfg, tiny_ldm)
    upload = create_for(cfg).accept(blob, server)
    assert upload.content.concepts.classes.shape[0] == len(job.data.classes) * J
    assert "latent_clusters" not in upload.tensors, "no per-image tensor leaves the client"
    shards = create_for(cfg).train_set(
        {upload.client_id: upload}, server, RunFolder(tmp_path).shard_path
    )
    labels = torch.cat([read_tensors(p)["labels"] for p in shards[upload.client_id]])
    assert torch.equal(
        torch.bincount(labels),
        torch.bincount(job.data.labels) * own(cfg).latents_per_image * own(cfg).multiplier,
    )
    other = method_config("fedbip-mixture", **{"data.shots-per-class": 4})
    with pytest.raises(PayloadError, match="class_clusters 3 does not match the server's 1"):
        create_for(other).accept(blob, server_job(other, tiny_ldm))
