"""--dry_run: the per-process memory of the run a config describes, under DDP and FSDP2, printed before anything
is loaded, trained or written (the model's parts are built on the meta device from their config files)."""

from __future__ import annotations

import os

from align.train.accelerator import launched_processes
from align.train.memory_model import plan_run, scheme_quantization
from align.train.memory_plan import choices_table, plan_table
from align.train.quantization import CHOICES, NONE

PROCESS_COUNTS = (1, 2, 4, 8)


def print_memory_plan(config) -> None:
    """Count the model of a checked config from its config files, print the table (the first process only)."""
    planned = plan_run(config)
    if os.environ.get("RANK", "0") != "0":
        return
    launched = launched_processes()
    counts = sorted(set(PROCESS_COUNTS) | {launched})
    print(f"[dry run] {planned.summary}")
    quantized_base = getattr(config, "quantize_base", NONE) != NONE  # refused under FSDP2: no FSDP2 columns
    print(plan_table(planned.shape, counts, sharded=not quantized_base))
    print(f"[dry run] one process{'' if launched == 1 else f' of {launched}'} by --quantize_base (and "
          "--quantize_text_encoders) and --offload, the rest as configured:")
    print(choices_table(planned.shape, {name: scheme_quantization(name) for name in CHOICES}, launched))
    print(f"[dry run] this launch: {launched} process{'es' if launched > 1 else ''}; nothing was trained or written "
          "(what is counted and assumed: docs/scale.md#the-memory-planner)", flush=True)
