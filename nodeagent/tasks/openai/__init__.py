"""OpenAI's wire formats and the completion engine behind them: ``fields.py`` (every request's fields, honoured,
ignored or refused: one ``FieldTable`` each), ``requests.py`` (chat and completions requests, parsed),
``responses.py`` (the Responses API, as a translation to chat and back), ``spec.py`` (``CompletionSpec``, the one
mapping from a request to a run, and the values of a run), ``engine.py`` (``complete``: the one entry),
``bodies.py`` (OpenAI's answer bodies) and ``tools.py`` (tool calls: formats, grammar, parsing)."""
