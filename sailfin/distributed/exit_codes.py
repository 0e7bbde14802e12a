"""The exit codes sailfin's processes end with, for launchers and schedulers to act on.

The first two are 75 (``EX_TEMPFAIL``, a temporary failure): running the same command
again continues the run, and ``torchrun --max-restarts`` does so by itself.
"""

PREEMPTED_EXIT_CODE = 75
"""A run stopped by SIGTERM (or a first Ctrl-C), after saving or before its first step:
run it again to resume."""

HANG_EXIT_CODE = 75
"""The hang watchdog ended every process of a stuck group: a restart resumes from the last
checkpoint."""

NOTHING_TO_TRAIN_EXIT_CODE = 3
"""The output directory holds a run that already reached the end its config asks for: nothing
was trained (a new ``trainer.output_dir`` starts a new run; more ``trainer.epochs`` continue
this one). Running the same command again would only say so again."""
