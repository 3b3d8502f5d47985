"""deinfer_megatron: DeInfer parallel inference for low-rank decomposed LLMs on Megatron-Core.

Packages, lowest first. A module may import packages of lower tiers only — never upwards, never
a sibling of its own tier — so each tier can be read, tested and replaced without the ones
above it (``tests/test_architecture.py`` checks every import, function-local ones included).
docs/ARCHITECTURE.md walks the data path from the command line down to a collective.
"""

PACKAGE_ORDER: tuple[frozenset[str], ...] = (
    frozenset({"files"}),  # staged output folders, strict text input, checksums, kill points
    frozenset({"patches"}),  # CPU shims for Megatron-Core / DeepSpeed (version-checked)
    frozenset({"launch"}),  # who started the ranks; spawning, watching and stopping them
    frozenset({"arch"}),  # the model's architecture and block ranks
    frozenset({"parallel"}),  # process groups, TP partitions, the named collectives and their ledger
    frozenset({"layers"}),  # factor modules, decomposed linears and attention, KV caches
    frozenset({"specs"}),  # rank config, the layout table, ModuleSpec builder
    frozenset({"checkpoints"}),  # name/shape table, shard loaders, model folders, converters
    frozenset({"models"}),  # building and loading a pipeline stage; its forward across stages
    frozenset({"planning"}),  # the cost of a layout, computed without running it
    frozenset({"training"}),  # a training step of built stages: schedules, optimizer, clipping
    frozenset({"runtime"}),  # the one job runtime: validate, resolve one plan, run on ranks, shut down
    frozenset({"evaluation", "generation", "decompose", "conversion"}),  # the jobs
    frozenset({"serving", "healing"}),  # the OpenAI-compatible server; heal (distillation, reuses decompose's data)
    frozenset({"bench"}),  # timing the jobs
    frozenset({"cli"}),  # argument parsing into config dataclasses
)

# Before any module of the project imports Megatron-Core: its import without the fusion
# compiler where there is no CUDA (patches/megatron_import.py says why).
from deinfer_megatron.patches import megatron_import  # noqa: E402

megatron_import.install()
