"""One hostile institution cannot stop or skew the federation (issue 45): an upload that passes
acceptance cannot fail later, a stored upload that no longer passes is recorded, not fatal,
and what synthesis would need of an upload is proved when it arrives.

Uploads are the real client code's on the tiny model, then changed as a lying client would
(:func:`tests.helpers.tampered`)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from fedbip_flwr import results, server_run, shapes
from fedbip_flwr.ldm import load_ldm
from fedbip_flwr.methods import create_for
from fedbip_flwr.mixture import MIXTURE_MEANS, MIXTURE_VARIANCES, MIXTURE_WEIGHTS
from fedbip_flwr.results import ClientOutcome, RunResults, Seconds
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import write_json
from fedbip_flwr.upload import PayloadError, encode_tensors
from fedbip_tools.cli import main
from tests.helpers import client_job, method_config, server_job, tampered

MIXTURES = ("fedld", "fedbip-mixture", "espresso")


def upload_of(method: str, ldm, **values):
    cfg = method_config(method, **values)
    blob, _ = create_for(cfg).upload(client_job(cfg, ldm))
    return cfg, blob


def refusal(cfg, blob: bytes, ldm) -> str:
    with pytest.raises(PayloadError) as info:
        create_for(cfg).accept(blob, server_job(cfg, ldm))
    return info.value.reason


@pytest.mark.parametrize("method", ["fedbip", "fedbip-mixture"])
def test_a_domain_concept_longer_than_the_text_encoder_takes_is_refused_at_acceptance(
    method, tiny_ldm
):
    """An institution names its own domain (no server domain list): a phrase of 240 tokens
    gives S 240 vectors, consistent with data.n-s, but no prompt of 16 tokens holds it."""
    cfg, blob = upload_of(method, tiny_ldm)

    def long_domain(tensors, meta):
        meta["fedbip.domain"] = json.dumps(" ".join(["sketch"] * 240))
        meta["fedbip.n_s"] = json.dumps(240)
        tensors["domain_concept"] = tensors["domain_concept"][:1].repeat(240, 1)

    own_folders = method_config(
        method,
        **{
            "data.dataset": "imagefolder",
            "data.classes": ",".join(cfg.data.class_list or shapes.CLASSES),
            "data.prompt-template": cfg.data.prompt_template,
            "data.n-s": cfg.data.n_s,
            "data.n-v": cfg.data.n_v,
        },
    )
    create_for(own_folders).accept(
        blob, server_job(own_folders, tiny_ldm)
    )  # the honest one is taken
    reason = refusal(own_folders, tampered(blob, method, cfg, long_domain), tiny_ldm)
    assert "the text encoder takes 16" in reason and "could not prompt" in reason


def _rows(keep: int):
    """A mixture upload holding only the first ``keep`` class rows (its counts untouched)."""

    def change(tensors, _meta):
        for name in (MIXTURE_WEIGHTS, MIXTURE_MEANS, MIXTURE_VARIANCES):
            tensors[name] = tensors[name][:keep].clone()

    return change


@pytest.mark.parametrize("method", MIXTURES)
def test_a_mixture_with_fewer_class_rows_than_the_servers_classes_is_refused(method, tiny_ldm):
    cfg, blob = upload_of(method, tiny_ldm)
    reason = refusal(cfg, tampered(blob, method, cfg, _rows(2)), tiny_ldm)
    assert "its header's 6 classes" in reason, reason  # the server's, checked before


def test_more_components_than_stated_are_refused(tiny_ldm):
    cfg, blob = upload_of("fedld", tiny_ldm)

    def more(tensors, _meta):
        for name in (MIXTURE_WEIGHTS, MIXTURE_MEANS, MIXTURE_VARIANCES):
            tensors[name] = tensors[name].repeat_interleave(16, dim=1)
        tensors[MIXTURE_WEIGHTS] = tensors[MIXTURE_WEIGHTS] / 16

    reason = refusal(cfg, tampered(blob, "fedld", cfg, more), tiny_ldm)
    assert "components need" in reason, reason


@pytest.mark.parametrize("method", ["fedld", "espresso"])
def test_classes_claimed_empty_are_checked_when_the_server_synthesizes_them(method, tiny_ldm):
    """With images-per-class > 0 the server draws every class, held or not: a class the upload
    says it holds no image of, with its means moved by +50, is refused; at images-per-class 0
    it is never drawn, so it costs nothing and is taken."""
    cfg, blob = upload_of(method, tiny_ldm, **{f"{method}.images-per-class": 2})

    def empty_and_shifted(tensors, _meta):
        counts = tensors["class_counts"].clone()
        counts[0], counts[1] = counts[0] + counts[1], 0
        tensors["class_counts"] = counts
        means = tensors[MIXTURE_MEANS].clone()
        means[1] += 50
        tensors[MIXTURE_MEANS] = means

    lie = tampered(blob, method, cfg, empty_and_shifted)
    assert "class 1, component 0" in refusal(cfg, lie, tiny_ldm)
    unused = method_config(method, **{f"{method}.images-per-class": 0})
    create_for(unused).accept(lie, server_job(unused, tiny_ldm))


# --- fedbip inspect, without a run config: what no client could have fitted (issue 91) ---------

# each mixture method's tensor names: weights, variances (FedPFT's spherical covariances)
MIXTURE_TENSORS = {
    **{method: (MIXTURE_WEIGHTS, MIXTURE_VARIANCES) for method in MIXTURES},
    "fedpft": ("gmm_weights", "gmm_covariances"),
}


@pytest.fixture(scope="module")
def honest_mixtures(tiny_model_dir) -> dict:
    """Each mixture method's upload by the real client code on the tiny model."""
    ldm = load_ldm(tiny_model_dir)
    return {
        method: upload_of(method, ldm, **{"ldm.model": str(tiny_model_dir)})
        for method in MIXTURE_TENSORS
    }


