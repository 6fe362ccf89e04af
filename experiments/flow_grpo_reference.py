"""Reference values for Flow-GRPO as its authors run it today, computed by their own code on small seeded tensors.

    python -m experiments.flow_grpo_reference --authors DIR [--out tests/data]

DIR holds four files of yifan123/flow_grpo (main), unchanged; their sha256 is checked before anything runs:
    sd3_sde_with_logprob.py   flow_grpo/diffusers_patch/sd3_sde_with_logprob.py @ 54809b5fcf4d3930d2a17fa553928704bd0b719e
    stat_tracking.py          flow_grpo/stat_tracking.py @ 94e23ee5405ab7241fc1f75d30cac8147e2b1f53
    train_sd3.py              scripts/train_sd3.py @ 74db69191de9a0a54869c9c3341ce4b54db7005f
    train_sd3_fast.py         scripts/train_sd3_fast.py @ 74db69191de9a0a54869c9c3341ce4b54db7005f
Nothing is read from the local mirror (/work/.mirror/yifan123+flow_grpo, a 2025-07 snapshot at ac4c86e): there the
step function has no CPS branch and compute_log_prob still detaches the unconditional half. The four files were
saved from the stored versions of the public code index (its read_file tool; each file's character count equals
the stored one, and where a file's text is unchanged from the mirror's it diffs clean against it) into a cache
outside the repository (/tmp/flow_grpo_authors when the pinned values were made).

What runs, on CPU in float32 as the authors compute (their step function casts to float32):
- sd3_sde_with_logprob.py, executed whole (it imports torch and diffusers only): ``sde_step_with_logprob`` with a
  real ``FlowMatchEulerDiscreteScheduler(shift=3.0)`` (SD3.5's) after ``set_timesteps(10)`` as ``self``, for
  ``sde_type`` "sde" (noise level 0.7) and "cps" (0.8, their CPS configs'), each sample at its own step (σ = 1 and
  the last step included): drawing the next latents (``prev_sample=None``, a seeded generator whose draws are
  recorded as ``noise``) and scoring them under a perturbed velocity (``prev_sample=...``).
- stat_tracking.py, executed whole: ``PerPromptStatTracker(global_std=True)`` and ``(global_std=False)``'s
  ``update`` on a batch of float32 rewards (the trainer's dtype) with a tied group of 0.5s, a tied group of 0.1s,
  a one-sample group and untied groups, in 1-D and in the trainer's [N, T] repeated form; and on float64 rewards
  with a tied group of 0.1s, whose mean is not exact (float dust in the authors' advantages).
- train_sd3.py / train_sd3_fast.py cannot be imported here (absl, wandb, accelerate, the authors' package): their
  source is parsed and only these parts run, as written:
  * ``compute_log_prob`` (the function; train_sd3.py's always takes the SDE step, train_sd3_fast.py's passes
    ``config.sample.sde_type``);
  * the zero-advantage filter: the lines from "# Get the mask for samples ..." to
    "mask[false_indices[random_indices]] = True", on ``samples = {"advantages": [N, T]}`` with torch's global RNG
    seeded;
  * the update of one step: the lines from the ``with autocast():`` inside ``with accelerator.accumulate(...)`` to
    ``info["loss"].append(loss)``, with ``autocast = contextlib.nullcontext``, ``info = defaultdict(list)``, a
    config namespace, and a stand-in ``transformer`` that returns recorded leaf tensors as the unconditional and
    conditional halves of its output (the reference model's halves inside ``transformer.module.disable_adapter()``)
    after checking that it was called as the authors call it (latents twice, negative prompt rows first). The loss
    is then back-propagated to the two halves. Advantages are float64 there, as in the trainer (numpy's).

Writes flow_grpo_reference.json into --out (tests/test_flow_grpo_reference.py reads it). Float32 values are written
as the exact decimal of each float.

Side environment for the pinned values: this project's Python (torch 2.13.0+cpu, diffusers 0.42.1, numpy 2.4.6).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import textwrap
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

AUTHORS_FILES = {  # name in DIR: (path in yifan123/flow_grpo, commit, sha256 of the file)
    "sd3_sde_with_logprob.py": ("flow_grpo/diffusers_patch/sd3_sde_with_logprob.py",
                                "54809b5fcf4d3930d2a17fa553928704bd0b719e",
                                "87d1abd174ded09097a14e65b404f0dca33d22d4a90d45ed6c9efb5c18c1ee96"),
    "stat_tracking.py": ("flow_grpo/stat_tracking.py", "94e23ee5405ab7241fc1f75d30cac8147e2b1f53",
                         "def0eb52cbea9a24654707cb41c005f46bbf565b9040ef8e29c2e8eee1511773"),
    "train_sd3.py": ("scripts/train_sd3.py", "74db69191de9a0a54869c9c3341ce4b54db7005f",
                     "aa298bc4f000e8c14c8ec7a3362c3621f18d116855d70dfd0e8ef95c4aa8afdc"),
    "train_sd3_fast.py": ("scripts/train_sd3_fast.py", "74db69191de9a0a54869c9c3341ce4b54db7005f",
                          "431e7c14993d319b47e5e35d52cf0ae5b6083f35031b0002231f5ed81dcc0a88"),
}
NUM_STEPS = 10
SHIFT = 3.0  # SD3.5's scheduler
LATENT_SHAPE = (3, 4, 4)  # [C, H, W] of the small latents


# ---------------------------------------------------------------- loading the authors' code


def read_authors(folder: Path) -> dict[str, str]:
    sources = {}
    for name, (path, commit, digest) in AUTHORS_FILES.items():
        data = (folder / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit(f"{folder / name} is not yifan123/flow_grpo {path} @ {commit[:7]} (sha256 differs)")
        sources[name] = data.decode()
    return sources


def execute(source: str, name: str, namespace: dict | None = None) -> dict:
    namespace = {"__name__": f"flow_grpo_{name}", **(namespace or {})}
    exec(compile(source, name, "exec"), namespace)
    return namespace


def function_source(source: str, name: str) -> str:
    """The exact source of a top-level function."""
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(source, node)


def lines_between(source: str, first: str, last: str, after: str | None = None) -> str:
    """The lines from the first one reading ``first`` (after the line reading ``after``) to the next reading
    ``last``, both included (stripped lines compared), dedented."""
    lines = source.splitlines()
    begin = 0 if after is None else next(i for i, line in enumerate(lines) if line.strip() == after)
    start = next(i for i in range(begin, len(lines)) if lines[i].strip() == first)
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == last)
    return textwrap.dedent("\n".join(lines[start : end + 1])) + "\n"


def mask_block(train_source: str) -> str:
    return lines_between(train_source, "# Get the mask for samples where all advantages are zero across the time "
                         "dimension", "mask[false_indices[random_indices]] = True")


def update_block(train_source: str) -> str:
    return lines_between(train_source, "with autocast():", 'info["loss"].append(loss)',
                         after="with accelerator.accumulate(transformer):")


def scheduler() -> FlowMatchEulerDiscreteScheduler:
    s = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SHIFT)
    s.set_timesteps(NUM_STEPS)
    return s


def floats(t) -> list:
    """Exact decimals of a tensor's values (float32 widened to float64 loses nothing)."""
    return torch.as_tensor(t).detach().double().tolist()


