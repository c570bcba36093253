"""bridle's library: messages, runtime, event log, configuration, token layer, trees, losses, engines."""
