"""ClientApp: on ``train`` the institution's one upload for the run's method (FedBiP
personalizes, the peers do their own); on ``evaluate`` its score of the classifier sent back.
A multi-round method's rounds go to its own hooks (:mod:`fedbip_flwr.apps`).

Who this node is and where its data lives come from its own node config
(:class:`fedbip_flwr.config.NodeConfig`), never from the server (:mod:`fedbip_flwr.client_run`).
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedbip_flwr import apps

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    return apps.train(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return apps.evaluate(msg, context)
