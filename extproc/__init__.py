"""extproc."""
