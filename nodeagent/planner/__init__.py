"""The memory planner: pure functions from hardware, profile, model headers and requirements to a Plan."""

from nodeagent.planner.search import plan
from nodeagent.planner.types import Budget, Memory, Plan, Requirements, Settings

__all__ = ["Budget", "Memory", "Plan", "Requirements", "Settings", "plan"]
