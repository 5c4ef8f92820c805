"""A node on the fleet: the worker (claim -> run -> result -> ack), its registration record and id, the guard
against overload, what `nodeagent status` shows, and the orchestrator's client (``nodeagent.client``)."""