def _negative_variance_in(variances: str):
    def change(tensors, _meta):
        tensors[variances] = tensors[variances].clone()
        tensors[variances].view(-1)[0] = -1.0

    return change


def _weights_tripled_in(weights: str):
    def change(tensors, _meta):
        tensors[weights] = tensors[weights] * 3

    return change


@pytest.mark.parametrize("method", MIXTURE_TENSORS)
def test_inspect_alone_calls_a_mixture_no_client_could_fit_invalid(
    method, honest_mixtures, tmp_path, capsys
):
    """Negative variances and weights summing to 3 need no model to be refused: ``fedbip
    inspect`` without --run-config checks the mixture its header states."""
    cfg, blob = honest_mixtures[method]
    weights, variances = MIXTURE_TENSORS[method]
    path = tmp_path / "upload.safetensors"
    path.write_bytes(blob)
    assert main(["inspect", str(path)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    for change, reason in (
        (_negative_variance_in(variances), "variance"),
        (_weights_tripled_in(weights), "sum to 1 +- 2"),
    ):
        path.write_bytes(tampered(blob, method, cfg, change))
        assert main(["inspect", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("invalid payload: ") and reason in err, err


# --- after acceptance: a failure costs only its own client, now and after a restart ---------


def accepted_uploads(cfg, ldm, partitions=(0, 1)) -> dict:
    method, job = create_for(cfg), server_job(cfg, ldm)
    uploads = [method.accept(method.upload(client_job(cfg, ldm, p))[0], job) for p in partitions]
    return {upload.client_id: upload for upload in uploads}


def test_a_client_whose_synthesis_fails_after_acceptance_is_recorded_and_the_others_train(
    tiny_ldm, tmp_path
):
    """A check acceptance lacks (here: an upload whose decoded mixture is gone) makes synthesis
    raise for that client only: it is recorded as failed with the error, the training set is
    made from the others, and clients.json says so."""
    cfg = method_config("fedld", **{"federation.min-clients": 1})
    uploads = accepted_uploads(cfg, tiny_ldm)
    broken, honest = sorted(uploads)
    uploads[broken] = dataclasses.replace(uploads[broken], content=None)
    folder = RunFolder(tmp_path / "run")
    folder.root.mkdir()
    clients = [
        ClientOutcome(node_id=n, status="accepted", client_id=c)
        for n, c in enumerate(sorted(uploads))
    ]
    stopped = RunResults(status="failed", config=cfg.to_flat(), clients=clients)
    training_set, kept, outcomes = server_run._training_set(
        create_for(cfg), server_job(cfg, tiny_ldm), uploads, folder, Seconds(), stopped
    )
    assert set(training_set) == set(kept) == {honest}
    status = {o.client_id: (o.status, o.reason) for o in outcomes}
    assert status[honest] == ("accepted", "")
    assert (
        status[broken][0] == "failed"
        and "synthesis from its accepted upload failed" in status[broken][1]
    )
    assert results.read_clients(folder.clients) == outcomes


def test_a_restart_records_a_stored_upload_that_no_longer_passes_and_goes_on(tiny_ldm, tmp_path):
    """An upload stored before the server's checks grew stricter (its mixture lacks class
    rows) fails its re-check on restart: recorded as rejected, the run resumes with the rest."""
    cfg = method_config("fedld", **{"federation.min-clients": 1})
    uploads = accepted_uploads(cfg, tiny_ldm)
    stale, honest = sorted(uploads)
    folder = RunFolder(tmp_path / "run")
    folder.payloads.mkdir(parents=True)
    for client_id, upload in uploads.items():
        blob = encode_tensors(
            upload.tensors,
            {f"fedbip.{k}": json.dumps(v) for k, v in upload.meta.model_dump().items()},
        )
        if client_id == stale:
            blob = tampered(blob, "fedld", cfg, _rows(2))
        folder.payload_path(client_id).write_bytes(blob)
    write_json(folder.uploaders, {"7": stale, "8": honest})
    results.write_clients(
        [
            ClientOutcome(node_id=n, status="accepted", client_id=c)
            for n, c in ((7, stale), (8, honest))
        ],
        folder.clients,
    )
    _, kept, outcomes = server_run._round(
        create_for(cfg), None, server_job(cfg, tiny_ldm), folder, Seconds()
    )
    assert set(kept) == {honest}
    status = {o.client_id: (o.node_id, o.status, o.reason) for o in outcomes}
    assert status[honest][:2] == (8, "accepted")
    assert status[stale][:2] == (7, "rejected") and "no longer passes" in status[stale][2]
    assert results.read_clients(folder.clients) == outcomes


# --- text from uploads reaches people escaped ------------------------------------------------

HOSTILE_DOMAIN = (
    "sketch\x1b[2J\x1b[31m | forged | row |\n| x ![p](http://example.invalid/p.png) <img src=x>"
)


def test_an_uploads_strings_reach_report_md_escaped(tmp_path):
    """A domain name with terminal escape codes, cell separators, a newline and an image link
    is shown as text: one row, no escape byte, no link or HTML Markdown would act on."""
    from fedbip_flwr.report import write_report
    from tests.helpers import completed_metrics, reported_client, run_folder

    metrics = completed_metrics()
    metrics["clients"].append(reported_client("hostile-0", HOSTILE_DOMAIN))
    report = write_report(run_folder(tmp_path / "run", metrics, [])).read_text()
    row = next(line for line in report.splitlines() if line.startswith("| hostile-0"))
    assert "\x1b" not in report and "\\x1b" in row
    assert not re.search(r"(?<!\\)!\[p|(?<!\\)<img", report), "a link or HTML left unescaped"
    assert len(re.findall(r"(?<!\\)\|", row)) == 8, "seven cells: the domain forged none"


def test_refusal_reasons_carry_no_control_characters():
    err = PayloadError(f"domain {HOSTILE_DOMAIN!s} is not one of the server's")
    assert "\x1b" not in err.reason and "\n" not in err.reason and "\\x1b[2J" in err.reason


# --- DP headers: verified for every DP method ----------------------------------------------


INFINITE = "infinite"  # written as 1e400


def _header(change):
    """A lie about the upload's DP header: ``change`` edits its JSON object (None: drop it)."""

    def edit(_tensors, meta):
        dp = json.loads(meta.pop("fedbip.dp"))
        if change(dp) is not False:  # 1e400 is valid JSON and reads as infinity
            meta["fedbip.dp"] = json.dumps(dp).replace(f'"{INFINITE}"', "1e400")

    return edit


def _fitted(tensors, _meta):
    """The DP release's tensors replaced by a fitted-looking mixture: two components, half each."""
    weights = tensors[MIXTURE_WEIGHTS].clone()
    weights[:, :2] = 0.5
    tensors[MIXTURE_WEIGHTS] = weights


FEDLD_DP_LIES = {
    "no header": (
        _header(lambda dp: False),
        r"the run asks for \(4, 1e-05\)-DP uploads .* states no guarantee",
    ),
    "epsilon 1e-9": (
        _header(lambda dp: dp.update(epsilon=1e-9)),
        "claims epsilon 1e-09, but its noise multiplier",
    ),
    "epsilon infinite": (_header(lambda dp: dp.update(epsilon=INFINITE)), "finite number"),
    "noise multiplier infinite": (
        _header(lambda dp: dp.update(noise_multiplier=INFINITE)),
        "finite number",
    ),
    "noise multiplier tiny": (
        _header(lambda dp: dp.update(noise_multiplier=1e-9)),
        "greater than or equal to 0.05",
    ),
    "another clip": (_header(lambda dp: dp.update(clip=dp["clip"] * 10)), "DP clip"),
    "fitted tensors": (_fitted, "not a DP release's"),
}


@pytest.fixture(scope="module")
def fedld_dp(tiny_model_dir):
    from fedbip_flwr.ldm import load_ldm

    ldm = load_ldm(tiny_model_dir)
    cfg, blob = upload_of("fedld", ldm, **{"fedld.dp-epsilon": 4.0})
    return cfg, blob, ldm


@pytest.mark.parametrize("lie", sorted(FEDLD_DP_LIES))
def test_fedld_checks_the_dp_header_it_is_sent(lie, fedld_dp):
    cfg, blob, ldm = fedld_dp
    create_for(cfg).accept(blob, server_job(cfg, ldm))  # the honest one is taken
    change, message = FEDLD_DP_LIES[lie]
    assert re.search(message, refusal(cfg, tampered(blob, "fedld", cfg, change), ldm))


def test_fedbip_mixture_refuses_a_consistent_header_on_tensors_without_the_dp_structure(tiny_ldm):
    cfg, blob = upload_of("fedbip-mixture", tiny_ldm, **{"fedbip-mixture.dp-epsilon": 4.0})
    create_for(cfg).accept(blob, server_job(cfg, tiny_ldm))
    assert "not a DP release's" in refusal(
        cfg, tampered(blob, "fedbip-mixture", cfg, _fitted), tiny_ldm
    )
    infinite = _header(lambda dp: dp["concepts"].update(noise_multiplier=INFINITE))
    assert "finite number" in refusal(
        cfg, tampered(blob, "fedbip-mixture", cfg, infinite), tiny_ldm
    )


# --- fedbip inspect gives the server's verdict -----------------------------------------------


def _times_50(tensors, _meta):
    tensors["latents"] = tensors["latents"] * 50


@pytest.mark.parametrize(("method", "lie", "reason"), [("fedbip", _times_50, "latents")])
def test_fedbip_inspect_with_the_run_config_refuses_what_the_server_refuses(
    method, lie, reason, tiny_model_dir, tiny_ldm, tmp_path, capsys
):
    import tomli_w

    from fedbip_tools.cli import main

    cfg, blob = upload_of(method, tiny_ldm, **{"ldm.model": str(tiny_model_dir)})
    run_config = tmp_path / "run.toml"
    run_config.write_text(tomli_w.dumps(cfg.to_flat()))
    honest, hostile = tmp_path / "honest.safetensors", tmp_path / "hostile.safetensors"
    honest.write_bytes(blob)
    hostile.write_bytes(tampered(blob, method, cfg, lie))
    assert main(["inspect", str(honest), "--run-config", str(run_config)]) == 0
    assert "verdict: the run's server" in capsys.readouterr().out
    assert main(["inspect", str(hostile)]) == 0, "its structure alone is valid"
    assert "not checked against a run's base model" in capsys.readouterr().out
    assert main(["inspect", str(hostile), "--run-config", str(run_config)]) == 1
    out = capsys.readouterr()
    assert (
        "verdict: the run's server refuses it" in out.out + out.err and reason in out.out + out.err
    )


# --- analytic plausibility: nothing a predictable draw can miss ------------------------------


def _component(change):
    """The upload's mixture with class 0's first component changed by ``change(weights, means,
    variances)`` (in place, on copies)."""

    def edit(tensors, _meta):
        parts = [
            tensors[name].clone() for name in (MIXTURE_WEIGHTS, MIXTURE_MEANS, MIXTURE_VARIANCES)
        ]
        change(*parts)
        tensors[MIXTURE_WEIGHTS], tensors[MIXTURE_MEANS], tensors[MIXTURE_VARIANCES] = parts

    return edit


def _rare_x50(w, m, v):
    """A x50 component at weight 0.012: 64 draws per class rarely (and predictably) meet it."""
    w[0, 1], w[0, 0] = 0.012, w[0, 0] - 0.012
    m[0, 1], v[0, 1] = m[0, 0] * 50, v[0, 0]


MIXTURE_LIES = {
    "a x50 component at weight 0.012": (_rare_x50, "mean^2 + variance above"),
    "variance 1e-30": (lambda w, m, v: v[0, 0].fill_(1e-30), "variance below the fit's floor"),
    "15-sigma spikes on a few coordinates": (
        lambda w, m, v: m[0, 0, :3].fill_(15.0),
        "on one coordinate",
    ),
}


@pytest.mark.parametrize("lie", sorted(MIXTURE_LIES))
def test_mixture_components_are_held_to_analytic_bounds(lie, tiny_ldm):
    cfg, blob = upload_of("fedld", tiny_ldm)
    change, message = MIXTURE_LIES[lie]
    assert message in refusal(cfg, tampered(blob, "fedld", cfg, _component(change)), tiny_ldm)


def test_a_z_t_with_a_spike_on_a_few_coordinates_is_refused(tiny_ldm):
    """Per-image mean and std barely move when 3 of 1,024 coordinates are 15: the per-coordinate
    bound (about 12.4 at the tiny model's T) refuses it."""
    cfg, blob = upload_of("fedbip", tiny_ldm)

    def spike(tensors, _meta):
        latents = tensors["latents"].clone()
        latents[0].view(-1)[:3] = 15.0
        tensors["latents"] = latents

    assert "(one coordinate)" in refusal(cfg, tampered(blob, "fedbip", cfg, spike), tiny_ldm)


# --- claims bounded by what the server does for them -----------------------------------------


def _claim_in_class_0(count: int):
    def inflate(tensors, meta):
        counts = tensors["class_counts"].clone()
        counts[0] = count
        tensors["class_counts"] = counts
        meta["fedbip.num_examples"] = json.dumps(int(counts.sum()))

    return inflate


def _synthesized_labels(method, job, upload, folder) -> list[int]:
    folder.mkdir()
    shards = method.train_set(
        {upload.client_id: upload}, job, lambda c, i: folder / f"{c}-{i}.safetensors"
    )
    labels = torch.cat([load_file(path)["labels"] for path in shards[upload.client_id]])
    return torch.bincount(labels.long(), minlength=len(job.class_names)).tolist()


@pytest.mark.parametrize("method", ["prompts-only", "fedld"])
def test_an_inflated_class_count_buys_no_more_synthetic_images(method, tiny_ldm, tmp_path):
    """A claim of 500 images of one class (within federation.max-images-per-client, so taken)
    makes the server synthesize that class only up to run config federation.max-images-per-class
    (here the run's 2 shots): the liar's set is the honest one's, image count for image count."""
    cfg, blob = upload_of(method, tiny_ldm)
    assert cfg.class_cap == cfg.data.shots_per_class == 2
    own, job = create_for(cfg), server_job(cfg, tiny_ldm)
    honest = own.accept(blob, job)
    inflated = own.accept(tampered(blob, method, cfg, _claim_in_class_0(500)), job)
    assert int(inflated.tensors["class_counts"][0]) == 500
    assert _synthesized_labels(own, job, inflated, tmp_path / "inflated") == _synthesized_labels(
        own, job, honest, tmp_path / "honest"
    )


def test_fedbip_refuses_more_z_t_of_a_class_than_the_server_credits(tiny_ldm):
    """z(T) rows are the images FedBiP synthesizes from: one more row of a class than
    federation.max-images-per-class x latents-per-image is refused."""
    cfg, blob = upload_of("fedbip", tiny_ldm)

    def one_more_row(tensors, meta):
        first = int((tensors["labels"] == 0).nonzero()[0])
        for name in ("latents", "labels"):
            tensors[name] = torch.cat([tensors[name], tensors[name][first : first + 1]])
        meta["fedbip.num_examples"] = json.dumps(len(tensors["labels"]))

    reason = refusal(cfg, tampered(blob, "fedbip", cfg, one_more_row), tiny_ldm)
    assert "z(T) of class" in reason and "federation.max-images-per-class 2" in reason


def test_espressos_reach_does_not_grow_with_a_claimed_count(tiny_ldm):
    """Conditions moved by 500 everywhere under a claim of 99,000 images of one class: the
    reach counts the steps of the images the server credits (6 classes x 2 shots), so they
    are refused as from an honest count."""
    cfg, blob = upload_of("espresso", tiny_ldm)

    def moved_with_a_large_claim(tensors, meta):
        _claim_in_class_0(99_000)(tensors, meta)
        tensors["conditions"] = tensors["conditions"] + 500.0

    assert "beyond the" in refusal(
        cfg, tampered(blob, "espresso", cfg, moved_with_a_large_claim), tiny_ldm
    )
