"""The OpenAI-compatible HTTP API of the router (``app.py``)."""
