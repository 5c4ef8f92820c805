"""HTTP: the OpenAI-compatible routes, the typed task routes, health and metrics (app.py), served by uvicorn."""
