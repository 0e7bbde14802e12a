"""The core loop: the Trainer, its loaders, validation, callbacks and run outputs."""
