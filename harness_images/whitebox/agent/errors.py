"""The three ways a white-box episode goes wrong, each handled at a different place."""

from __future__ import annotations


class ApiError(Exception):
    """The model endpoint failed; ``retryable`` says whether a new attempt may succeed."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class ToolError(Exception):
    """A tool call the model got wrong or that failed; its text goes back to the model as the result."""


class UsageError(Exception):
    """The harness was started wrongly (bad config name, missing file, no API key)."""
