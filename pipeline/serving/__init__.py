"""The policy behind the harnesses: engines (embedded, SGLang, scripted) and the capturing proxy."""
