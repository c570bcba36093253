"""Small policies built from a config (no hub), their reduced vocabularies, the quickstart model."""
