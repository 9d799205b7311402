"""The fusion engine: match -> cost -> select -> rewrite -> verify."""
