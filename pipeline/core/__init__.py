"""The actor framework: runtime (actors, bounded channels, supervisor), configuration, event log, logging."""
