"""Per-task tables of judges that define their own breakdown (GenEval: accuracy per task and the mean of the
task accuracies as the overall score, as GenEval's summary_scores.py prints them).

A judge offers one by a ``breakdown(prompts, scores) -> {"tasks": {task: {"correct", "images", "accuracy"}},
"overall": float}`` method; evaluation stores it per model and shows it beside the judge's usual numbers.
"""

from __future__ import annotations

import numpy as np


def task_breakdown(judge, prompts: list[str], scores: np.ndarray | None, names: list[str]) -> dict | None:
    """{model: breakdown} for a pointwise judge that has ``breakdown``; None otherwise."""
    breakdown = getattr(judge, "breakdown", None)
    if breakdown is None or scores is None:
        return None
    tables = {name: breakdown(prompts, [float(v) for v in scores[i]]) for i, name in enumerate(names)}
    return tables if all(t is not None for t in tables.values()) else None


def task_rows(tasks: dict) -> list[dict]:
    """One row per task (models as columns, accuracy in [0, 1]), then the overall score."""
    names = list(tasks)
    order = list(dict.fromkeys(t for name in names for t in tasks[name]["tasks"]))
    rows = []
    for task in order:
        row = {"task": task, "images": tasks[names[0]]["tasks"].get(task, {}).get("images", 0)}
        row.update({name: tasks[name]["tasks"].get(task, {}).get("accuracy") for name in names})
        rows.append(row)
    rows.append({"task": "overall (mean of tasks)", "images": sum(r["images"] for r in rows),
                 **{name: tasks[name]["overall"] for name in names}})
    return rows


def format_task_table(spec: str, tasks: dict) -> str:
    """The table as text lines for the terminal."""
    rows = task_rows(tasks)
    names = list(tasks)
    lines = [f"  {spec} per task: " + ", ".join(names)]
    for row in rows:
        values = ", ".join("-" if row[n] is None else f"{row[n]:.2%}" for n in names)
        lines.append(f"    {row['task']:<24} {values}  ({row['images']} images)")
    return "\n".join(lines)