# ---------------------------------------------------------------- step maths


def step_cases(step_fn, sched) -> dict:
    cases = {}
    for sde_type, noise_level, seed in (("sde", 0.7, 11), ("cps", 0.8, 12)):
        steps = [0, 1, 4, 7, 9]  # σ = 1 (σ_max in the SDE's denominator) ... the last step (σ_next = 0)
        g = torch.Generator().manual_seed(seed)
        shape = (len(steps), *LATENT_SHAPE)
        sample = torch.randn(shape, generator=g)
        velocity = torch.randn(shape, generator=g)
        velocity_2 = velocity + 0.1 * torch.randn(shape, generator=g)
        timesteps = sched.timesteps[steps]
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 100))  # what the call below draws
        prev, log_prob, mean, std_dev_t, sqrt_dt = step_fn(
            sched, velocity, timesteps, sample, noise_level=noise_level,
            generator=torch.Generator().manual_seed(seed + 100), sde_type=sde_type, return_sqrt_dt=True)
        _, log_prob_2, mean_2, _ = step_fn(sched, velocity_2, timesteps, sample, noise_level=noise_level,
                                           prev_sample=prev, sde_type=sde_type)
        cases[sde_type] = {
            "noise_level": noise_level, "step_indices": steps, "sample": floats(sample), "velocity": floats(velocity),
            "noise": floats(noise), "prev_sample": floats(prev), "log_prob": floats(log_prob), "mean": floats(mean),
            "std_dev_t": floats(std_dev_t.flatten()), "sqrt_dt": floats(sqrt_dt.flatten()),
            "velocity_2": floats(velocity_2), "log_prob_2": floats(log_prob_2), "mean_2": floats(mean_2),
        }
    return cases


