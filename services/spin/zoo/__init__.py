"""The demo model family: corpus, tokenizer, training, distillation and the acceptance report."""
