"""The trainer's side of checkpoints: what to save (saver, state), resume, init_from and
the config comparison on resume. Storage itself is ``sailfin.checkpoint``."""
