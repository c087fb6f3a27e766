"""What the gRPC services share: engine <-> wire conversions, per-request context books, and the
server scaffolding (health, reflection, metrics endpoint, graceful shutdown)."""
