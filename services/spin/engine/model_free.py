"""The model-free drafters: the names of the drafters that run in the router with no model.

They keep no KV cache (no catch-up when a request switches to one, no switching cost), draft
in microseconds (the cost model's ``prompt_lookup_s`` per request), find a match or draft
nothing, and score a request's context for free; the policy treats every one of them alike by
this set (``policy/``), and the router knows them as its local proposers
(``router/proposers.py``).
"""

from __future__ import annotations

from .prediction import PREDICTION
from .prompt_lookup import PROMPT_LOOKUP
from .suffix_decoding import SUFFIX_DECODING

GRAMMAR = "grammar"
"""The drafter of what a structured-output request's grammar forces next (``grammar.py``)."""

MODEL_FREE: frozenset[str] = frozenset({PROMPT_LOOKUP, SUFFIX_DECODING, PREDICTION, GRAMMAR})
"""Prompt lookup (the request's own context), suffix decoding (earlier requests' too),
Predicted Outputs (the request's own prediction: ``prediction.py``) and the grammar's forced
tokens."""
