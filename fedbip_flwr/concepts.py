"""Concept-level personalization (paper eq. 4): learn S (domain) and V (classes), LDM frozen.

A prompt template such as ``"a {S} style of a {V}"`` is tokenized with n_s slots for S and n_v
slots for V_y. The slots first hold the tokens of the domain phrase and of the class name (the
initialisation the paper prescribes); their vectors are then replaced by learned ones:

* ``token`` space (the paper): S and V are input token embeddings, substituted before the CLIP
  text encoder runs, so every later layer sees them.
* ``hidden`` space (the authors' public code): the encoder runs on the real words and S, V
  overwrite its output hidden states at the slot positions.

Both variants share one prompt layout and one loss,
``E_{t ~ U{1..T}, eps} || eps - eps_theta(z(t), t, tau(S, V_y)) ||^2``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import CLIPTokenizer

from .config import CONCEPT_SLOT_S, CONCEPT_SLOT_V
from .ldm import LDM


@dataclass(frozen=True)
class PromptLayout:
    """Token ids of the template for every class, and where the concept slots sit."""

    input_ids: torch.Tensor  # (C, L): one prompt per class, slots holding the init words
    s_positions: torch.Tensor  # (n_s,)
    v_positions: torch.Tensor  # (n_v,)
    s_init_ids: torch.Tensor  # (n_s,) token ids S is initialised from
    v_init_ids: torch.Tensor  # (C, n_v)


def _fit(ids: list[int], n: int) -> list[int]:
    """Make a word's token ids exactly n long: repeat cyclically or keep the first n."""
    if not ids:
        raise ValueError("cannot initialise a concept from an empty phrase")
    return [ids[i % len(ids)] for i in range(n)]


