"""Typed tasks, from contract to Result: the contracts and their registry, the prompts, the decoder under a grammar
(with its guards, forced tokens and drafts from the input), label scoring, the OpenAI requests' translation, and
the runner that turns a task into a Result."""
