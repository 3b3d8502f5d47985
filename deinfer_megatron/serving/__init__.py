"""``deinfer-megatron serve``: an OpenAI-compatible server with continuous batching (docs/SERVING.md).

- ``server``: the job — every rank loads its stage and runs the step loop; rank 0 also serves HTTP
- ``scheduler``: rank 0's admission, running batch, stop strings and streamed text deltas
- ``step``: a step's plan, sent from rank 0 to every rank, and the forwards every rank runs
- ``http``: the FastAPI app (completions, chat, streaming, models, health, metrics, API key)
- ``protocol``: OpenAI request fields checked once, and the response bodies
- ``metrics``: the Prometheus registry of one server
"""
