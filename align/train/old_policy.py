"""The old policy of DiffusionNFT and AWM: a slowly moving copy of the trained weights (an exponential moving average).

It samples the rollouts (DiffusionNFT) or anchors the update (both), and moves towards the trained weights once per
epoch: ``old = decay·old + (1 - decay)·trained``, with the decay the objective's schedule gives for the optimiser step.
Evaluating the old policy swaps its tensors into the trained parameters' ``.data`` (no copy, no second model in
memory) and swaps them back. Checkpoints hold it (``state_dict``), so a resumed run continues from the same old policy.
"""

from __future__ import annotations

import contextlib

import torch


class OldPolicy:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = list(params)
        self.tensors = [p.detach().clone() for p in self.params]

    @contextlib.contextmanager
    def swapped_in(self):
        """The trained parameters hold the old policy's values inside the block."""
        for p, old in zip(self.params, self.tensors):
            p.data, old.data = old.data, p.data
        try:
            yield
        finally:
            for p, old in zip(self.params, self.tensors):
                p.data, old.data = old.data, p.data

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """old ← decay·old + (1 - decay)·trained (decay 0: the old policy is the trained one)."""
        for p, old in zip(self.params, self.tensors):
            old.mul_(decay).add_(p.detach().to(old.dtype), alpha=1.0 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(i): t.detach().cpu() for i, t in enumerate(self.tensors)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if len(state) != len(self.tensors):
            raise ValueError(f"the checkpoint's old policy holds {len(state)} tensors, the model {len(self.tensors)}")
        for i, t in enumerate(self.tensors):
            t.copy_(state[str(i)])
