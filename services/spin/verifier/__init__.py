"""The target-model verification service (``spin verifier --model PATH``)."""
