"""nodeagent: turn a Mac, a Raspberry Pi or any Linux box into a local-inference worker."""

__version__ = "0.2.0"


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    """``from nodeagent import Node``: the core, imported on first use (``nodeagent --help`` stays light)."""
    if name in ("Node", "NodeConfig"):
        from nodeagent import config, node

        return getattr(node if name == "Node" else config, name)
    raise AttributeError(f"module 'nodeagent' has no attribute {name!r}")
