"""The cost guard for paid API judges: before a run asks one anything, say how many calls it will make and about
what they cost, and refuse above --max_api_cost (default 5 USD) unless the user raises it.

The estimate is deliberately on the high side: it counts every call the run can make (a resumed run's re-asked
questions, which its judge-answer cache answers, are free in fact); calls whose answers are in the cache already
are subtracted where the questions are known before the run (the judge benchmark's fixed images). The tokens per
call are rough (rewards.api.ESTIMATED_*); the judge prints the real count when it closes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from align.cli import ConfigError
from align.data.feedback import pairwise_scheme


@dataclass
class JudgeCalls:
    """What one judge will be asked: images to score and pairs to compare, and what for."""

    judge: object
    what: str
    scores: int = 0
    comparisons: int = 0
    cached: int = 0  # of those calls, already answered in the judge's cache (free)


def is_paid(judge) -> bool:
    """An API judge (rewards.api.ApiJudge) knows its calls and their price; other judges run locally."""
    return callable(getattr(judge, "estimated_call_usd", None))


def estimate(plan: JudgeCalls) -> tuple[int, float, str]:
    """(calls to pay for, estimated USD, where the price comes from) for one judge's plan."""
    calls, images_per_call = plan.judge.calls_for(scores=plan.scores, comparisons=plan.comparisons)
    paid = max(0, calls - plan.cached)
    _, source = plan.judge.estimate_price_per_mtok()
    return paid, paid * plan.judge.estimated_call_usd(images_per_call), source


def guard_api_cost(plans: list[JudgeCalls], max_usd: float, verbose: bool = True) -> float:
    """Print each paid judge's calls and estimated cost; raise ConfigError (one line) above ``max_usd``.

    Returns the estimated total in USD (0 when no judge is paid)."""
    plans = [plan for plan in plans if is_paid(plan.judge)]
    total_calls, total_usd = 0, 0.0
    for plan in plans:
        calls, usd, source = estimate(plan)
        total_calls, total_usd = total_calls + calls, total_usd + usd
        if verbose:
            cached = f" ({plan.cached:,} more answered by the cache, free)" if plan.cached else ""
            print(f"[api cost] {plan.judge.name}: {calls:,} calls for {plan.what}{cached}, estimated ${usd:.2f} "
                  f"({source})", flush=True)
    if plans and verbose:
        print(f"[api cost] in all: {total_calls:,} paid calls, estimated ${total_usd:.2f} (an estimate on the high side; "
              f"limit --max_api_cost {max_usd:g} USD)", flush=True)
    if total_usd > max_usd:
        raise ConfigError(
            f"the paid judge calls ({total_calls:,}) are estimated at ${total_usd:.2f}, above --max_api_cost "
            f"{max_usd:g} USD; raise --max_api_cost to run them (no judge was asked anything)"
        )
    return total_usd


def evaluation_images(eval_prompts: int, images_per_prompt: int, rounds: int) -> int:
    """Images the held-out evaluation scores: before, after and each periodic evaluation (``rounds`` in all)."""
    return eval_prompts * images_per_prompt * rounds


def evaluation_rounds(every: int, total: int, before: bool = True) -> int:
    """How many times the held-out prompts are scored: before (unless resumed), after, and every ``every`` steps."""
    periodic = (total - 1) // every if every > 0 else 0
    return int(before) + 1 + periodic


def dpo_api_plan(config, judge, eval_judge, feedback_prompts: int, eval_prompts: int) -> list[JudgeCalls]:
    """Diffusion-DPO with AI feedback: each prompt's K images scored (pointwise judge) or its adjacent pairs
    compared (pairwise judge), in every round; plus the held-out evaluation's images."""
    plans = []
    if judge is not None:
        if judge.pointwise:
            plans.append(JudgeCalls(judge, "the feedback", scores=feedback_prompts * config.images_per_prompt))
        else:
            plans.append(JudgeCalls(judge, "the feedback",
                                    comparisons=feedback_prompts * len(pairwise_scheme(config.images_per_prompt))))
    if eval_judge is not None:
        rounds = evaluation_rounds(config.eval_every_steps, config.max_steps)
        plans.append(JudgeCalls(eval_judge, "the held-out evaluation",
                                scores=evaluation_images(eval_prompts, config.eval_images_per_prompt, rounds)))
    return plans


def ddpo_api_plan(config, reward_members, eval_members, eval_prompts: int) -> list[JudgeCalls]:
    """DDPO: every epoch's samples scored, or compared in every pair within their prompt's group (at least
    samples x (K - 1) / 2 comparisons: more when a prompt is drawn twice in a batch); plus the evaluation."""
    plans = []
    images = config.samples_per_epoch * config.num_epochs
    for member in reward_members:
        if member.pairwise:
            plans.append(JudgeCalls(member.judge, f"the rewards of {config.num_epochs} epochs",
                                    comparisons=images * (config.images_per_prompt - 1) // 2))
        else:
            plans.append(JudgeCalls(member.judge, f"the rewards of {config.num_epochs} epochs", scores=images))
    rounds = evaluation_rounds(config.eval_every_epochs, config.num_epochs)
    for member in eval_members:
        plans.append(JudgeCalls(member.judge, "the held-out evaluation",
                                scores=evaluation_images(eval_prompts, config.eval_images_per_prompt, rounds)))
    return plans


def evaluate_api_plan(judges: dict, num_models: int, samples: int) -> list[JudgeCalls]:
    """align.eval.evaluate: a pointwise judge scores every model's samples; a pairwise one compares every two models on
    every sample (win rates), both orders where the judge asks both."""
    plans = []
    for judge in judges.values():
        if judge.pointwise:
            plans.append(JudgeCalls(judge, f"{num_models} models x {samples} images", scores=num_models * samples))
        else:
            pairs = num_models * (num_models - 1) // 2
            plans.append(JudgeCalls(judge, f"{pairs} model pairs x {samples} images", comparisons=pairs * samples))
    return plans


def best_of_n_api_plan(selector, others: dict, num_prompts: int, n: int, curve_points: int, zero_order: bool) -> list[JudgeCalls]:
    """align.eval.best_of_n: the selector scores all N candidates per prompt (a pairwise selector runs a knockout, N - 1
    comparisons), zero-order search scores up to N more; the other judges score every candidate, or (pairwise)
    compare each curve point's pick with the N = 1 pick."""
    candidates = num_prompts * n
    if selector.pointwise:
        plans = [JudgeCalls(selector, "selecting", scores=candidates * (2 if zero_order else 1))]
    else:
        plans = [JudgeCalls(selector, "the knockout", comparisons=num_prompts * (n - 1))]
    for judge in others.values():
        if judge.pointwise:
            plans.append(JudgeCalls(judge, "scoring the candidates", scores=candidates))
        else:
            plans.append(JudgeCalls(judge, "the win-rate curve", comparisons=num_prompts * curve_points))
    return plans


def guard_on_every_process(accelerator, plans: list[JudgeCalls], max_usd: float) -> float:
    """guard_api_cost where only the main process holds some judges (DDPO's evaluation judge): every process
    learns the main one's verdict, so none waits at a barrier for a process that has stopped."""
    error = None
    try:
        total = guard_api_cost(plans, max_usd, verbose=accelerator.is_main_process)
    except ConfigError as err:
        error, total = err, float("nan")
    refused = accelerator.gather(torch.tensor([1.0 if error else 0.0], device=accelerator.device)).max()
    if refused > 0:
        raise error or ConfigError("the API cost guard refused this run on another process (its message is above)")
    return total
