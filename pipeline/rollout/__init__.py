"""Rollouts: tasks, scheduling, harness adapters and the harness space, sandboxes, verifiers, images."""
