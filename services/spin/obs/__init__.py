"""Observability: Prometheus metrics (``metrics``) and OpenTelemetry tracing (``tracing``)."""
