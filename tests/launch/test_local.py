"""spawn_local: a rank warns only about what its command warns about.

The ranks are fresh processes that import the rank function's module themselves; Megatron-Core
warns at that import. The command's filters must be in place before it, or every multi-rank
command prints a screen of warnings above its one-line error (which is what CI caught).
"""

from __future__ import annotations

import warnings

import pytest

from deinfer_megatron.launch.local import spawn_local

with warnings.catch_warnings():  # this process's own import of it is not what is tested
    warnings.simplefilter("ignore")
    from tests.helpers import noisy_import


@pytest.mark.parametrize("filtered", [True, False])
def test_import_time_warnings_in_a_rank_follow_the_parents_filters(capfd, filtered) -> None:
    with warnings.catch_warnings():
        if filtered:
            warnings.filterwarnings("ignore", message="noisy import")
        else:
            warnings.simplefilter("default")
        assert spawn_local(2, noisy_import.answer, 41, timeout=60) == [42, 42]
    err = capfd.readouterr().err
    # Unfiltered, each rank prints it: the capture sees the ranks' stderr, so the filtered
    # case's silence means the filter held, not that the output was lost.
    assert err.count("UserWarning: noisy import") == (0 if filtered else 2), err
