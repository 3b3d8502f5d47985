"""``heal``: distil a decomposed model back towards the dense model it came from.

- ``job``: the command's checks, the choice of student, the healed folder;
- ``loop``: the one healing loop (budget, schedule length, records, log, evaluation, checkpoints);
- ``student``: what the loop asks of a student; ``megatron_student`` (TP×PP ranks, logit
  distillation) and ``hf_student`` (one process, logit and block-wise) implement it;
- ``data``, ``loss``, ``blocks``, ``watch``, ``state``: the windows, the KL, the block-wise loss,
  held-out perplexity, the resumable state folder.
"""
