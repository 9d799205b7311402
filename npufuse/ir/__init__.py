"""The graph view every stage shares, weights left on disk, and model I/O (load, atomic streamed write)."""
