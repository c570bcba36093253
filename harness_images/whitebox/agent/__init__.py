"""bridle's white-box harness as a package, standard library only (it runs in a bare Debian image).

``harness.py`` beside this folder is the entry script; the modules, in the order an episode uses them:

- ``components``: the five components S, T, O, C, W and their levels, the configuration type, the texts
  of each level and the tool interface per T level. The one definition: ``pipeline.rollout.harness_space``
  imports it.
- ``client``: streaming Chat Completions over TCP or a Unix socket (HTTP + server-sent events), with retries.
- ``tools``: the seven tools against the workspace and the check of the model's arguments.
- ``observe``: a tool result as the model sees it under O0, O1, O2.
- ``context``: C1 summaries and C2 compaction into a new segment.
- ``transcript``: the JSONL record of the episode.
- ``episode``: the agent loop (W0, W1, W2 live here).
- ``cli``: the command line.

Imports inside the package are relative, so it works both as ``harness_images.whitebox.agent`` and, when
``harness.py`` runs as a script (its folder first on ``sys.path``), as the top-level package ``agent``.
"""
