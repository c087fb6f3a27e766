"""Observability: Prometheus metrics (and, with the deployment issue, OpenTelemetry tracing)."""
