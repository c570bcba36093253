"""The embedded policy engine: a small torch inference server that speaks SGLang's native HTTP subset.

Run it as its own process (``python -m pipeline.serving.embedded --model DIR --port N``) or from Python with
:func:`pipeline.serving.launch.launch_embedded`; talk to it with
:class:`pipeline.serving.sglang_client.HttpEngine`, the client that talks to SGLang. Four parts, one per module:

- :mod:`~pipeline.serving.embedded.runner`: the model (a HF folder) and its forward passes: prefill (from scratch or
  after a cached prefix's KV), one batched decode step, reading and applying a checkpoint's weights.
- :mod:`~pipeline.serving.embedded.prefix_cache`: KV of token prefixes computed before, shared by requests (agent
  harnesses resend their whole conversation on every call), within a byte budget (``--prefix-cache-mb``).
- :mod:`~pipeline.serving.embedded.batcher`: the decode thread. Between two decode steps it applies the server's
  commands (abort, pause, weight update, cache flush), admits waiting requests (each prefilled on its own from its
  longest cached prefix, then left-padded into the running batch's KV cache) and decodes one token for every
  running request in one batched forward.
- :mod:`~pipeline.serving.embedded.server`: request validation and the aiohttp server on the main thread.

Log-probabilities are SGLang's: ``log_softmax(logits / T)`` of the sampled token, before top-k/top-p filtering;
``T < 1e-6`` means greedy and ``log_softmax(logits)``. Each request may carry ``sampling_seed``; its tokens are
drawn from its own generator, so the same seed gives the same output whatever else runs.

Weight updates apply between decode steps without failing running requests. Running requests' KV caches are
recomputed with the new weights, so every output token is sampled from exactly one version's distribution
given the full context; the prefix cache is emptied first, so KV of the old weights never serves the new ones. The
finished answer says which version sampled which tokens as SGLang 0.5.23 does:
``meta_info["weight_versions"]`` is ``[{"version", "start", "end"}]`` over output token indices
(:mod:`pipeline.serving.sglang_api`), and ``weight_version`` is the version of the last token.

Reduced vocabulary (``bridle_vocab.json`` in the model folder, see :mod:`pipeline.models.small`): incoming Qwen
ids are mapped to compact ids (unknown ones to the UNK slot), sampled ids are mapped back; the HTTP side only
ever sees Qwen ids. The engine has no tokenizer: ``text`` in responses is always empty.
"""
