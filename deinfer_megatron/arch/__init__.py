"""What a model is, independent of how it is run: its family (``family``: one record per supported
family, and ``refusals``: the config.json settings the project cannot serve), its architecture
(``model``) and the ranks of its decomposed blocks (``ranks``). The lowest model-level package: it
imports no other part of the project but ``files``."""