def _segment_ids(tokenizer: CLIPTokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids if text.strip() else []


def prompt_layout(
    tokenizer: CLIPTokenizer,
    template: str,
    n_s: int,
    n_v: int,
    domain_phrase: str,
    class_names: Sequence[str],
) -> PromptLayout:
    """Tokenize ``template`` once per class with n_s/n_v concept slots at fixed positions."""
    s_ids = _fit(_segment_ids(tokenizer, domain_phrase), n_s)
    first, second = (
        (CONCEPT_SLOT_S, CONCEPT_SLOT_V)
        if template.index(CONCEPT_SLOT_S) < template.index(CONCEPT_SLOT_V)
        else (CONCEPT_SLOT_V, CONCEPT_SLOT_S)
    )
    head, rest = template.split(first)
    middle, tail = rest.split(second)
    length = tokenizer.model_max_length
    rows, v_rows = [], []
    for name in class_names:
        v_ids = _fit(_segment_ids(tokenizer, name), n_v)
        slot = {CONCEPT_SLOT_S: s_ids, CONCEPT_SLOT_V: v_ids}
        parts = [
            [tokenizer.bos_token_id],
            _segment_ids(tokenizer, head),
            slot[first],
            _segment_ids(tokenizer, middle),
            slot[second],
            _segment_ids(tokenizer, tail),
        ]
        starts = torch.tensor([len(p) for p in parts]).cumsum(0)
        ids = [i for p in parts for i in p] + [tokenizer.eos_token_id]
        if len(ids) > length:
            raise ValueError(
                f"prompt '{template}' with n_s={n_s}, n_v={n_v} and class '{name}' needs "
                f"{len(ids)} tokens; the text encoder takes {length}"
            )
        rows.append(ids + [tokenizer.pad_token_id] * (length - len(ids)))
        v_rows.append(v_ids)
    first_pos = torch.arange(int(starts[1]), int(starts[2]))
    second_pos = torch.arange(int(starts[3]), int(starts[4]))
    s_pos, v_pos = (first_pos, second_pos) if first == CONCEPT_SLOT_S else (second_pos, first_pos)
    return PromptLayout(
        torch.tensor(rows), s_pos, v_pos, torch.tensor(s_ids), torch.tensor(v_rows)
    )


def plain_prompt(template: str, domain_phrase: str, class_name: str) -> str:
    """The template with the words S and V start from: what the prompt says before learning."""
    return template.replace(CONCEPT_SLOT_S, domain_phrase).replace(CONCEPT_SLOT_V, class_name)


def _place(
    states: torch.Tensor, layout: PromptLayout, s: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Write S (B, n_s, d) and V (B, n_v, d) into (B, L, d) at the slot positions."""
    out = states.clone()
    out[:, layout.s_positions] = s.to(out.dtype)
    out[:, layout.v_positions] = v.to(out.dtype)
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
    Gradients flow into ``s`` and ``v``, never into the frozen encoder.
    """
    ids = layout.input_ids[class_idx].to(ldm.device)
    s_b = s.unsqueeze(0).expand(len(class_idx), -1, -1).to(ldm.device)
    v_b = v[class_idx].to(ldm.device)
    encoder = ldm.text_encoder
    if space == "hidden":
        return _place(encoder(ids).last_hidden_state, layout, s_b, v_b)
    embedding = encoder.get_input_embeddings()
    handle = embedding.register_forward_hook(lambda _m, _i, out: _place(out, layout, s_b, v_b))
    try:
        return encoder(ids).last_hidden_state
    finally:
        handle.remove()


@torch.no_grad()
def initial_concepts(ldm: LDM, layout: PromptLayout, space: str) -> tuple[torch.Tensor, torch.Tensor]:
    """S0 (n_s, d) and V0 (C, n_v, d) from the init words, in the chosen space."""
    if space == "token":
        table = ldm.text_encoder.get_input_embeddings().weight.float().cpu()
        return table[layout.s_init_ids].clone(), table[layout.v_init_ids].clone()
    states = ldm.text_encoder(layout.input_ids.to(ldm.device)).last_hidden_state.float().cpu()
    s0 = states[:, layout.s_positions].mean(0)
    return s0, states[:, layout.v_positions].clone()


@torch.no_grad()
def unconditional_embedding(ldm: LDM) -> torch.Tensor:
    """tau("") (1, L, d): the empty prompt classifier-free guidance contrasts with."""
    tok = ldm.tokenizer
    ids = tok("", padding="max_length", max_length=tok.model_max_length, return_tensors="pt")
    return ldm.text_encoder(ids.input_ids.to(ldm.device)).last_hidden_state


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
    """Eq. 4 for one batch: || eps - eps_theta(z(t), t, tau(S, V_y)) ||^2 (mean)."""
    zt = ldm.scheduler.add_noise(z0, noise, t).to(ldm.device, ldm.dtype)
    cond = encode_prompts(ldm, layout, space, s, v, labels)
    pred = ldm.unet(zt, t.to(ldm.device), encoder_hidden_states=cond).sample
    return F.mse_loss(pred.float(), noise.to(ldm.device))


@dataclass(frozen=True)
class LearnedConcepts:
    domain: torch.Tensor  # S (n_s, d)
    classes: torch.Tensor  # V (C, n_v, d)
    losses: list[float]  # mean loss per epoch


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
) -> LearnedConcepts:
    """Optimise S and V with Adam (betas 0.9/0.999) on the epsilon loss; t ~ U{1..T}.

    ``z0`` are the cached VAE latents of the client's images: nothing is re-encoded here.
    """
    s0, v0 = initial_concepts(ldm, layout, space)
    s = s0.to(ldm.device).requires_grad_(True)
    v = v0.to(ldm.device).requires_grad_(True)
    optimizer = torch.optim.Adam([s, v], lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    losses: list[float] = []
    for epoch in range(epochs):
        order = torch.randperm(len(labels), generator=generator)
        total = 0.0
        for batch in order.split(batch_size):
            noise = torch.randn((len(batch), *z0.shape[1:]), generator=generator)
            t = torch.randint(1, max_timestep + 1, (len(batch),), generator=generator)
            loss = diffusion_loss(ldm, layout, space, s, v, z0[batch], labels[batch], t, noise)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        losses.append(total / len(labels))
        if on_epoch is not None:
            on_epoch(epoch, losses[-1])
    return LearnedConcepts(s.detach().float().cpu(), v.detach().float().cpu(), losses)
