"""Concept-level personalization (paper eq. 4): learn S (domain) and V (classes), LDM frozen.

A prompt template such as ``"a {S} style of a {V}"`` is tokenized with slots for S and for V_y.
The slots first hold the tokens of the whole domain phrase and class name (the initialisation
the paper prescribes; a real CLIP tokenizer splits "quickdraw" into two tokens, so a concept
gets at least one vector per token, never a cut phrase); their vectors are then learned:

* ``token`` space (the paper): S and V are input token embeddings, substituted before the CLIP
  text encoder runs, so every later layer sees them.
* ``hidden`` space (the authors' public code): the encoder runs on the real words and S, V
  overwrite its output hidden states at the slot positions.

Both variants share one prompt layout, one scale-aware parametrisation (:func:`concept_scale`)
and one loss, ``E_{t ~ U{1..T}, eps} || target - model(z(t), t, tau(S, V_y)) ||^2`` with the
target eps (or the velocity for a v-prediction model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .config import CONCEPT_SLOT_S, CONCEPT_SLOT_V
from .dp import clip_rows
from .ldm import LDM

if TYPE_CHECKING:
    from diffusers import PNDMScheduler
    from transformers import CLIPTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptLayout:
    """Token ids of the template for every class, and where each class's concept slots sit.

    S has n_s slots in every prompt. V is one (C, n_v, d) tensor, but class c's prompt holds only
    its own ``v_lengths[c]`` slots (its phrase never padded to the longest class name), so rows
    past that are unused: they start at zero and, receiving no gradient, stay there.
    """

    input_ids: torch.Tensor  # (C, L): one prompt per class, slots holding the init words
    s_positions: torch.Tensor  # (C, n_s): where S sits in each prompt
    v_positions: torch.Tensor  # (C, n_v): where V_c sits; 0 past v_lengths[c]
    v_lengths: torch.Tensor  # (C,) slots class c's prompt uses
    s_init_ids: torch.Tensor  # (n_s,) token ids S is initialised from
    v_init_ids: torch.Tensor  # (C, n_v) token ids V_c is initialised from; pad past v_lengths

    @property
    def n_s(self) -> int:
        return int(self.s_positions.shape[1])

    @property
    def n_v(self) -> int:
        return int(self.v_positions.shape[1])

    @property
    def v_mask(self) -> torch.Tensor:
        """(C, n_v) True where class c's prompt uses row j of V_c."""
        return torch.arange(self.n_v).unsqueeze(0) < self.v_lengths.unsqueeze(1)


def concept_slots(n: int, tokens: int) -> int:
    """Vectors of a concept: at least run config n, and one per token of its phrase.

    A phrase is never cut (CLIP splits "quickdraw" into quick + draw); one shorter than n is
    repeated to n vectors, textual inversion's multi-vector initialisation.
    """
    return max(n, tokens)


def _fill(ids: list[int], n: int) -> list[int]:
    """The phrase's token ids, repeated cyclically to n >= len(ids): never truncated."""
    if not ids:
        raise ValueError("cannot initialise a concept from an empty phrase")
    return [ids[i % len(ids)] for i in range(n)]


