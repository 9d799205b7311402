"""What a person sees on a terminal: per-stage progress, text safe to print, one-line errors with exit code 2."""
