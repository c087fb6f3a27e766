"""The router (``spin router``): owns requests, batches them continuously, asks the policy for a
drafter and k per request, and drives drafters and the verifier over gRPC streams."""
