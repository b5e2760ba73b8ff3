"""What a finished run's synthetic sets give away about each client's private images, on the
shapes world: distance-to-closest-record membership (pixels and the public backbone's
features, members against as many unseen images of the same domain and classes), DOMIAS's
density ratio against the base model's public images of the domain and, for
FedBiP (whose synthetic image k is denoised from z(T) row k, and row k * N + i comes from
private image i), the server's reconstruction of each private image scored by PSNR and SSIM
against it and against an image of the same class no client holds.

    python scripts/privacy_check.py outputs/<run> [--out benchmarks/privacy_check.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fedbip_flwr import dataset, results
from fedbip_flwr.classifier import ShardImages
from fedbip_flwr.config import FedBiPConfig
from fedbip_flwr.server import RunFolder
from fedbip_flwr.storage import write_json
from fedbip_tools import provenance
from fedbip_tools.benchmark import distance_membership, reconstruction, reconstructs_images
from fedbip_tools.privacy import backbone_features


def check(run_dir: Path) -> dict:
    folder = RunFolder(run_dir)
    cfg = FedBiPConfig.from_recorded(results.read(run_dir).config)
    clients = {
        c.client_id: c
        for c in (
            dataset.load_client_data(cfg.data_description, p)
            for p in range(len(cfg.data.domain_list))
        )
    }
    features = backbone_features(cfg.ldm.model)
    out: dict = {"run": run_dir.name, "method": cfg.method, "clients": {}}
    for client_id, shards in sorted(folder.training_shards().items()):
        data = ShardImages(shards, cfg.data.image_size)
        synthetic, _ = data[torch.arange(len(data))]
        synthetic = synthetic.float() / 127.5 - 1.0 if synthetic.dtype == torch.uint8 else synthetic
        client = clients[client_id]
        entry = {"dcr": distance_membership(synthetic, client, cfg, features)}
        if reconstructs_images(cfg):
            entry["reconstruction"] = reconstruction(data, client, cfg)
        out["clients"][client_id] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    made = provenance.record(root, torch.get_num_threads(), [args.out] if args.out else [])
    record = {**check(args.run_dir), "provenance": made}
    print(json.dumps(record, indent=1))
    if args.out:
        write_json(args.out, record)


if __name__ == "__main__":
    main()
