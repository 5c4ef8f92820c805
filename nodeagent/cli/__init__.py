"""Click commands: thin; resolve config, call the core, print."""
