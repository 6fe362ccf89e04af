"""Training: the trainers (Diffusion-DPO, DDPO/Flow-GRPO, reward models), their options over one base, the objectives
as pure maths, and what every trainer's run shares (command, accelerator, checkpoints, held-out evaluation, report)."""
