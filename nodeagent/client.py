"""The orchestrator's side, at its public import path: ``from nodeagent.client import Client``
(the code is ``nodeagent/fleet/client.py``)."""

from nodeagent.fleet.client import Client, FanIn, WaitTimeout

__all__ = ["Client", "FanIn", "WaitTimeout"]
