"""The token layer: tokenizers, chat templates, conversations, tool-call parsing, splicing."""
