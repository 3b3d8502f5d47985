"""``loadgen --peers``'s bad values: each a one-line error naming what is wrong and the fix, before
any request is sent or any process started."""

from __future__ import annotations

from deinfer_megatron.bench import load_peers
from tests.robustness.test_inputs import cli_error


def _loadgen(*extra: str) -> tuple[str, ...]:
    return ("loadgen", "--requests", "2", *extra)


def test_bad_peer_names(models, capfd) -> None:
    folder = ("--peer-model", str(models.decomposed))
    line = cli_error(capfd, *_loadgen("--peers", "llama.cpp", *folder))
    assert "--peers: unknown peer 'llama.cpp'; choose from hf,ctranslate2,ctranslate2-bfloat16" in line
    assert "--peers needs at least one of hf,ctranslate2" in cli_error(capfd, *_loadgen("--peers", ",", *folder))
    assert "--peers names hf twice; name each peer once" in cli_error(capfd, *_loadgen("--peers", "hf,hf", *folder))
    line = cli_error(capfd, *_loadgen("--peers", "hf"))
    assert "--peers needs the decomposed folder they run: give --peer-model DIR (or --static-model DIR)" in line
    line = cli_error(capfd, *_loadgen("--peer-model", str(models.decomposed)))
    assert "--peer-model applies to --peers" in line
    assert "--peer-threads must be at least 1, got 0" in cli_error(capfd, *_loadgen("--peers", "hf", *folder,
                                                                                      "--peer-threads", "0"))
    line = cli_error(capfd, *_loadgen("--peers", "hf", "--peer-model", str(models.root / "nowhere")))
    assert "no config.json in" in line


def test_ctranslate2_missing_or_without_bfloat16(models, capfd, monkeypatch) -> None:
    folder = ("--peer-model", str(models.decomposed))

    def missing() -> set[str]:
        raise ImportError("No module named 'ctranslate2'")

    monkeypatch.setattr(load_peers, "ctranslate2_compute_types", missing)
    line = cli_error(capfd, *_loadgen("--peers", "hf,ctranslate2", *folder))
    assert "--peers ctranslate2 needs the ctranslate2 package: pip install ctranslate2" in line
    monkeypatch.setattr(load_peers, "ctranslate2_compute_types", lambda: {"float32", "int8"})
    line = cli_error(capfd, *_loadgen("--peers", "ctranslate2-bfloat16", *folder))
    assert ("--peers ctranslate2-bfloat16: CTranslate2 does not compute in bfloat16 on this CPU "
            "(it offers float32, int8); use --peers ctranslate2") in line
