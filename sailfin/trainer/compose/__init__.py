"""The composition root: the public Trainer, which builds a run from its config (setup)."""