def _segment_ids(tokenizer: CLIPTokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids if text.strip() else []


def count_tokens(tokenizer: CLIPTokenizer, phrase: str) -> int:
    """Tokens of a domain phrase or class name: with data.n-s / n-v it fixes a concept's size.

    The server hands ``functools.partial(count_tokens, tokenizer)`` to payload validation
    (:class:`fedbip_flwr.payload.Expectations`), which has no tokenizer of its own.
    """
    return len(_segment_ids(tokenizer, phrase))


def _concept_ids(tokenizer: CLIPTokenizer, phrase: str, n: int, what: str, warn: bool) -> list[int]:
    ids = _segment_ids(tokenizer, phrase)
    if warn and len(ids) > n:
        pieces = " ".join(tokenizer.convert_ids_to_tokens(ids)).replace("</w>", "")
        log.warning(
            "%s '%s' is %d tokens for this tokenizer (%s): its concept gets %d vectors instead "
            "of run config %d, so that it starts from the whole phrase",
            what,
            phrase,
            len(ids),
            pieces,
            len(ids),
            n,
        )
    return _fill(ids, concept_slots(n, len(ids)))


def prompt_layout(
    tokenizer: CLIPTokenizer,
    template: str,
    n_s: int,
    n_v: int,
    domain_phrase: str,
    class_names: Sequence[str],
    *,
    warn: bool = True,
) -> PromptLayout:
    """Tokenize ``template`` once per class, with S and V_y starting from their whole phrases.

    ``n_s`` / ``n_v`` are the run config's sizes: each concept gets
    ``concept_slots(n, tokens of its phrase)`` vectors, and ``warn`` logs every phrase that
    needs more than n (the server rebuilding a client's layout passes ``warn=False``).
    """
    s_ids = _concept_ids(tokenizer, domain_phrase, n_s, "domain phrase", warn)
    v_ids = [_concept_ids(tokenizer, name, n_v, "class name", warn) for name in class_names]
    width = max(len(ids) for ids in v_ids)
    first, second = (
        (CONCEPT_SLOT_S, CONCEPT_SLOT_V)
        if template.index(CONCEPT_SLOT_S) < template.index(CONCEPT_SLOT_V)
        else (CONCEPT_SLOT_V, CONCEPT_SLOT_S)
    )
    head, rest = template.split(first)
    middle, tail = rest.split(second)
    text = [_segment_ids(tokenizer, part) for part in (head, middle, tail)]
    length = tokenizer.model_max_length
    rows, s_rows, v_rows = [], [], []
    for name, v in zip(class_names, v_ids, strict=True):
        slot = {CONCEPT_SLOT_S: s_ids, CONCEPT_SLOT_V: v}
        parts = [[tokenizer.bos_token_id], text[0], slot[first], text[1], slot[second], text[2]]
        starts = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]
        ids = [i for p in parts for i in p] + [tokenizer.eos_token_id]
        if len(ids) > length:
            raise ValueError(
                f"prompt '{template}' with {len(s_ids)} domain and {len(v)} class tokens for "
                f"class '{name}' needs {len(ids)} tokens; the text encoder takes {length}"
            )
        rows.append(ids + [tokenizer.pad_token_id] * (length - len(ids)))
        at = {first: starts[2], second: starts[4]}
        s_rows.append(list(range(at[CONCEPT_SLOT_S], at[CONCEPT_SLOT_S] + len(s_ids))))
        v_rows.append(list(range(at[CONCEPT_SLOT_V], at[CONCEPT_SLOT_V] + len(v))))
    pad = tokenizer.pad_token_id
    return PromptLayout(
        input_ids=torch.tensor(rows),
        s_positions=torch.tensor(s_rows),
        v_positions=torch.tensor([p + [0] * (width - len(p)) for p in v_rows]),
        v_lengths=torch.tensor([len(v) for v in v_ids]),
        s_init_ids=torch.tensor(s_ids),
        v_init_ids=torch.tensor([v + [pad] * (width - len(v)) for v in v_ids]),
    )


def plain_prompt(template: str, domain_phrase: str, class_name: str) -> str:
    """The template with the words S and V start from: what the prompt says before learning
    (token for token when no data.n-s / data.n-v exceeds its phrase's tokens)."""
    return template.replace(CONCEPT_SLOT_S, domain_phrase).replace(CONCEPT_SLOT_V, class_name)


