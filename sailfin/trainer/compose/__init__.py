"""The composition root: the public Trainer, which builds a run from its config (setup),
checks it, drives the loop (``trainer/core``) and writes the run's outputs. It is the one
place that imports the features, safety and checkpointing it assembles."""
