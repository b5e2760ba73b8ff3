"""What people run beside a federation, never a node: the ``fedbip`` command, the benchmark, the
speed comparison, the fidelity judges, simulation helpers, and builders of large models and
tokenizers. Installed with the project; ``flwr run`` ships only ``fedbip_flwr`` and the apps,
which never import this package."""
