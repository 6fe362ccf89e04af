"""The old policy of DiffusionNFT and AWM: a slowly moving copy of the trained weights (an exponential moving average).

It samples the rollouts (DiffusionNFT) or anchors the update (both), and moves towards the trained weights once per
epoch: ``old = decay·old + (1 - decay)·trained``, with the decay the objective's schedule gives for the optimiser step.
Evaluating the old policy swaps its tensors into the trained parameters' ``.data`` (no copy, no second model in
memory) and swaps them back. Under FSDP2 the parameters are shards whose storage FSDP all-gathers from, so there the
values are swapped in place instead (copies), and the old policy is sharded as the parameters are. Checkpoints hold it
(``state_dict``, whole tensors, so that a resumed run continues from the same old policy on any number of processes).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from align.train.sharding import fsdp_units


class OldPolicy:
    def __init__(self, params: list[torch.nn.Parameter], model: torch.nn.Module | None = None):
        self.params = list(params)
        self.tensors = [p.detach().clone() for p in self.params]
        self.sharded = any(isinstance(p, DTensor) for p in self.params)
        # FSDP2 keeps the root's gathered weights from a forward to its backward: a swap must drop every gathered
        # copy so that the next forward (or that backward) gathers the values swapped in.
        self.units = fsdp_units(model) if model is not None else []

    @contextlib.contextmanager
    def swapped_in(self):
        """The trained parameters hold the old policy's values inside the block."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for unit in self.units:
            unit.reshard()
        for p, old in zip(self.params, self.tensors):
            if self.sharded:
                kept = p.detach().clone()
                p.detach().copy_(old)
                old.copy_(kept)
            else:
                p.data, old.data = old.data, p.data

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """old ← decay·old + (1 - decay)·trained (decay 0: the old policy is the trained one)."""
        for p, old in zip(self.params, self.tensors):
            old.mul_(decay).add_(p.detach().to(old.dtype), alpha=1.0 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors (every process takes part in gathering the shards; accelerate writes the main one's)."""
        return {str(i): (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu() for i, t in enumerate(self.tensors)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if len(state) != len(self.tensors):
            raise ValueError(f"the checkpoint's old policy holds {len(state)} tensors, the model {len(self.tensors)}")
        for i, t in enumerate(self.tensors):
            whole = state[str(i)].to(t.dtype)
            if isinstance(t, DTensor):
                whole = distribute_tensor(whole.to(t.device), t.device_mesh, t.placements)
            t.copy_(whole)
