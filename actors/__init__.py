"""One module per actor; each is thin: receive, call the library in ``pipeline``, send."""
