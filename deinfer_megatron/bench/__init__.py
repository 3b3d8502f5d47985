"""``deinfer-megatron bench``: the three layouts timed on the same weights, cell by cell.

- ``sources``: the model a bench runs (a folder, or a synthetic one written to a temp folder)
- ``matrix``: the configuration grid and the parent-side cell runner (fresh ranks per cell)
- ``measure``: what runs inside the ranks of one cell (timings, peak RSS, KV bytes, ledger)
- ``peers``, ``peer_worker``: ``--peers``, Hugging Face and DeepSpeed AutoTP timed beside the cells
- ``roofline``: this machine's copy/GEMM/collective rates and a decode-step lower bound
- ``records``: cells, rank measurements, summaries as typed values; ``to_json()`` is the schema
- ``report``: summaries, speed-ups, JSON / Markdown / stdout, atomic writes
- ``plot``: the PNG (matplotlib, Agg)
"""
