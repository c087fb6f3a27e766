"""The draft-model service (``spin drafter --model PATH``)."""
