"""A module that warns when it is imported, as Megatron-Core does about Apex: the rank function
below lives here so that a spawned rank imports it while loading its work."""

import warnings

warnings.warn("noisy import: an optional package is missing", UserWarning)


def answer(x: int) -> int:
    return x + 1
