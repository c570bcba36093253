"""bridle's white-box harness: ``harness.py`` (entry script) and its package ``agent`` (standard library only;
it speaks only HTTP to the proxy)."""
