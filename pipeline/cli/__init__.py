"""What run.py does: run directories, runs, resume, --serve, replay and its summaries."""