# ---------------------------------------------------------------- advantages and the zero-advantage filter


def advantage_cases(tracker_cls) -> dict:
    rng = np.random.default_rng(5)
    groups = {"a": rng.uniform(0, 1, 4), "b": np.full(4, 0.5), "c": np.full(3, 0.1), "d": rng.uniform(0, 1, 1),
              "e": rng.uniform(0, 1, 5)}
    prompts = [p for p, rewards in groups.items() for _ in rewards]
    rewards = np.concatenate(list(groups.values())).astype(np.float32)  # the trainer's rewards are float32
    order = rng.permutation(len(prompts))
    prompts, rewards = [prompts[i] for i in order], rewards[order]
    repeated = np.repeat(rewards[:, None], 3, axis=1)  # the trainer's [N, num_train_timesteps] form
    out = {"prompts": prompts, "rewards": rewards.astype(np.float64).tolist()}
    out["global_std"] = tracker_cls(True).update(prompts, rewards).tolist()
    out["global_std_repeated"] = tracker_cls(True).update(prompts, repeated).tolist()
    out["group_std"] = tracker_cls(False).update(prompts, rewards).tolist()
    float64_prompts = ["c", "c", "c", "x", "y", "x"]
    float64_rewards = np.array([0.1, 0.1, 0.1, 0.3, 0.7, 0.2])  # float64: the mean of three 0.1s is not 0.1
    out["float64"] = {"prompts": float64_prompts, "rewards": float64_rewards.tolist(),
                      "global_std": tracker_cls(True).update(float64_prompts, float64_rewards).tolist()}
    return out


def mask_cases(train_sources: dict[str, str]) -> list[dict]:
    blocks = {name: mask_block(source) for name, source in train_sources.items()}
    cases = []
    for name, n, nonzero, num_batches, seed in (("top_up", 12, [0, 2, 3, 5, 8, 9, 11], 4, 0),
                                                ("divisible", 12, [0, 1, 2, 4, 6, 7, 9, 10], 4, 1),
                                                ("top_up_many", 16, [3, 7, 12], 8, 2),
                                                ("all_zero", 8, [], 2, 3)):
        advantages = torch.zeros(n, dtype=torch.float64)
        advantages[nonzero] = torch.linspace(-1.5, 2.0, len(nonzero), dtype=torch.float64)
        advantages = advantages[:, None].repeat(1, 2)  # [N, T], as the trainer's
        case = {"name": name, "advantages": advantages.tolist(), "num_batches": num_batches, "seed": seed}
        for script, block in blocks.items():
            torch.manual_seed(seed)
            config = SimpleNamespace(sample=SimpleNamespace(num_batches_per_epoch=num_batches))
            namespace = execute(block, f"{script}:mask", {"torch": torch, "config": config,
                                                          "samples": {"advantages": advantages.clone()}})
            case[f"mask_{Path(script).stem}"] = namespace["mask"].tolist()
        cases.append(case)
    return cases


# ---------------------------------------------------------------- the update's loss and its gradient


