"""The online-RL trainer's samplers, one line per sampler file: the table that --sampler, its --help, the config
checks and the trainer read. A new sampler is a file of align/sampling/ with its ``ENTRIES`` and one line here."""

from __future__ import annotations

from align.sampling import dance_sampler, ddim_sampler, flow_ode_sampler, flow_sde_sampler, mix_sampler
from align.sampling.base import SamplerEntry

SAMPLERS: tuple[SamplerEntry, ...] = (
    *ddim_sampler.ENTRIES,
    *flow_sde_sampler.ENTRIES,
    *flow_ode_sampler.ENTRIES,
    *dance_sampler.ENTRIES,
    *mix_sampler.ENTRIES,
)


# The samplers' own option dataclasses, which the online-RL trainer's config inherits.
SAMPLER_OPTIONS: tuple[type, ...] = tuple(dict.fromkeys(e.options for e in SAMPLERS if e.options is not None))


def sampler_names(flow: bool | None = None) -> list[str]:
    """The --sampler values, of one kind of family (``flow``) or of all, in the table's order."""
    return list(dict.fromkeys(e.name for e in SAMPLERS if flow is None or e.flow == flow))


def sampler_entry(name: str, flow: bool) -> SamplerEntry | None:
    """The entry of --sampler ``name`` for flow-matching (``flow``) or DDPM families; None if it has none."""
    return next((e for e in SAMPLERS if e.name == name and e.flow == flow), None)
