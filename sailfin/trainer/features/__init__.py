"""Optional features that plug into the loop as callbacks: validation every N steps, EMA,
early stopping, FLOPs, auto micro-batch, compile check, profiler, progress and statistics."""
