"""Building blocks of learned reward models: RMSNorm, SkipCA, the value head and its read-out.

LLaVA-Reward (Zhou et al., ICCV 2025) puts a linear value head on an MLLM's last-layer hidden
state at the final token. SkipCA (skip-connection cross-attention) first lets every last-layer
position attend to the image tokens as they entered the LLM (after the projector), adds the
result back (residual) and normalises with RMSNorm. The attribute names (``W_q``, ``W_k``,
``W_v``, ``ca_layernorm``, ``value_head``) are the authors' so their checkpoints map one to one.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (as Llama/Qwen/Phi-3 do)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SkipCrossAttention(nn.Module):
    """Single-head cross-attention from text/last-layer states to image tokens, residual + RMSNorm.

    hidden: [B, L, H] last-layer hidden states (queries).
    image_tokens: [B, V, H] projected image tokens at the LLM input (keys and values).
    image_mask: [B, V] bool, True for real image tokens (images of a batch may differ in length).
    Returns [B, L, H] = RMSNorm(hidden + softmax(Q K^T / sqrt(H)) V).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.W_q = nn.Linear(hidden_size, hidden_size, bias=False)
        self.W_k = nn.Linear(hidden_size, hidden_size, bias=False)
        self.W_v = nn.Linear(hidden_size, hidden_size, bias=False)
        self.ca_layernorm = RMSNorm(hidden_size, eps=eps)
        self.hidden_size = hidden_size

    def reset_parameters(self) -> None:
        # the authors' initialisation: N(0, 1/(H+1)) for the three projections
        for layer in (self.W_q, self.W_k, self.W_v):
            nn.init.normal_(layer.weight, mean=0.0, std=1.0 / (self.hidden_size + 1))

    def attend(self, hidden: torch.Tensor, image_tokens: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output alone (before the residual and the norm)."""
        if hidden.dim() != 3 or image_tokens.dim() != 3 or hidden.shape[0] != image_tokens.shape[0]:
            raise ValueError(
                f"SkipCA needs hidden [B, L, H] and image tokens [B, V, H] with the same B; "
                f"got {tuple(hidden.shape)} and {tuple(image_tokens.shape)}"
            )
        image_tokens = image_tokens.to(hidden.dtype)
        queries, keys, values = self.W_q(hidden), self.W_k(image_tokens), self.W_v(image_tokens)
        scores = queries @ keys.transpose(1, 2) / math.sqrt(self.hidden_size)
        if image_mask is not None:
            scores = scores.masked_fill(~image_mask.bool()[:, None, :], torch.finfo(scores.dtype).min)
        return torch.softmax(scores.float(), dim=-1).to(values.dtype) @ values

    def forward(self, hidden: torch.Tensor, image_tokens: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.ca_layernorm(hidden + self.attend(hidden, image_tokens, image_mask))


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] index of the last attended position of each row; right for left AND right padding."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, L], got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.long()
    if (mask.sum(1) == 0).any():
        raise ValueError("attention_mask has a row with no attended token; nothing to read the reward from")
    length = mask.shape[1]
    return length - 1 - mask.flip(1).argmax(1)


def read_last_token(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values [B, L, D] -> [B, D] at each row's last attended token (the EOS the input ends with)."""
    index = last_token_index(attention_mask).to(values.device)
    return values[torch.arange(values.shape[0], device=values.device), index]


def preference_probability(reward_a: torch.Tensor, reward_b: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """Bradley-Terry P(a > b) = sigmoid((r_a - r_b) / tau)."""
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    return torch.sigmoid((reward_a - reward_b) / tau)


def general_preference_probability(reward_a: torch.Tensor, reward_b: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """The general preference model with 2-d rewards (the authors' GPM checkpoints):
    P(a > b) = sigmoid((a0 * b1 - a1 * b0) / tau); skew-symmetric, so P(a > b) = 1 - P(b > a)."""
    if reward_a.shape[-1] != 2 or reward_b.shape[-1] != 2:
        raise ValueError(f"general preference rewards must be 2-d vectors, got {tuple(reward_a.shape)}")
    return torch.sigmoid((reward_a[..., 0] * reward_b[..., 1] - reward_a[..., 1] * reward_b[..., 0]) / tau)


class MLPHead(nn.Module):
    """The scoring MLP of CLIP/BLIP-backbone reward models (ImageReward / VP-Score style)."""

    def __init__(self, in_features: int, hidden: tuple[int, ...] = (256, 64), dropout: float = 0.1):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.GELU(), nn.Dropout(dropout)]
            width = size
        layers.append(nn.Linear(width, 1))
        self.layers = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features).squeeze(-1)
