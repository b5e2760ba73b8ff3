"""judge_run: a finished run's synthetic shards judged per domain, for report.md's fidelity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedbip_flwr import shapes
from fedbip_flwr.classifier import ShardImages, build_classifier
from fedbip_flwr.results import ClientOutcome, write_clients
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import read_tensors, write_tensors
from fedbip_tools import cli
from fedbip_tools.judges import Judges, judge_run, load_judges
from tests.helpers import completed_metrics

SIZE = 16


def shard(path: Path, n: int, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, SIZE, SIZE), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, len(shapes.CLASSES), (n,), generator=generator)
    return write_tensors(path, {"images": images, "labels": labels})


def judges() -> Judges:
    torch.manual_seed(0)
    classes = build_classifier(len(shapes.CLASSES), "random").eval()
    domains = build_classifier(len(shapes.DOMAINS), "random").eval()
    return Judges(classes, domains, SIZE)


def run(tmp_path: Path, domains: dict[str, str]) -> RunFolder:
    folder = RunFolder(tmp_path / "run")
    folder.shards.mkdir(parents=True)
    made = {
        client: [
            shard(folder.shards / f"{client}-{k}.safetensors", 3 + k, i * 10 + k) for k in (0, 1)
        ]
        for i, client in enumerate(domains)
    }
    folder.write_training_set(made)
    outcomes = [
        ClientOutcome(node_id=i, status="accepted", client_id=client, domain=domain)
        for i, (client, domain) in enumerate(domains.items())
    ]
    write_clients(outcomes, folder.clients)
    return folder


def test_every_domains_images_are_judged_together_under_its_clients_domain(tmp_path):
    folder = run(tmp_path, {"sketch-0": "sketch", "sketch-1": "sketch", "quickdraw-0": "quickdraw"})
    judged, path = judges(), tmp_path / "judges.safetensors"
    fidelity = judge_run(folder, judged, path)
    assert fidelity.judges == str(path)
    assert {d: j.images for d, j in fidelity.per_domain.items()} == {"quickdraw": 7, "sketch": 14}
    shards = folder.training_shards()
    sketch = ShardImages([*shards["sketch-0"], *shards["sketch-1"]], SIZE)
    images, labels = sketch[torch.arange(len(sketch))]
    direct = judged.fidelity(images, labels, "sketch")
    assert fidelity.per_domain["sketch"].class_fidelity == direct["class"]
    assert fidelity.per_domain["sketch"].domain_fidelity == direct["domain"]


def test_a_domain_the_judges_never_saw_is_refused_by_name(tmp_path):
    folder = run(tmp_path, {"lab-a": "dermatoscopic image"})
    with pytest.raises(ValueError, match="'dermatoscopic image' is none of the shapes world's"):
        judge_run(folder, judges(), tmp_path / "judges.safetensors")


def test_fedbip_report_with_judges_puts_fidelity_beside_the_accuracy(tmp_path, capsys):
    """The command a user runs: judges loaded from PATH, fidelity.json written, report.md
    showing it (domains without shards: not judged)."""
    folder = run(tmp_path, {"sketch-0": "sketch"})
    folder.metrics.write_text(json.dumps(completed_metrics()))
    path, saved = tmp_path / "judges.safetensors", judges()
    models = {"classes": saved.classes, "domains": saved.domains}
    write_tensors(
        path, {f"{k}.{n}": t for k, m in models.items() for n, t in m.state_dict().items()}
    )
    assert cli.main(["report", str(folder.root), "--judges", str(path)]) == 0
    assert f"wrote {folder.root / 'fidelity.json'}" in capsys.readouterr().out
    report = (folder.root / "report.md").read_text()
    assert "| class fidelity | domain fidelity |" in report.replace("  ", " ")
    assert report.count("not judged") == 2  # quickdraw and painting: no shards in this run


def test_judges_batchnorm_statistics_are_re_estimated_whatever_the_file_holds(tmp_path):
    """The running statistics training leaves depend on the machine's float32 (89.3% against
    97.5% re-estimated, BENCHMARKS.md): loaded judges get theirs re-estimated over the judges'
    training images, so a file's own statistics, even absurd ones, change nothing."""
    path = tmp_path / "judges.safetensors"
    trained = load_judges(path, size=SIZE, per_class=2, epochs=1)  # trains, saves, re-estimates
    saved = read_tensors(path)
    stats = [k for k in saved if k.endswith(("running_mean", "running_var"))]
    assert stats and any(
        not torch.equal(saved[k], trained.classes.state_dict()[k.removeprefix("classes.")])
        for k in stats
        if k.startswith("classes.")
    ), "the statistics training left were re-estimated"
    write_tensors(
        path, {k: torch.full_like(v, 50.0) if k in stats else v for k, v in saved.items()}
    )
    loaded = load_judges(path, size=SIZE, per_class=2, epochs=1)
    for judge in ("classes", "domains"):
        expected = getattr(trained, judge).state_dict()
        for name, value in getattr(loaded, judge).state_dict().items():
            torch.testing.assert_close(value, expected[name], msg=f"{judge}.{name}")
