"""nodeagent: turn a Mac, a Raspberry Pi or any Linux box into a local-inference worker."""

__version__ = "0.1.0"
