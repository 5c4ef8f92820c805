"""A model set planned against one budget: each model's plan, the process overhead charged once, whether the
set fits loaded all at once or only some at a time, and, where it does not fit, what to drop. Pure: plans in,
a SetPlan out (``nodeagent plan A B ...`` prints it; ``modelset.py`` loads and evicts by the same rule)."""

from __future__ import annotations

from itertools import combinations

from pydantic import Field

from nodeagent.planner.types import Plan, _Frozen


class SetPlan(_Frozen):
    models: list[str]
    overhead_bytes: int = Field(description="The process before any model: charged once for the set")
    added_bytes: dict[str, int] = Field(description="What loading each model adds: its plan less the overhead")
    total_bytes: int = Field(description="Every model loaded at once: the overhead plus what each adds")
    budget_bytes: int
    fits_together: bool
    fits_one_at_a_time: bool = Field(description="Each model fits alone (the node then swaps them)")
    largest_together: list[str] = Field(description="The most models that fit loaded at once (by count, then "
                                                    "bytes)")
    reasons: list[str]


def added_bytes(plan: Plan) -> int:
    """What loading a model adds to a process that holds others: its plan less the process overhead."""
    return max(0, plan.memory.total_bytes - plan.memory.overhead_bytes)


def plan_set(names: list[str], plans: list[Plan]) -> SetPlan:
    overhead = max(p.memory.overhead_bytes for p in plans)
    added = {n: added_bytes(p) for n, p in zip(names, plans)}
    total = overhead + sum(added.values())
    budget = min(p.budget.host_limit_bytes for p in plans)
    together = total <= budget
    alone = [n for n in names if overhead + added[n] <= budget]
    best: tuple[str, ...] = ()
    for k in range(len(names), 0, -1):
        fitting = [c for c in combinations(names, k) if overhead + sum(added[n] for n in c) <= budget]
        if fitting:
            best = max(fitting, key=lambda c: sum(added[n] for n in c))
            break
    mib = 1 << 20
    reasons = [f"{n}: adds {added[n] / mib:,.0f} MiB (its plan less the process's {overhead / mib:,.0f} MiB, "
               "charged once)" for n in names]
    if together:
        reasons.append(f"together {total / mib:,.0f} MiB of a budget of {budget / mib:,.0f} MiB: all loaded at once")
    else:
        over = total - budget
        reasons.append(f"together {total / mib:,.0f} MiB, {over / mib:,.0f} MiB over the budget of "
                       f"{budget / mib:,.0f} MiB: not all at once")
        if best:
            dropped = [n for n in names if n not in best]
            reasons.append(f"drop {', '.join(dropped)} (or shrink it by {over / mib:,.0f} MiB: a shorter --ctx or "
                           f"smaller quant) and {', '.join(best)} stay loaded together")
        if len(alone) == len(names):
            reasons.append("each fits alone: served as a set, the node swaps them (least recently used first)")
        else:
            reasons.append(f"{', '.join(n for n in names if n not in alone)} does not fit even alone")
    return SetPlan(models=names, overhead_bytes=overhead, added_bytes=added, total_bytes=total,
                   budget_bytes=budget, fits_together=together, fits_one_at_a_time=len(alone) == len(names),
                   largest_together=list(best), reasons=reasons)
