"""The speculative decoding engine: model runner, KV cache, token trees, verification. No gRPC."""
