"""Policies that decide the engine's inputs: which drafter and k per request and step. Pure Python:
no models, no gRPC."""

from .base import FixedPolicy, Policy, RequestView, StepChoice

__all__ = ["FixedPolicy", "Policy", "RequestView", "StepChoice"]
