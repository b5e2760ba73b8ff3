"""ServerApp: one run of the run config's method (:mod:`fedbip_flwr.apps`).

For a one-shot method, one round of uploads, then its training set, the classifier and its
scores (:mod:`fedbip_flwr.server_run`, on :class:`fedbip_flwr.strategy.OneShotStrategy`); a
multi-round method (FedAvg) runs its own Flower strategy. The run's folder holds every upload,
the training set, the classifier and metrics.json; a restart with the same ``run-name`` resumes.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedbip_flwr import apps

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    apps.serve(grid, context)
