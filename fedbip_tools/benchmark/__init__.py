"""The methods benchmark: every method side by side, each run through the real ``flwr run``.

Issues 18 and 20. For every seed and every variant (a method of the registry plus run-config
values), one simulation of the same three clients (sketch, quickdraw, painting of the shapes
world, one client each) runs on Flower with the same seed, client data, test sets and classifier
recipe; every classifier gets the same number of SGD steps (``classifier.steps``; Local's
per-client classifiers and FedAvg's rounds are sized to the same budget). Every invocation
summarizes all cached seeds into ``benchmarks/methods.json`` and a section of
docs/benchmarks/methods.md, and draws one picture per client domain with a row per method. A row
is averaged only over seeds of one machine kind unless asked otherwise, and every comparison the
docs draw is the paired per-seed difference with its 95% interval.

    fedbip benchmark --seeds 0 1 2

By role, one module each:

- :mod:`.variants`: the rows (:data:`VARIANTS`), their budget rules, the headline rows, the
  comparisons and the old names; the one file to edit to add a row.
- :mod:`.settings`: what a cached row depends on (:class:`Settings`), the folders
  (:class:`Bench`), the run config shared by a seed's rows, the pinned sampler.
- :mod:`.runner`: one ``flwr run`` per variant and seed, cached per seed (:func:`run_seed`).
- :mod:`.measurements`: what a finished run shows, read from its run folder.
- :mod:`.summary`: means over seeds and the paired differences.
- :mod:`.attack_records`: the server's tests recorded by ``scripts/server_attacks.py``.
- :mod:`.tables`: the Markdown tables and their cells.
- :mod:`.page`: the methods page's section, its pictures, and :func:`report`.

Here: the names the CLI, the docs' generator, the scripts and the tests use.
"""

from .attack_records import (
    CONCEPT_ATTACK,
    CONDITIONING_RECORDS,
    DP_MIXTURE,
    FEDAVG_KINDS,
    SERVER_ATTACK_LARGE,
    SERVER_ATTACK_STAND_IN,
    ConditioningSetting,
    classifier_key,
    conditioning_attacks,
    fedavg_key,
    record_seed,
    stand_in_attacks,
    stand_in_setting,
)
from .measurements import (
    JUDGES,
    SERVER_ATTACK,
    balanced,
    client_sets,
    distance_membership,
    nearest_real_distance,
    reconstruction,
    reconstructs_images,
    row_sources,
)
from .page import MARKER, judges_text, markdown, report, write_section
from .runner import (
    cached_seeds,
    copy_uploads,
    judges_record,
    ordered,
    record_judges,
    run,
    run_seed,
    variant_values,
)
from .settings import Bench, Sampling, Settings, base_values, sampling
from .summary import (
    Difference,
    differences,
    paired_difference,
    server_attack_summary,
    summarize,
    t_interval,
)
from .tables import (
    NOT_DISTINGUISHABLE,
    accuracy_heading,
    accuracy_table,
    conditioning_table,
    console_lines,
    dcr_cells,
    differences_table,
    judges_cell,
    kilobytes,
    reconstruction_cells,
    server_attack_table,
)
from .variants import (
    HEADLINE,
    LEGACY_NAMES,
    NAMES_VERSION,
    VARIANTS,
    Variant,
    fedavg_budget,
    fedlmg_budget,
    local_budget,
    named,
    variant,
)

__all__ = [
    "CONCEPT_ATTACK",
    "CONDITIONING_RECORDS",
    "DP_MIXTURE",
    "FEDAVG_KINDS",
    "HEADLINE",
    "JUDGES",
    "LEGACY_NAMES",
    "MARKER",
    "NAMES_VERSION",
    "NOT_DISTINGUISHABLE",
    "SERVER_ATTACK",
    "SERVER_ATTACK_LARGE",
    "SERVER_ATTACK_STAND_IN",
    "VARIANTS",
    "Bench",
    "ConditioningSetting",
    "Difference",
    "Sampling",
    "Settings",
    "Variant",
    "accuracy_heading",
    "accuracy_table",
    "balanced",
    "base_values",
    "cached_seeds",
    "classifier_key",
    "client_sets",
    "conditioning_attacks",
    "conditioning_table",
    "console_lines",
    "copy_uploads",
    "dcr_cells",
    "differences",
    "differences_table",
    "distance_membership",
    "fedavg_budget",
    "fedavg_key",
    "fedlmg_budget",
    "judges_cell",
    "judges_record",
    "judges_text",
    "kilobytes",
    "local_budget",
    "markdown",
    "named",
    "nearest_real_distance",
    "ordered",
    "paired_difference",
    "reconstruction",
    "reconstruction_cells",
    "reconstructs_images",
    "record_judges",
    "record_seed",
    "report",
    "row_sources",
    "run",
    "run_seed",
    "sampling",
    "server_attack_summary",
    "server_attack_table",
    "stand_in_attacks",
    "stand_in_setting",
    "summarize",
    "t_interval",
    "variant",
    "variant_values",
    "write_section",
]
