"""SkipCA, RMSNorm, the final-token read-out and the preference probabilities."""

import math

import pytest
import torch

from rewards.reward_heads import (
    MLPHead,
    RMSNorm,
    SkipCrossAttention,
    general_preference_probability,
    last_token_index,
    preference_probability,
    read_last_token,
)


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(6, eps=1e-6)
    norm.weight.data = torch.arange(1.0, 7.0)
    x = torch.randn(2, 3, 6)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.arange(1.0, 7.0)
    assert torch.allclose(norm(x), expected, atol=1e-6)


def test_skipca_shapes_and_matches_hand_computation():
    torch.manual_seed(0)
    ca = SkipCrossAttention(8)
    ca.reset_parameters()
    hidden, image = torch.randn(2, 5, 8), torch.randn(2, 3, 8)
    out = ca(hidden, image)
    assert out.shape == (2, 5, 8)
    q, k, v = hidden @ ca.W_q.weight.T, image @ ca.W_k.weight.T, image @ ca.W_v.weight.T
    attn = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(8), dim=-1) @ v
    x = hidden + attn
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(out, expected, atol=1e-5)


def test_skipca_residual_path_survives_zero_attention():
    """With W_v = 0 the attention adds nothing: the output is RMSNorm(hidden) exactly."""
    torch.manual_seed(1)
    ca = SkipCrossAttention(4)
    torch.nn.init.zeros_(ca.W_v.weight)
    hidden = torch.randn(1, 3, 4)
    assert torch.allclose(ca(hidden, torch.randn(1, 2, 4)), ca.ca_layernorm(hidden), atol=1e-6)
    # and the gradient reaches the hidden states through the skip connection
    hidden.requires_grad_(True)
    ca(hidden, torch.randn(1, 2, 4)).sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_skipca_ignores_masked_image_tokens():
    torch.manual_seed(2)
    ca = SkipCrossAttention(8)
    hidden, image = torch.randn(2, 4, 8), torch.randn(2, 3, 8)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    changed = image.clone()
    changed[0, 2] = 100.0  # a padding token of row 0
    assert torch.allclose(ca(hidden, image, mask), ca(hidden, changed, mask), atol=1e-6)
    assert not torch.allclose(ca(hidden, image), ca(hidden, changed))


def test_skipca_rejects_mismatched_batches():
    with pytest.raises(ValueError, match="same B"):
        SkipCrossAttention(4)(torch.randn(2, 3, 4), torch.randn(3, 2, 4))


def test_value_read_at_last_attended_token_left_and_right_padding():
    values = torch.arange(2 * 5, dtype=torch.float32).view(2, 5, 1)
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    assert last_token_index(right).tolist() == [2, 4]
    assert last_token_index(left).tolist() == [4, 4]
    assert read_last_token(values, right).squeeze(-1).tolist() == [2.0, 9.0]
    assert read_last_token(values, left).squeeze(-1).tolist() == [4.0, 9.0]
    with pytest.raises(ValueError, match="no attended token"):
        last_token_index(torch.tensor([[0, 0, 0]]))


def test_preference_probabilities():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.9, 0.0])
    assert torch.allclose(preference_probability(a, b, tau=0.1), torch.tensor([1 / (1 + math.exp(-1.0)), 0.5]))
    with pytest.raises(ValueError):
        preference_probability(a, b, tau=0.0)
    ra, rb = torch.tensor([[0.3, -1.2]]), torch.tensor([[2.0, 0.5]])
    p = general_preference_probability(ra, rb, tau=0.1)
    expected = 1 / (1 + math.exp(-(0.3 * 0.5 - (-1.2) * 2.0) / 0.1))
    assert p.item() == pytest.approx(expected, rel=1e-5)
    assert (p + general_preference_probability(rb, ra, tau=0.1)).item() == pytest.approx(1.0)


def test_mlp_head_shape():
    assert MLPHead(10, (8, 4)).eval()(torch.randn(3, 10)).shape == (3,)
