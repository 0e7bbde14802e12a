"""The core loop and what features see of it (RunView); it imports no feature."""
