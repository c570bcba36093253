"""bridle's white-box harness (run ``harness.py`` as a script; it only speaks HTTP to the proxy)."""
