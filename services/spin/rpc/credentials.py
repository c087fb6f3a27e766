"""A client's side of the router's API keys and TLS (``spin generate``, loadgen, tests).

``metadata(api_key)`` is what every call sends (``authorization: Bearer KEY``; it works over
plaintext and TLS alike); ``channel(endpoint, tls_ca)`` opens a plaintext channel, or a TLS one
that trusts ``tls_ca`` (a PEM file; '' = the system's roots).
"""

from __future__ import annotations

import grpc

from .serving import CHANNEL_OPTIONS


def metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``api_key`` (none without one)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _credentials(tls_ca: str) -> grpc.ChannelCredentials:
    if not tls_ca:
        return grpc.ssl_channel_credentials()
    with open(tls_ca, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


def channel(endpoint: str, tls_ca: str | None = None) -> grpc.Channel:
    """A blocking channel: TLS when ``tls_ca`` is not None."""
    if tls_ca is None:
        return grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(endpoint, _credentials(tls_ca), options=CHANNEL_OPTIONS)


def aio_channel(endpoint: str, tls_ca: str | None = None) -> grpc.aio.Channel:
    """An asyncio channel: TLS when ``tls_ca`` is not None."""
    if tls_ca is None:
        return grpc.aio.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(endpoint, _credentials(tls_ca), options=CHANNEL_OPTIONS)
