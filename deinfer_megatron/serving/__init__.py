"""``deinfer-megatron serve``: an OpenAI-compatible server with continuous batching (docs/SERVING.md).

- ``server``: the job — every rank loads its stage and runs the step loop; rank 0 also serves HTTP
- ``scheduler``: rank 0's admission, running batch, stop strings and streamed text deltas
- ``blocks``: rank 0's book of the KV pool — block tables, reservations, the prefix cache
- ``step``: a step's plan, sent from rank 0 to every rank, and the one forward every rank runs
- ``stats``: where rank 0's model loop spends a step (metrics and a periodic log line)
- ``http``: the FastAPI app (completions, chat, streaming, models, health, metrics, API key)
- ``protocol``: OpenAI request fields checked once, and the response bodies
- ``metrics``: the Prometheus registry of one server
"""
