"""The durable queue: one protocol (base.py), SQLite for one machine, Redis Streams for a fleet."""
