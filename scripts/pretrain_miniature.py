"""Pretrain the miniature LDM that `flwr run .` uses by default (run once; weights are shipped).

The premise of FedBiP at CPU scale: a latent diffusion model pretrained on *common* domains
(photo, clipart, painting: every class, captioned "a {domain} of a {class}" or "a {class}")
that has seen the *rare* client domains (sketch, quickdraw) as a small share whose captions never
name them: "a {descriptor} {class}" (``shapes.RARE_DESCRIPTORS``: "a doodle star", as web
alt-text describes such a picture). So the model can render every domain under some
conditioning, as Stable Diffusion can, while the words a prompt would use ("a quickdraw of a
star") stay untrained: text alone does not reach the rare domains, a learned concept can. 10% of
captions are empty for classifier-free guidance; in a share of the common ones the domain word
is one the model never learns (:data:`UNKNOWN_WORD_SHARE`).

Two stages, seeded: (1) the VAE (AutoencoderKL) on the images; its scaling factor is set to
1 / std of the latents, as SD's 0.18215 was. (2) the UNet and CLIP text encoder jointly on the
frozen VAE's latents (encoded once), epsilon prediction, EMA of the UNet. Stage 2 runs for a
wall-clock budget (``--unet-minutes``) or, with ``--unet-steps``, a step count whatever the
clock; the number of steps reached is in the log, so a run is reproducible up to that count. ``--resume``
continues stage 2 from a saved model (fresh optimizer and EMA) and appends to its log; words the
corpus uses that the model's tokenizer lacks are added first, every learned token kept.

``--image-size 256`` renders the same corpus at 256 px: the convolutional VAE gives 4x64x64
latents, Stable Diffusion's size. A UNet trained on 4x16x16 latents only does not work there (the
concepts' membership test cannot tell even overfitted members, BENCHMARKS.md), so the server's
tests at SD's size take a copy of the shipped model whose UNet and text encoder are trained on, at
256 px (``--base``: the model to continue from; the VAE stays as it is).

    python scripts/pretrain_miniature.py --out models/miniature-ldm --unet-minutes 60
    python scripts/pretrain_miniature.py --out models/miniature-ldm --unet-minutes 20 --resume
    python scripts/pretrain_miniature.py --resume --base models/miniature-ldm \
        --out models/miniature-ldm-256px --image-size 256 --per-class 100 --batch 16 --unet-steps 300
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fedbip_flwr import shapes
from fedbip_flwr.instance import encode_images
from fedbip_flwr.ldm import LDM, load_ldm
from fedbip_tools.build_ldm import MINIATURE, build_ldm, grow_vocabulary


def train_vae(ldm: LDM, images: torch.Tensor, steps: int, batch: int, log: list) -> None:
    vae = ldm.vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = images[torch.randint(0, len(images), (batch,), generator=gen)]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(generator=None)).sample
        kl = posterior.kl().mean() / x[0].numel()
        loss = F.mse_loss(recon, x) + 0.5 * F.l1_loss(recon, x) + 1e-4 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            log.append({"stage": "vae", "step": step, "loss": loss.item(), "t": time.time()})
            print(f"vae step {step}/{steps} loss {loss.item():.4f}", flush=True)
    vae.eval().requires_grad_(False)


def set_scaling_factor(ldm: LDM, images: torch.Tensor) -> float:
    """Unit-variance latents, as SD's scaling factor gives its diffusion model."""
    ldm.vae.register_to_config(scaling_factor=1.0)
    z = encode_images(ldm.vae, images[:2000])
    factor = float(1.0 / z.std())
    ldm.vae.register_to_config(scaling_factor=factor)
    return factor


# A caption's domain slot ("a {domain} of a {class}": the domain is token 2, after BOS and
# "a") holds, in this share of the common images' captions, a word the model never learned: a
# fresh random vector at the scale of an untrained token's embedding. Web captions are full of
# words a model cannot ground, and they mostly describe common pictures; so an unfamiliar word
# there, the rare domains' untrained names among them, means a common look, as "a quickdraw of
# an airplane" gives Stable Diffusion no DomainNet doodle.
UNKNOWN_WORD_SHARE = 0.2
DOMAIN_SLOT = 2
UNTRAINED_SCALE = 0.02  # the text encoder's initializer_range: an untrained token's spread


def domain_slot_captions(captions: list[str]) -> torch.Tensor:
    """Which captions are "a {common domain} of a {class}" (their token 2 names the domain)."""
    return torch.tensor(
        [
            len(w := c.split()) == 5 and w[1] in shapes.COMMON_DOMAINS and w[2] == "of"
            for c in captions
        ]
    )