class RecordedTransformer:
    """Stands in for the SD3 transformer: returns recorded halves, after checking how it was called."""

    def __init__(self, latents, timesteps, policy, reference, cfg: bool):
        self.latents, self.timesteps, self.policy, self.reference, self.cfg = latents, timesteps, policy, reference, cfg
        self.module = self  # accelerate's wrapper: the authors call transformer.module.disable_adapter()
        self.adapter_off = False

    @contextlib.contextmanager
    def disable_adapter(self):
        self.adapter_off = True
        try:
            yield
        finally:
            self.adapter_off = False

    def __call__(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict):
        uncond, text = self.reference if self.adapter_off else self.policy
        batch = len(self.latents)
        if not self.cfg:
            assert torch.equal(hidden_states, self.latents) and torch.equal(timestep, self.timesteps)
            return (text,)
        assert torch.equal(hidden_states, torch.cat([self.latents] * 2))
        assert torch.equal(timestep, torch.cat([self.timesteps] * 2))
        # the negative prompt's rows come first (marked 0), so the first chunk is the unconditional half
        assert encoder_hidden_states.flatten().tolist() == [0.0] * batch + [1.0] * batch
        return (torch.cat([uncond, text]),)


LOSS_CASES = (  # name, script, sde_type, cfg, beta, noise level, clip range, step of each sample, seed
    ("sde_cfg_kl", "train_sd3.py", "sde", True, 0.04, 0.7, 1e-4, [0, 2, 5, 8, 3, 6], 21),
    ("cps_cfg_kl", "train_sd3_fast.py", "cps", True, 0.04, 0.8, 1e-5, [1, 3, 4, 7, 2, 6], 22),
    ("cps_nocfg", "train_sd3_fast.py", "cps", False, 0.0, 0.8, 1e-5, [0, 1, 2, 3, 4, 2], 23),
)
GUIDANCE = 4.5
ADV_CLIP_MAX = 5.0
ADVANTAGES = [1.3, -0.7, -1.5, 6.5, 0.0, 2.0]  # 6.5 is clipped to 5; 0.0 is a kept zero-advantage sample
# old log-prob = current + offset·clip_range: ratios 1, inside, above 1+c (A<0: unclipped; A>0: clipped), below 1-c
RATIO_OFFSETS = [0.0, 0.4, -5.0, 30.0, 0.0, -5.0]


