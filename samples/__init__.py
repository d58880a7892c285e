"""Sample applications built on dsedge's public API and CLI (run from the repository root)."""