def _place(
    states: torch.Tensor,
    layout: PromptLayout,
    rows: torch.Tensor,
    s: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """Write S (B, n_s, d) and V (B, n_v, d) into (B, L, d) at prompt ``rows``' slot positions."""
    out = states.clone()
    batch = torch.arange(len(out), device=out.device).unsqueeze(1)
    s_pos = layout.s_positions[rows].to(out.device)
    v_pos, used = layout.v_positions[rows].to(out.device), layout.v_mask[rows].to(out.device)
    out[batch.expand_as(s_pos), s_pos] = s.to(out.dtype)
    out[batch.expand_as(v_pos)[used], v_pos[used]] = v[used].to(out.dtype)
    return out


def encode_prompts(
    ldm: LDM,
    layout: PromptLayout,
    space: str,
    s: torch.Tensor,
    v: torch.Tensor,
    class_idx: torch.Tensor,
) -> torch.Tensor:
    """tau(S, V_y) for each y in ``class_idx``: (B, L, d) text-encoder states for the UNet.

    ``s`` is (n_s, d) shared by the batch; ``v`` is (C, n_v, d), indexed by ``class_idx``.
    Gradients flow into ``s`` and ``v``, never into the frozen encoder. Each example may have
    its own copy instead, ``s`` (B, n_s, d) and ``v`` (B, C, n_v, d): then the gradient with
    respect to copy b is example b's alone (DP-SGD's per-example gradients).
    """
    ids = layout.input_ids[class_idx].to(ldm.device)
    if s.dim() == 3:  # one copy per example
        s_b, v_b = s.to(ldm.device), v[torch.arange(len(class_idx)), class_idx].to(ldm.device)
    else:
        s_b = s.unsqueeze(0).expand(len(class_idx), -1, -1).to(ldm.device)
        v_b = v[class_idx].to(ldm.device)
    encoder = ldm.text_encoder
    if space == "hidden":
        return _place(encoder(ids).last_hidden_state, layout, class_idx, s_b, v_b)
    embedding = encoder.get_input_embeddings()
    handle = embedding.register_forward_hook(
        lambda _m, _i, out: _place(out, layout, class_idx, s_b, v_b)
    )
    try:
        return encoder(ids).last_hidden_state
    finally:
        handle.remove()


@torch.no_grad()
def initial_concepts(
    ldm: LDM, layout: PromptLayout, space: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """S0 (n_s, d) and V0 (C, n_v, d) from the init words, in the chosen space; unused rows 0."""
    used = layout.v_mask.unsqueeze(-1)
    if space == "token":
        table = ldm.text_encoder.get_input_embeddings().weight.float().cpu()
        return table[layout.s_init_ids].clone(), table[layout.v_init_ids] * used
    states = ldm.text_encoder(layout.input_ids.to(ldm.device)).last_hidden_state.float().cpu()
    rows = torch.arange(len(states)).unsqueeze(1)
    s0 = states[rows, layout.s_positions].mean(0)
    return s0, states[rows, layout.v_positions] * used


@torch.no_grad()
def unconditional_embedding(ldm: LDM) -> torch.Tensor:
    """tau("") (1, L, d): the empty prompt classifier-free guidance contrasts with."""
    tok = ldm.tokenizer
    ids = tok("", padding="max_length", max_length=tok.model_max_length, return_tensors="pt")
    return ldm.text_encoder(ids.input_ids.to(ldm.device)).last_hidden_state


@torch.no_grad()
def concept_scale(ldm: LDM, space: str) -> float:
    """The typical coordinate size (RMS) of the concept space, measured from the model.

    Concepts move as ``c0 + scale * u``: Adam's lr (0.1) and the server's eta sigma (0.1) act on
    u, so they mean the same in both spaces. The paper's values were tuned in the text
    encoder's output space (coordinates ~1); SD v1-4's input token embeddings are ~0.014 per
    coordinate, where an absolute 0.1 step would move a token ~7x its own norm. ``token``: RMS
    of the embedding table; ``hidden``: RMS of tau("") past its start token (CLIP's start
    state is an outlier). Client and server measure it from the same model (same fingerprint),
    so the payload need not carry it.
    """
    if space == "token":
        values = ldm.text_encoder.get_input_embeddings().weight
    else:
        values = unconditional_embedding(ldm)[:, 1:]
    return float(values.float().pow(2).mean().sqrt())


def velocity(
    scheduler: PNDMScheduler, z0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
) -> torch.Tensor:
    """v = sqrt(abar_t) eps - sqrt(1 - abar_t) z0: what a v-prediction model predicts."""
    abar = scheduler.alphas_cumprod.to(z0.device, torch.float32)[t.to(z0.device)]
    abar = abar.view(-1, *([1] * (z0.dim() - 1)))
    return abar.sqrt() * noise - (1 - abar).sqrt() * z0


def diffusion_loss(
    ldm: LDM,
    layout: PromptLayout,
    space: str,
    s: torch.Tensor,
    v: torch.Tensor,
    z0: torch.Tensor,
    labels: torch.Tensor,
    t: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """Eq. 4 for one batch: || target - model(z(t), t, tau(S, V_y)) ||^2 (mean, float32 or wider)."""
    return conditioned_loss(ldm, encode_prompts(ldm, layout, space, s, v, labels), z0, t, noise)


def conditioned_loss(
    ldm: LDM,
    cond: torch.Tensor,
    z0: torch.Tensor,
    t: torch.Tensor,
    noise: torch.Tensor,
    per_example: bool = False,
) -> torch.Tensor:
    """|| target - model(z(t), t, cond) ||^2 (mean, float32 or wider) for cross-attention states
    ``cond`` (B, L, d): the loss every learned conditioning minimises. ``per_example``: each
    example's mean (B,) instead (what a membership test compares).

    The target is eps for an epsilon-prediction model (SD v1) and the velocity for a
    v-prediction one (SD 2.x); load_ldm refuses any other kind.
    """
    zt = ldm.scheduler.add_noise(z0, noise, t).to(ldm.device, ldm.dtype)
    pred = ldm.unet(
        zt, t.to(ldm.device), encoder_hidden_states=cond.to(ldm.device, ldm.dtype)
    ).sample
    if ldm.scheduler.config.prediction_type == "v_prediction":
        target = velocity(ldm.scheduler, z0, noise, t)
    else:
        target = noise
    dtype = torch.promote_types(pred.dtype, torch.float32)  # half-precision UNets: float32
    if per_example:
        errors = F.mse_loss(pred.to(dtype), target.to(ldm.device, dtype), reduction="none")
        return errors.flatten(1).mean(dim=1)
    return F.mse_loss(pred.to(dtype), target.to(ldm.device, dtype))


def loss_scaler(ldm: LDM) -> torch.amp.GradScaler:
    """Dynamic loss scaling when the frozen LDM runs in fp16 (CUDA's half-precision).

    The loss is a mean over B x 4 x 64 x 64 elements, so the gradients flowing back through an
    fp16 UNet are ~1e-6 per element and part of them underflow fp16 (normal range >= 6e-5):
    S's gradient was 12% off fp32's on a tiny UNet at SD's latent size (tests/test_precision.py),
    1% with scaling. Steps whose scaled gradients overflow are skipped.
    Chosen over an fp32 or bf16 copy of the UNet: no second copy of the weights, same model
    for client and server. bf16 and fp32 share fp32's exponent range and need no scaling.
    """
    return torch.amp.GradScaler(ldm.device.type, enabled=ldm.dtype == torch.float16)


def relative_drift(learned: torch.Tensor, start: torch.Tensor) -> float:
    """||learned - start|| / ||start||: how far a concept moved from its init words."""
    return float((learned - start).norm() / start.norm().clamp_min(1e-12))


@dataclass(frozen=True)
class LearnedConcepts:
    domain: torch.Tensor  # S (n_s, d)
    classes: torch.Tensor  # V (C, n_v, d)
    losses: list[float]  # mean loss per epoch
    domain_drift: float  # ||S - S0|| / ||S0||
    class_drift: float  # mean over classes of ||V_y - V0_y|| / ||V0_y||


def learn_concepts(
    ldm: LDM,
    layout: PromptLayout,
    space: str,
    z0: torch.Tensor,
    labels: torch.Tensor,
    max_timestep: int,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    on_epoch: Callable[[int, float], None] | None = None,
    privacy: DPSGD | None = None,
) -> LearnedConcepts:
    """Optimise S and V with Adam (betas 0.9/0.999) on the diffusion loss; t ~ U{1..T}.

    S = S0 + scale * u_S and V = V0 + scale * u_V (see :func:`concept_scale`); Adam updates
    the u, in float32 whatever the LDM's dtype. ``z0`` are the cached VAE latents of the
    client's images: nothing is re-encoded here. With ``privacy``, by DP-SGD
    (:func:`optimise_embeddings`), noise only on the rows of V the prompts use.
    """
    s0, v0 = initial_concepts(ldm, layout, space)
    if privacy is not None:
        privacy = replace(privacy, trainable=(None, layout.v_mask.unsqueeze(-1)))
    (s, v), losses = optimise_embeddings(
        ldm,
        [s0, v0],
        concept_batch_loss(ldm, layout, space, z0, labels),
        z0.shape,
        max_timestep,
        concept_scale(ldm, space),
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        generator=generator,
        on_epoch=on_epoch,
        privacy=privacy,
    )
    return _result(s, v, s0, v0, losses)


# (the embeddings as they stand, batch indices, t, noise) -> the batch's mean loss
BatchLoss = Callable[[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def concept_batch_loss(
    ldm: LDM, layout: PromptLayout, space: str, z0: torch.Tensor, labels: torch.Tensor
) -> BatchLoss:
    """Eq. 4 on the images ``batch`` of ``z0``, for the embeddings [S, V]."""

    def batch_loss(
        shifts: list[torch.Tensor], batch: torch.Tensor, t: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        s, v = shifts
        return diffusion_loss(ldm, layout, space, s, v, z0[batch], labels[batch], t, noise)

    return batch_loss


@dataclass(frozen=True)
class DPSGD:
    """DP-SGD (Abadi et al. 2016) on the shifts u: every step takes each image with probability
    ``sample_rate`` (Poisson sampling; ``steps_per_epoch`` steps an epoch), clips each image's
    gradient with respect to all the u together to L2 norm ``clip``, and adds Gaussian noise of
    std ``noise_multiplier`` x ``clip`` to the sum, on the coordinates ``trainable`` marks (one
    mask per embedding, broadcast to its shape; None: all). Coordinates no image's gradient
    ever reaches (V's rows past a class's tokens) get no noise, which costs no privacy.
    Accounted by :func:`fedbip_flwr.dp.dp_sgd_event`."""

    sample_rate: float
    steps_per_epoch: int
    noise_multiplier: float
    clip: float
    trainable: tuple[torch.Tensor | None, ...] = ()


def optimise_embeddings(
    ldm: LDM,
    starts: list[torch.Tensor],
    batch_loss: BatchLoss,
    latent_rows: torch.Size,
    max_timestep: int,
    scale: float,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    on_epoch: Callable[[int, float], None] | None = None,
    privacy: DPSGD | None = None,
) -> tuple[list[torch.Tensor], list[float]]:
    """Adam (betas 0.9/0.999) on embeddings ``c0 + scale * u``, everything else frozen, over
    batches of the ``latent_rows[0]`` cached latents with t ~ U{1..T} and fresh noise.

    Adam updates the u, in float32 whatever the LDM's dtype. Returns the final embeddings
    (CPU, float32) and the mean loss per epoch.

    With ``privacy``, every step is a DP-SGD step (:class:`DPSGD`, :func:`private_gradient`):
    a Poisson-sampled batch, run ``batch_size`` images at a time, and ``batch_loss`` is given
    one copy of each embedding per image (a leading batch dimension), so that each image's
    gradient is its own. Adam steps on the noisy sum over ``batch_size`` (a constant: dividing
    by the batch's real size would depend on which images it holds).
    """
    count = latent_rows[0]
    starts = [c.to(ldm.device) for c in starts]
    shifts = [torch.zeros_like(c, requires_grad=True) for c in starts]
    # d/du = scale * d/dc: eps scaled alike keeps Adam's usual 1e-8 relative to the
    # embeddings' own gradients, so the parametrisation changes the step size and nothing else.
    optimizer = torch.optim.Adam(shifts, lr=lr, betas=(0.9, 0.999), eps=1e-8 * scale)
    scaler = loss_scaler(ldm)
    losses: list[float] = []

    def epoch_of_batches() -> float:
        order = torch.randperm(count, generator=generator)
        total = 0.0
        for batch in order.split(batch_size):
            noise = torch.randn((len(batch), *latent_rows[1:]), generator=generator)
            t = torch.randint(1, max_timestep + 1, (len(batch),), generator=generator)
            loss = batch_loss(
                [c + scale * u for c, u in zip(starts, shifts, strict=True)], batch, t, noise
            )
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            total += loss.item() * len(batch)
        return total / count

    for epoch in range(epochs):
        if privacy is None:
            losses.append(epoch_of_batches())
        else:
            losses.append(
                _private_epoch(
                    optimizer,
                    batch_loss,
                    starts,
                    shifts,
                    latent_rows,
                    max_timestep,
                    scale,
                    batch_size,
                    privacy,
                    generator,
                    _private_loss_scale(ldm),
                )
            )
        if on_epoch is not None:
            on_epoch(epoch, losses[-1])
    return [
        (c + scale * u).detach().float().cpu() for c, u in zip(starts, shifts, strict=True)
    ], losses


def _private_loss_scale(ldm: LDM) -> float:
    """A fixed loss scale for DP-SGD in fp16 (:func:`loss_scaler`'s first): a dynamic one would
    change with whether some image's gradient overflowed, which the accounting does not cover."""
    scaler = loss_scaler(ldm)
    return float(scaler.get_scale()) if scaler.is_enabled() else 1.0


def _private_epoch(
    optimizer: torch.optim.Optimizer,
    batch_loss: BatchLoss,
    starts: list[torch.Tensor],
    shifts: list[torch.Tensor],
    latent_rows: torch.Size,
    max_timestep: int,
    scale: float,
    batch_size: int,
    privacy: DPSGD,
    generator: torch.Generator,
    loss_scale: float,
) -> float:
    """One epoch of DP-SGD steps; returns the mean loss over the images its batches held."""
    total, seen = 0.0, 0
    for _ in range(privacy.steps_per_epoch):
        batch = (
            (torch.rand(latent_rows[0], generator=generator) < privacy.sample_rate)
            .nonzero()
            .flatten()
        )
        noise = torch.randn((len(batch), *latent_rows[1:]), generator=generator)
        t = torch.randint(1, max_timestep + 1, (len(batch),), generator=generator)
        summed, loss = private_gradient(
            batch_loss, starts, shifts, scale, batch, t, noise, privacy.clip, batch_size, loss_scale
        )
        noisy = add_gradient_noise(summed, privacy, generator)
        for u, g in zip(shifts, noisy, strict=True):
            u.grad = g / batch_size
        optimizer.step()
        total, seen = total + loss, seen + len(batch)
    return total / max(seen, 1)


def private_gradient(
    batch_loss: BatchLoss,
    starts: list[torch.Tensor],
    shifts: list[torch.Tensor],
    scale: float,
    batch: torch.Tensor,
    t: torch.Tensor,
    noise: torch.Tensor,
    clip: float,
    chunk: int,
    loss_scale: float = 1.0,
) -> tuple[list[torch.Tensor], float]:
    """The sum over ``batch`` of each image's gradient with respect to the shifts u, clipped to
    L2 norm ``clip`` (all the u together), no noise; and the batch's summed loss.

    Each image's gradient comes from its own copy of the u in one backward pass per ``chunk``
    images (the UNet and the text encoder treat the examples of a batch independently: no
    batch norm, attention within an example only), as exact as a batch of one. A gradient that
    is not finite (an fp16 overflow at ``loss_scale``) counts as zero: still bounded by the clip.
    """
    dtype = torch.promote_types(shifts[0].dtype, torch.float32)  # fp16 gradients summed in float32
    flat = torch.zeros(sum(u.numel() for u in shifts), device=shifts[0].device, dtype=dtype)
    loss_sum = 0.0
    for part in (
        torch.arange(len(batch)).split(chunk) if len(batch) else ()
    ):  # a sample can be empty
        copies = [
            u.detach().unsqueeze(0).repeat(len(part), *([1] * u.dim())).requires_grad_(True)
            for u in shifts
        ]
        loss = batch_loss(
            [c + scale * u for c, u in zip(starts, copies, strict=True)],
            batch[part],
            t[part],
            noise[part],
        )
        grads = torch.autograd.grad(loss * loss_scale, copies, allow_unused=True)
        rows = torch.cat(
            [
                (g if g is not None else torch.zeros_like(u)).flatten(1).to(dtype)
                for g, u in zip(grads, copies, strict=True)
            ],
            1,
        ) * (
            len(part) / loss_scale
        )  # the batch's mean loss: each image's own loss has len(part) x its gradient
        rows = torch.where(rows.isfinite().all(1, keepdim=True), rows, torch.zeros_like(rows))
        flat += clip_rows(rows, clip).sum(0)
        loss_sum += loss.item() * len(part)
    parts = flat.split([u.numel() for u in shifts])
    return [g.view_as(u) for g, u in zip(parts, shifts, strict=True)], loss_sum


def add_gradient_noise(
    summed: list[torch.Tensor], privacy: DPSGD, generator: torch.Generator
) -> list[torch.Tensor]:
    """``summed`` (one per shift, as :func:`private_gradient` gives them) plus
    N(0, (sigma C)^2) on each trainable coordinate."""
    out = []
    for g, mask in zip(summed, privacy.trainable or (None,) * len(summed), strict=True):
        noise = torch.randn(g.shape, generator=generator) * (
            privacy.noise_multiplier * privacy.clip
        )
        if mask is not None:
            noise = noise * mask.to(noise.dtype)
        out.append(g + noise.to(g.device))
    return out


def _result(
    s: torch.Tensor, v: torch.Tensor, s0: torch.Tensor, v0: torch.Tensor, losses: list[float]
) -> LearnedConcepts:
    s, v, s0, v0 = (x.detach().float().cpu() for x in (s, v, s0, v0))
    domain_drift = relative_drift(s, s0)
    class_drift = sum(relative_drift(a, b) for a, b in zip(v, v0, strict=True)) / len(v)
    return LearnedConcepts(s, v, losses, domain_drift, class_drift)
