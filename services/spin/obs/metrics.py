"""Prometheus metrics of the SPIN services, with vLLM's names and semantics plus ``draft_model``.

Every speculative-decoding counter carries ``draft_model`` (the drafter's name, e.g. ``draft-code``
or ``prompt-lookup``), which no other serving system exports. Useful queries:

- acceptance rate per drafter::

    sum by (draft_model) (rate(spin:spec_decode_num_accepted_tokens_total[5m]))
      / sum by (draft_model) (rate(spin:spec_decode_num_draft_tokens_total[5m]))

- mean acceptance length (tau, vLLM's definition: includes the bonus token)::

    1 + sum by (draft_model) (rate(spin:spec_decode_num_accepted_tokens_total[5m]))
      / sum by (draft_model) (rate(spin:spec_decode_num_drafts_total[5m]))

- acceptance at position 3::

    rate(spin:spec_decode_num_accepted_tokens_per_pos_total{position="3"}[5m])
      / rate(spin:spec_decode_num_drafts_total[5m])

- p99 TTFT: ``histogram_quantile(0.99, sum by (le) (rate(spin:time_to_first_token_seconds_bucket[5m])))``
- speculation-off share of steps: ``rate(spin:spec_decode_steps_total{draft_model=""}[5m])
  / rate(spin:spec_decode_steps_total[5m])``
- preemptions per second (the verifier's KV cache too small for the load):
  ``sum(rate(spin:num_preemptions_total{role="verifier"}[5m]))``; KV cache use:
  ``max by (role, model) (spin:kv_cache_usage_perc)``
- prefix cache hit rate per service (tokens of new contexts found in cached blocks)::

    sum by (role, model) (rate(spin:prefix_cache_hits_total[5m]))
      / sum by (role, model) (rate(spin:prefix_cache_queries_total[5m]))

- requests a service still holds with none running (a leak; should be 0):
  ``sum by (role, model) (spin:service_sequences) and on() (sum(spin:num_requests_running) == 0)``
- speculation measured against plain steps, per kind of step (below 1: at a loss; the learned
  policy then runs plain steps there, ``policy/loss_guard.py``)::

    spin:speculation_measured_tokens_per_second{speculation="on"}
      / ignoring(speculation) spin:speculation_measured_tokens_per_second{speculation="off"}

- the cost model against the serving machine (1: as profiled; above 1: slower, e.g. a drafter
  contended by the others; the learned policy plans with these corrections,
  ``policy/calibration.py``): ``max by (part, draft_model) (spin:cost_model_calibration)``
- structured output's share of the router's step time (the grammar's masks and cut drafts)::

    rate(spin:grammar_seconds_total[5m]) / rate(spin:step_seconds_sum[5m])

- acceptance statistics lost at router shutdowns (Redis down, no ``--stats-spill``):
  ``increase(spin:stats_steps_lost_total[1d])``
- suffix decoding's texts shared between routers (``--suffix-share``) per second, and the share
  dropped (Redis down, or a router not taking them in)::

    sum by (event) (rate(spin:suffix_share_texts_total[5m]))
    sum(rate(spin:suffix_share_texts_total{event="dropped"}[5m]))
      / sum(rate(spin:suffix_share_texts_total{event="published"}[5m]))
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from ..engine.prefix_cache import PrefixCache

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0, 20.0, 40.0, 80.0)
_STEP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

# ---- router: requests (vLLM names) -------------------------------------------------------------
REQUESTS_RUNNING = Gauge("spin:num_requests_running", "Requests in the decoding batch.")
REQUESTS_WAITING = Gauge("spin:num_requests_waiting", "Requests admitted and waiting for a slot.")
REQUEST_SUCCESS = Counter("spin:request_success", "Finished requests by finish reason.",
                          ["finished_reason"])
REQUEST_ERRORS = Counter("spin:request_errors", "Requests ended with an error, by gRPC status.",
                         ["code"])
PROMPT_TOKENS = Counter("spin:prompt_tokens", "Prompt tokens of admitted requests.")
GENERATION_TOKENS = Counter("spin:generation_tokens", "Tokens generated (streamed to clients).")
TTFT = Histogram("spin:time_to_first_token_seconds", "Arrival to first streamed token.",
                 buckets=_LATENCY)
TPOT = Histogram("spin:time_per_output_token_seconds",
                 "(E2E - TTFT) / (output tokens - 1) per request.", buckets=_LATENCY)
ITL = Histogram("spin:inter_token_latency_seconds",
                "Gap between successive streamed token groups (a group is one step's tokens).",
                buckets=_LATENCY)
E2E = Histogram("spin:e2e_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY)
QUEUE_TIME = Histogram("spin:request_queue_time_seconds", "Arrival to first scheduled step.",
                       buckets=_LATENCY)

# ---- router: speculative decoding (vLLM names + draft_model) -----------------------------------
SPEC_DRAFTS = Counter("spin:spec_decode_num_drafts", "Verification steps that carried a draft.",
                      ["draft_model"])
SPEC_DRAFT_TOKENS = Counter("spin:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                            ["draft_model"])
SPEC_ACCEPTED = Counter("spin:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                        ["draft_model"])
SPEC_ACCEPTED_POS = Counter("spin:spec_decode_num_accepted_tokens_per_pos",
                            "Accepted draft tokens by position (1 = first drafted token).",
                            ["draft_model", "position"])
SPEC_STEPS = Counter("spin:spec_decode_steps",
                     "Request-steps by drafter ('' = no speculation, k = 0).", ["draft_model"])
SPEC_K = Histogram("spin:spec_decode_k", "Chosen speculation length per request-step.",
                   ["draft_model"], buckets=(0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16))
DRAFTER_FAILURES = Counter("spin:drafter_failures",
                           "Draft calls that failed (the requests went on without that drafter).",
                           ["draft_model"])
DRAFTER_UP = Gauge("spin:drafter_up", "1 when the router's stream to the drafter works.",
                   ["draft_model"])
STEP_SECONDS = Histogram("spin:step_seconds", "Router step: draft + verify + bookkeeping.",
                         buckets=_STEP)
STEP_DRAFT_SECONDS = Histogram("spin:step_draft_seconds", "Router step: waiting for drafts.",
                               buckets=_STEP)
STEP_VERIFY_SECONDS = Histogram("spin:step_verify_seconds", "Router step: waiting for verification.",
                                buckets=_STEP)
RPC_OVERHEAD_SECONDS = Histogram("spin:step_rpc_overhead_seconds",
                                 "Step time not spent inside drafter or verifier compute.",
                                 buckets=_STEP)
STEP_PREDICTED_SECONDS = Histogram("spin:step_predicted_seconds",
                                   "The policy's cost-model prediction of the step it chose.",
                                   buckets=_STEP)
STEP_PREDICTION_ERROR = Histogram("spin:step_prediction_error_ratio",
                                  "|predicted - measured| / measured step time (round trips included).",
                                  buckets=(0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0))
BATCH_SIZE = Histogram("spin:batch_size", "Requests per verification step.",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128))
SPEC_MEASURED_RATE = Gauge("spin:speculation_measured_tokens_per_second",
                           "The learned policy's measure of tokens per second of step, speculating "
                           "or not (speculation on|off), per kind of step: batch size range and "
                           "decoding (greedy, sampled, mixed).",
                           ["batch_size", "decoding", "speculation"])
SPEC_GUARD = Gauge("spin:speculation_guard_speculating",
                   "1 while the learned policy speculates on this kind of step, 0 while it runs "
                   "plain steps there because speculation measured less.",
                   ["batch_size", "decoding"])
COST_CALIBRATION = Gauge("spin:cost_model_calibration",
                         "The learned policy's correction of its cost model, learnt in serving: "
                         "measured / predicted seconds of the plain verification (verify_plain), "
                         "of what speculating adds to it (verify_speculating) and of each "
                         "drafter's call (draft).",
                         ["part", "draft_model"])
STATS_STORE_ERRORS = Counter("spin:stats_store_errors", "Failed writes/reads of the statistics store.")
STATS_STEPS_LOST = Counter("spin:stats_steps_lost",
                           "Acceptance statistics (steps) dropped: not written to Redis at "
                           "shutdown and no spill file to keep them (--stats-spill).")
SUFFIX_SHARE_TEXTS = Counter("spin:suffix_share_texts",
                             "Requests' texts suffix decoding shares with the other routers "
                             "(--suffix-share): published to Redis, received from the other "
                             "routers, dropped (unsent while Redis was down, or received past "
                             "the store's budget before it took them in).", ["event"])
SUFFIX_SHARE_ERRORS = Counter("spin:suffix_share_errors",
                              "Failed Redis calls of suffix decoding's sharing (retried).")
REPLICAS = Gauge("spin:replicas", "Replicas the router knows per service (from discovery).",
                 ["role", "drafter"])
PREFIX_ROUTING = Counter("spin:prefix_routing",
                         "New requests routed among several replicas, by outcome: home (to the "
                         "replica its prompt prefix was sent to), busy (home too loaded: the "
                         "least loaded instead), none (no prefix remembered).",
                         ["role", "drafter", "outcome"])

# ---- drafter and verifier processes ------------------------------------------------------------
SERVICE_BATCH_SECONDS = Histogram("spin:service_batch_seconds",
                                  "Compute time of one batch inside a drafter or verifier.",
                                  ["role", "model"], buckets=_STEP)
SERVICE_BATCH_REQUESTS = Histogram("spin:service_batch_requests", "Requests per batch.",
                                   ["role", "model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128))
SERVICE_RESYNCS = Counter("spin:service_resyncs",
                          "Tasks answered with resync (the service lacked the context).",
                          ["role", "model"])
VERIFY_PADDED_FRACTION = Histogram("spin:verify_padded_fraction",
                                   "Share of computed new-token rows that were padding.",
                                   buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0))
VERIFY_FORWARDS = Histogram("spin:verify_forwards_per_batch",
                            "Target forwards per verification batch (after decomposition).",
                            buckets=(1, 2, 3, 4, 6, 8))
KV_CACHE_USAGE = Gauge("spin:kv_cache_usage_perc", "Share of KV cache blocks in use (0..1).",
                       ["role", "model"])
SERVICE_SEQUENCES = Gauge("spin:service_sequences",
                          "Requests whose context a drafter or verifier holds (released when "
                          "they finish or are cancelled).", ["role", "model"])
NUM_PREEMPTIONS = Counter("spin:num_preemptions",
                          "Requests whose KV cache was dropped for lack of blocks, to be "
                          "recomputed (verifier: the request waits and is verified again, its "
                          "output unchanged; drafter: an idle request's cache, caught up when it "
                          "is drafted again).", ["role", "model"])


GRAMMAR_SECONDS = Counter("spin:grammar_seconds",
                          "Router seconds spent on structured output's grammars: each step's "
                          "drafts cut and allowed rows computed (router/structured.py).")
GRAMMAR_FORCED_TOKENS = Counter("spin:grammar_forced_tokens",
                                "Tokens of structured-output requests appended without "
                                "verification: the one token their grammar allowed "
                                "(jump-forward).")
GRAMMAR_STEPS = Counter("spin:grammar_steps",
                        "Request-steps of structured-output requests (each had its rows "
                        "computed).")


PREFIX_CACHE_QUERIES = Counter("spin:prefix_cache_queries",
                               "Context tokens of new (or recomputed) requests looked up in the "
                               "prefix cache (vLLM's prefix_cache_queries).", ["role", "model"])
PREFIX_CACHE_HITS = Counter("spin:prefix_cache_hits",
                            "Of those, tokens found in cached blocks (not computed again).",
                            ["role", "model"])
_prefix_seen: weakref.WeakKeyDictionary[PrefixCache, tuple[int, int]] = \
    weakref.WeakKeyDictionary()
"""A prefix cache -> its queries and hits already counted."""


def observe_service_batch(role: str, model: str, seconds: float, requests: int,
                          blocks_in_use: float, sequences: int,
                          prefix: PrefixCache | None = None) -> None:
    """A drafter's or verifier's batch: its compute time, size, and cache use after it
    (``sequences``: the requests it holds; ``prefix``: its prefix cache, whose lookups since
    the last batch are counted)."""
    SERVICE_BATCH_SECONDS.labels(role, model).observe(seconds)
    SERVICE_BATCH_REQUESTS.labels(role, model).observe(requests)
    KV_CACHE_USAGE.labels(role, model).set(blocks_in_use)
    SERVICE_SEQUENCES.labels(role, model).set(sequences)
    if prefix is not None:
        queries, hits = _prefix_seen.get(prefix, (0, 0))
        PREFIX_CACHE_QUERIES.labels(role, model).inc(prefix.queries - queries)
        PREFIX_CACHE_HITS.labels(role, model).inc(prefix.hits - hits)
        _prefix_seen[prefix] = (prefix.queries, prefix.hits)
