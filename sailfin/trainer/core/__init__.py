"""The core loop (Loop), its loaders, validation, the train log line, callbacks (the hook
interface) and RunView (what a feature may read and call). It imports no feature."""
