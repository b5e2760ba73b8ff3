"""The methods page: its generated section (:func:`markdown`), one picture per client domain with
a row per method (:func:`pictures`), and :func:`report`, which summarizes every cached seed into
``benchmarks/methods.json``, that section of docs/benchmarks/methods.md and the pictures."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fedbip_flwr.classifier import ShardImages
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.storage import write_json
from fedbip_flwr.viz import image_grid

from .. import provenance
from ..upload_attacks import REFERENCE_PER_CLASS
from .attack_records import (
    ATTACK_RECORDS,
    CONDITIONING_LARGE_MODEL,
    CONDITIONING_RECORDS,
    LARGE_SIZE,
    SERVER_ATTACK_LARGE,
    SERVER_ATTACK_STAND_IN,
    stand_in_attacks,
)
from .measurements import client_sets
from .runner import cached_seeds, judges_record, run_folder
from .settings import Bench, Sampling, base_values, sampling
from .summary import Difference, differences, summarize
from .tables import (
    NOT_DISTINGUISHABLE,
    accuracy_heading,
    accuracy_table,
    conditioning_table,
    differences_table,
    fidelity_table,
    privacy_table,
    server_attack_table,
)
from .variants import ABLATION, NAMES_VERSION, NO_DATA_CONTROL, VARIANTS

log = logging.getLogger(__name__)


MARKER = "methods"
PICTURE_COLUMNS = 10


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
    judged: Mapping[str, Mapping[str, float]],
    found: Sequence[Difference],
    sampled: Sampling,
) -> str:
    s = bench.settings
    cfg = s.run_config
    order = [v.name for v in VARIANTS]
    return f"""## Every method side by side on the miniature world

Each row: `fedbip benchmark --seeds SEEDS --variants ROW` with the row's seeds (the seeds
column below; several rows comma-separated), one `flwr run` per method and seed on Flower's
simulation engine, three SuperNodes; `OMP_NUM_THREADS={bench.threads}`. Clients: {", ".join(s.domains)} (one each,
{cfg["data.shots-per-class"]} images per class, 6 classes, chance 16.7%); test sets
{cfg["data.test-per-class"]} images per class per domain, held by the server. Every global classifier
is ResNet-18 ({cfg["classifier.init"]} init) trained for exactly {s.classifier_steps} SGD steps
(batch 64); Local's per-client classifiers and FedLMG's guiding classifiers get as many; FedAvg
runs as many rounds of {s.fedavg_local_epochs} local epochs as make {s.classifier_steps} steps
summed over clients. Sampling: {cfg["synthesis.num-inference-steps"]} steps, guidance
{cfg["synthesis.guidance-scale"]} for every method that samples (OSCAR's s = guidance - 1); concepts:
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
image). Members: the client's {cfg["data.shots-per-class"] * 6} private images; non-members: as many
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
A record counts only for rows of the model it was made with (its world's images are the
members). Records: {", ".join(f"`{r}`" for r in ATTACK_RECORDS)}. A dash: at 4x64x64 not a latent upload
(images, a classifier, FedAvg's replies, features and caption states: no latent size to scale),
or no record. Each row takes its latent upload's test; the learned conditioning beside it,
FedBiP's concepts and Espresso's conditions, is tested apart by the loss-ratio test (the table
after this one), the DP mixture mode's concepts too (DP-SGD under the rest of the upload's
epsilon).

{server_attack_table(summary, sorted(s.domains))}
The loss-ratio test on the conditioning uploaded beside the latents (`scripts/server_attacks.py
--kinds concepts espresso-conditions`, commands in docs/benchmarks/privacy.md): AUC
(± sample std over seeds) / mean TPR at 1% FPR (the seeds). {cfg["data.shots-per-class"]} shots,
{cfg["fedbip.concept-epochs"]} epochs: the run's budget, 3 clients a domain, 288 members a side;
4 shots, 200 epochs: the test's positive control, overfitted, one client, 24 a side. At 4x64x64
the control fails on the previous model's UNet, trained at 4x16x16, so the figures there are on a UNet
continued at {LARGE_SIZE} px (`{CONDITIONING_LARGE_MODEL}`), where the conditions' control
passes on every domain and the concepts' on painting only: it fails on quickdraw and is weak on
sketch (within 1.5 standard errors, about 0.08 at 24 a side, of chance), so the concepts'
default-budget figures there bound little. The models column names the LDMs the records ran
(at 4x64x64 the UNet continued at {LARGE_SIZE} px): where it is not this table's model, the
figures are that world's, not remade on this one. A dash: not measured. Records: {", ".join(f"`{r}`" for r in CONDITIONING_RECORDS)}.

{conditioning_table(bench, sorted(s.domains))}
Pictures: `benchmarks/pictures/methods-<domain>.png`, one row per method (first seed).

### Published figures (other data: not comparable cell by cell)

The papers' numbers come from Stable Diffusion on DomainNet; FedLMG and OSCAR use 90 classes,
FedBiP 10. What carries over is the ordering, not the values.

{PUBLISHED}"""


def pictures(bench: Bench, seed: int, names: Sequence[str]) -> list[Path]:
    """Per client domain: its real images, then a row per method that made a training set."""
    out = []
    cfg = FedBiPConfig.from_flat({**base_values(bench, seed), "method": "fedbip"})
    clients = client_sets(cfg.data_description)
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
    """Replace the section ``marker`` of the page ``path``, leaving the rest of it alone."""
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
    run_size = FedBiPConfig.from_flat(base_values(bench, 0)).data.image_size
    models = {name: e["made_with"]["models"][0] for name, e in summary.items()}
    for key, size in ((SERVER_ATTACK_STAND_IN, run_size), (SERVER_ATTACK_LARGE, LARGE_SIZE)):
        for name, attacked in stand_in_attacks(bench, sampled.timestep, size, models).items():
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
    write_section(benchmarks_md, markdown(summary, bench, judged, found, sampled))
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


def judges_text(judged: Mapping[str, Mapping[str, float]]) -> str:
    """``98.8% (class) and 99.8% (domain) on the AVX512+bf16 kind; ...``."""
    return "; ".join(
        f"{100 * on_real['class']:.1f}% (class) and {100 * on_real['domain']:.1f}% (domain) "
        f"on the {kind} kind"
        for kind, on_real in sorted(judged.items())
    )
