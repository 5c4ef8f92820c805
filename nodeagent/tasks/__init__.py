"""Three subjects, each a room of its own: the typed tasks (contracts and their registry, prompts through the
model's chat template, schemas, label scoring, and the runner that turns a task into a Result), ``openai/`` (the
OpenAI wire formats and the completion engine), and ``decoding/`` (the decoder under a grammar, with its guards,
forced tokens and drafts from the input). ``events.py`` is a request's events, in process and on the queue."""
