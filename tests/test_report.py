"""report.md: built from a hand-made run folder, it names every client and domain and links
only PNGs that exist; older or failed runs (keys missing) still get an honest report."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from PIL import Image

from fedbip_flwr.report import CLASSIFIER_PNG, write_report
from fedbip_flwr.results import FIDELITY_FILE, Fidelity, JudgedImages, ResultsError
from fedbip_tools.judges import write_fidelity
from tests.helpers import ACCEPTED, completed_metrics, reported_client, run_folder


def linked_images(report: str) -> list[str]:
    return [unquote(target) for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)]


def test_report_names_every_client_and_domain_and_links_existing_pngs(tmp_path: Path) -> None:
    folder = run_folder(tmp_path / "run-7", completed_metrics(), grids=list(ACCEPTED))
    report = write_report(folder).read_text()

    assert report.startswith("# FedBiP run `run-7`")
    assert "**Status: completed.** Mean accuracy 69.8% over 3 domain(s)" in report
    for client_id, domain in ACCEPTED.items():
        row = rf"\| {re.escape(client_id)} +\| {domain} +\| accepted +\| +96 +\| +412\.3 kB"
        assert re.search(row, report)
        assert f"### {client_id} ({domain})" in report
    failed = r"\| node 7 +\| +\| failed .*\| ClientApp raised \\\| out of memory +\|"
    assert re.search(failed, report)
    assert "| sketch    |     69.3% |" in report
    assert "| **mean**  | **69.8%** |" in report
    assert "| synthesis  |     2 min 55 s |" in report
    phases = re.findall(r"^\| (load_model|round|synthesis|classifier) ", report, re.MULTILINE)
    assert phases == ["load_model", "round", "synthesis", "classifier"]  # run order, not sorted
    assert '(run config `federation.evaluation = "both"`)' in report
    assert re.search(r"\| quickdraw 1 +\| +50\.0% +\| +100 \| ok", report)
    assert re.search(
        r"\| painting-0 +\| +n/a +\| +\| failed +\| no reply before the timeout", report
    )
    assert "Mean over the institutions, each weighing one: **65.0%**." in report

    linked = linked_images(report)
    expected = {f"grid-{c}.png" for c in ACCEPTED} | {f"concept-loss-{c}.png" for c in ACCEPTED}
    assert set(linked) == expected | {CLASSIFIER_PNG}
    for name in linked:
        with Image.open(folder / name) as image:
            assert image.format == "PNG"
    assert "grid-quickdraw%201.png" in report  # a client id with a space still links


def test_report_of_a_failed_run_has_status_reason_and_no_dangling_links(tmp_path: Path) -> None:
    metrics = {
        "status": "failed",
        "reason": "only 1 valid payload(s); federation.min-clients is 2",
        "clients": [reported_client("sketch-0", "sketch"), {"node_id": 9, "status": "missing"}],
        "config": {},
    }
    folder = run_folder(tmp_path / "run-8", metrics, grids=[])
    report = write_report(folder).read_text()

    assert "**Status: failed.** only 1 valid payload(s); federation.min-clients is 2" in report
    assert "sketch-0" in report and "node 9" in report
    for absent in ("## Accuracy", "## Time per phase", "## Concept learning", "## Classifier"):
        assert absent not in report
    assert linked_images(report) == []
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.json", "report.md"]


def test_rebuilding_gives_the_same_report(tmp_path: Path) -> None:
    folder = run_folder(tmp_path / "run-9", completed_metrics(), grids=["sketch-0"])
    first = write_report(folder).read_text()
    assert write_report(folder).read_text() == first


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (None, FileNotFoundError),
        ("[1, 2]", ValueError),
        ("{not json", ValueError),
        ('{"status": "completed", "config": {}, "started-unix": 1.0}', ValueError),
        ('{"status": "completed", "config": {}, "seconds": {"round": "soon"}}', ValueError),
    ],
    ids=["missing", "json list", "not json", "unknown key", "wrong type"],
)
def test_unreadable_metrics_raise_naming_the_file(
    tmp_path: Path, content: str | None, error: type
) -> None:
    if content is not None:
        (tmp_path / "metrics.json").write_text(content)
    with pytest.raises(error, match=re.escape(str(tmp_path / "metrics.json"))):
        write_report(tmp_path)
    assert not (tmp_path / "report.md").exists()


def test_judged_fidelity_sits_beside_each_domains_accuracy(tmp_path: Path) -> None:
    """A judged run (fidelity.json) shows class and domain fidelity in the accuracy table; a
    domain the judges did not see says so; an unjudged run's table is as before."""
    folder = run_folder(tmp_path / "run", completed_metrics(), grids=[])
    plain = write_report(folder).read_text()
    assert "fidelity" not in plain
    judged = {
        "sketch": JudgedImages(class_fidelity=0.91, domain_fidelity=0.45, images=96),
        "quickdraw": JudgedImages(class_fidelity=0.9, domain_fidelity=0.07, images=96),
    }
    write_fidelity(Fidelity(judges="judges.safetensors", per_domain=judged), folder)
    report = write_report(folder).read_text()
    assert re.search(r"\| domain +\| +accuracy \| +class fidelity \| +domain fidelity \|", report)
    assert re.search(r"\| quickdraw +\| +[\d.]+% +\| +90\.0% +\| +7\.0% +\|", report)
    assert re.search(r"\| sketch +\| +69\.3% +\| +91\.0% +\| +45\.0% +\|", report)
    assert re.search(r"\| painting +\| +[\d.]+% +\| +not judged +\| +\|", report)
    assert f"]({FIDELITY_FILE})" in report
    (folder / FIDELITY_FILE).write_text('{"judges": "x", "per_domain": {"sketch": {"images": 1}}}')
    with pytest.raises(ResultsError, match=FIDELITY_FILE):
        write_report(folder)
