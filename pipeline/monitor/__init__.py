"""What a person sees: the live terminal display, metrics files and plots."""
