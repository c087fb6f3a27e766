"""Generated code of the wire contracts in ``proto/spin/v1`` (``make proto``; never edit by hand).

The proto package ``spin.v1`` lands here as the Python package ``spin.v1``, which is exactly the
import path protoc writes into the generated modules.
"""