def loss_cases(sources: dict[str, str], step_fn, sched) -> list[dict]:
    cases = []
    for name, script, sde_type, cfg, beta, noise_level, clip_range, steps, seed in LOSS_CASES:
        g = torch.Generator().manual_seed(seed)
        shape = (len(steps), *LATENT_SHAPE)
        latents = torch.randn(shape, generator=g)
        old_uncond, old_text = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        timesteps = sched.timesteps[steps]
        old_velocity = old_uncond + GUIDANCE * (old_text - old_uncond) if cfg else old_text
        with torch.no_grad():  # the sampler's draw of the stored next latents
            next_latents = step_fn(sched, old_velocity, timesteps, latents, noise_level=noise_level, generator=g,
                                   sde_type=sde_type)[0]
        uncond = (old_uncond + 0.05 * torch.randn(shape, generator=g)).requires_grad_(cfg)
        text = (old_text + 0.05 * torch.randn(shape, generator=g)).requires_grad_(True)
        ref_uncond = old_uncond + 0.03 * torch.randn(shape, generator=g)
        ref_text = old_text + 0.03 * torch.randn(shape, generator=g)

        namespace = execute(function_source(sources[script], "compute_log_prob"), f"{script}:compute_log_prob",
                            {"torch": torch, "sde_step_with_logprob": step_fn})
        compute_log_prob = namespace["compute_log_prob"]
        transformer = RecordedTransformer(latents, timesteps, (uncond, text), (ref_uncond, ref_text), cfg)
        batch = len(steps)
        embeds = torch.cat([torch.zeros(batch, 1, 1), torch.ones(batch, 1, 1)]) if cfg else torch.ones(batch, 1, 1)
        config = SimpleNamespace(
            train=SimpleNamespace(cfg=cfg, beta=beta, adv_clip_max=ADV_CLIP_MAX, clip_range=clip_range),
            sample=SimpleNamespace(guidance_scale=GUIDANCE, noise_level=noise_level, sde_type=sde_type))
        sample = {"latents": latents[:, None], "next_latents": next_latents[:, None], "timesteps": timesteps[:, None]}
        with torch.no_grad():
            pipeline = SimpleNamespace(scheduler=sched)
            current = compute_log_prob(transformer, pipeline, sample, 0, embeds, embeds, config)[1]
        old_log_probs = current - torch.tensor(RATIO_OFFSETS) * clip_range
        advantages = torch.tensor(ADVANTAGES, dtype=torch.float64)  # numpy's float64, as in the trainer
        sample.update(log_probs=old_log_probs[:, None], advantages=advantages[:, None])

        namespace = execute(update_block(sources[script]), f"{script}:update", {
            "torch": torch, "autocast": contextlib.nullcontext, "compute_log_prob": compute_log_prob,
            "transformer": transformer, "pipeline": SimpleNamespace(scheduler=sched), "sample": sample, "j": 0,
            "embeds": embeds, "pooled_embeds": embeds, "config": config, "info": defaultdict(list)})
        loss = namespace["loss"]
        loss.backward()
        info = namespace["info"]
        cases.append({
            "name": name, "script": script, "sde_type": sde_type, "cfg": cfg, "beta": beta, "noise_level": noise_level,
            "clip_range": clip_range, "adv_clip_max": ADV_CLIP_MAX, "guidance_scale": GUIDANCE,
            "step_indices": steps, "latents": floats(latents), "next_latents": floats(next_latents),
            "old_log_probs": floats(old_log_probs), "advantages": advantages.tolist(),
            "noise_pred_uncond": floats(uncond) if cfg else None, "noise_pred_text": floats(text),
            "ref_noise_pred_uncond": floats(ref_uncond) if cfg else None, "ref_noise_pred_text": floats(ref_text),
            "loss": loss.item(), "policy_loss": namespace["policy_loss"].item(),
            "kl_loss": namespace["kl_loss"].item() if beta > 0 else None,
            "log_prob": floats(namespace["log_prob"]), "prev_sample_mean": floats(namespace["prev_sample_mean"]),
            "std_dev_t": floats(namespace["std_dev_t"].flatten()),
            "approx_kl": info["approx_kl"][0].item(), "clipfrac": info["clipfrac"][0].item(),
            "grad_noise_pred_uncond": floats(uncond.grad) if cfg else None, "grad_noise_pred_text": floats(text.grad),
        })
    return cases


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--authors", type=Path, required=True, help="folder holding the four authors' files (see above)")
    p.add_argument("--out", type=Path, default=Path("tests/data"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sources = read_authors(args.authors)
    step_fn = execute(sources["sd3_sde_with_logprob.py"], "sd3_sde_with_logprob")["sde_step_with_logprob"]
    tracker_cls = execute(sources["stat_tracking.py"], "stat_tracking")["PerPromptStatTracker"]
    sched = scheduler()
    reference = {
        "authors": {name: {"path": path, "commit": commit} for name, (path, commit, _) in AUTHORS_FILES.items()},
        "scheduler": {"shift": SHIFT, "num_steps": NUM_STEPS, "sigmas": floats(sched.sigmas),
                      "timesteps": floats(sched.timesteps)},
        "steps": step_cases(step_fn, sched),
        "advantages": advantage_cases(tracker_cls),
        "kept_masks": mask_cases({name: sources[name] for name in ("train_sd3.py", "train_sd3_fast.py")}),
        "losses": loss_cases(sources, step_fn, sched),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "flow_grpo_reference.json"
    path.write_text(json.dumps(reference) + "\n")
    for case in reference["losses"]:
        print(f"{case['name']}: loss {case['loss']:.6g}, policy {case['policy_loss']:.6g}, kl {case['kl_loss']}, "
              f"clipfrac {case['clipfrac']:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
