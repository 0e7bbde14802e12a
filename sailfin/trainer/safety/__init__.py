"""Run safety: the run lock, preemption, non-finite loss guard and start-up checks."""
