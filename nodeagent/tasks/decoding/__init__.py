"""The decoder as parts: ``decoder.py`` runs one answer from three token sources (forced by the grammar, drafted
from the input, chosen by the model) under ``guards.py`` and a ``budget.py`` that keeps room for what closes the
answer (``closer.py``, over a schema's smallest ``instances.py``); ``sampling.py`` picks and scores a token;
``drafts.py`` finds the input's text to draft."""
