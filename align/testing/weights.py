"""Comparing trained weights across process layouts (N processes against one with N x accumulation, or sharded)."""

from __future__ import annotations

import torch


def assert_weights_close(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Equal within float tolerance, robustly: all-reduce and reduce-scatter sum in another order than accumulation,
    and Adam divides a near-zero gradient by its own size, so a rare element may move by up to the learning rate.
    Fewer than 2% of the elements may be off by more than 2e-5 + 1e-3 relative, and the difference's norm stays under
    1e-3 of the weights'; another order of samples or noise moves most elements by about the learning rate."""
    assert expected.keys() == actual.keys()
    a = torch.cat([expected[k].flatten().double() for k in sorted(expected)])
    b = torch.cat([actual[k].flatten().double() for k in sorted(expected)])
    off = (b - a).abs() > 2e-5 + 1e-3 * a.abs()
    assert off.float().mean() < 0.02, f"{int(off.sum())} of {off.numel()} weights differ"
    assert (b - a).norm() < 1e-3 * a.norm()
