"""Load generation for SPIN serving: workloads from the demo family's held-out prompts."""
