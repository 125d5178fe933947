"""Training: language-model loss and loop (later: distillation and drafter training)."""