def train_unet(
    ldm: LDM,
    latents: torch.Tensor,
    captions: list[str],
    minutes: float,
    max_steps: int,
    batch: int,
    log: list,
    seed: int,
) -> None:
    """Stage 2 for ``max_steps`` steps, or where that is 0 for ``minutes`` of wall clock."""
    ids = ldm.tokenizer(
        captions,
        padding="max_length",
        max_length=ldm.tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids
    slotted = domain_slot_captions(captions)
    unet, text = (
        ldm.unet.train().requires_grad_(True),
        ldm.text_encoder.train().requires_grad_(True),
    )
    unknown = torch.zeros(batch, dtype=torch.bool)
    words = torch.zeros(batch, text.config.hidden_size)

    def unknown_words(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[unknown, DOMAIN_SLOT] = words[unknown].to(out.dtype)
        return out

    hook = text.get_input_embeddings().register_forward_hook(unknown_words)
    ema = copy.deepcopy(unet).requires_grad_(False)
    params = list(unet.parameters()) + list(text.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2)
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    gen = torch.Generator().manual_seed(seed)
    deadline = float("inf") if max_steps else time.time() + minutes * 60
    step = 0
    while time.time() < deadline and not 0 < max_steps <= step:
        idx = torch.randint(0, len(latents), (batch,), generator=gen)
        z0 = latents[idx]
        noise = torch.randn(z0.shape, generator=gen)
        t = torch.randint(0, ldm.scheduler.config.num_train_timesteps, (batch,), generator=gen)
        unknown.copy_(slotted[idx] & (torch.rand(batch, generator=gen) < UNKNOWN_WORD_SHARE))
        words.copy_(UNTRAINED_SCALE * torch.randn(words.shape, generator=gen))
        zt = ldm.scheduler.add_noise(z0, noise, t)
        cond = text(ids[idx]).last_hidden_state
        loss = F.mse_loss(unet(zt, t, encoder_hidden_states=cond).sample, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            decay = min(0.995, (1 + step) / (10 + step))
            for e, p in zip(ema.parameters(), unet.parameters(), strict=True):
                e.lerp_(p, 1 - decay)
        if step % 50 == 0:
            log.append({"stage": "unet", "step": step, "loss": loss.item(), "t": time.time()})
            print(f"unet step {step} loss {loss.item():.4f}", flush=True)
        step += 1
    hook.remove()
    unet.load_state_dict(ema.state_dict())
    unet.eval().requires_grad_(False)
    text.eval().requires_grad_(False)
    log.append({"stage": "unet", "step": step, "final": True, "t": time.time()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("models/miniature-ldm"))
    parser.add_argument("--per-class", type=int, default=500, help="common-domain images per class")
    parser.add_argument("--vae-steps", type=int, default=600)
    parser.add_argument("--unet-minutes", type=float, default=60.0)
    parser.add_argument(
        "--unet-steps",
        type=int,
        default=0,
        help="end stage 2 at this step, whatever the clock (0: after --unet-minutes)",
    )
    parser.add_argument("--image-size", type=int, default=64, help="px; 256 gives 4x64x64 latents")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = all cores")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue stage 2 from the model in --base (VAE kept; fresh optimizer and EMA)",
    )
    parser.add_argument("--base", type=Path, help="with --resume: the model (default: --out)")
    args = parser.parse_args()
    if args.base and not args.resume:
        parser.error("--base names the model --resume continues from")

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()
    images, captions = shapes.pretraining_corpus(args.per_class, args.seed, args.image_size)
    print(f"corpus: {len(images)} images in {time.time() - started:.0f} s", flush=True)
    entry = {"args": {k: str(v) for k, v in vars(args).items()}, "images": len(images)}
    if args.resume:
        base = args.base or args.out
        ldm = grow_vocabulary(load_ldm(base), shapes.pretraining_words())
        log: list[dict] = json.loads((base / "pretrain_log.json").read_text())
        log.append({**entry, "resumed": True})
    else:
        ldm = build_ldm(MINIATURE, shapes.pretraining_words(), seed=args.seed)
        log = [entry]
        train_vae(ldm, images, args.vae_steps, 32, log)
        set_scaling_factor(ldm, images)
    latents = encode_images(ldm.vae, images)
    print(
        f"scaling factor {ldm.vae.config.scaling_factor:.4f}; latents {tuple(latents.shape)}",
        flush=True,
    )
    stage = sum(1 for e in log if "args" in e)  # 1 for a fresh run, +1 per resume
    train_unet(
        ldm,
        latents,
        captions,
        args.unet_minutes,
        args.unet_steps,
        args.batch,
        log,
        seed=args.seed + 1 + stage,
    )
    ldm.save(args.out)
    (args.out / "pretrain_log.json").write_text(json.dumps(log, indent=1))
    print(f"saved to {args.out} after {(time.time() - started) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
