"""The ``heal`` job: a decomposed folder and its dense teacher in, a healed decomposed folder out.

Everything a user can get wrong is checked before a model is loaded (paths, budget, output,
teacher/student mismatch). Then the job picks the student — the Megatron stage on TP×PP ranks
for ``--distill logits`` (``healing.megatron_student``), the Hugging Face factor-pair model in
this process for the block-wise modes (``healing.hf_student``) — and both run the one loop
(``healing.loop``). The healed folder is written like ``decompose`` writes one
(``checkpoints.folder.write_decomposed``: staged, manifest last, one rename), with the
decomposition's manifest entries kept and a ``healing`` entry added, so every command that
reads a decomposed folder reads it unchanged.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.arch.model import load_arch
from deinfer_megatron.checkpoints.folder import (RANK_CONFIG, ModelFolder, is_project_folder, open_model,
                                                 write_decomposed)
from deinfer_megatron.decompose.calibration import SELF_TEMPERATURE, check_answers, check_temperature
from deinfer_megatron.files.checksums import sha256
from deinfer_megatron.files.staging import claim_output
from deinfer_megatron.files.text import read_text
from deinfer_megatron.healing import hf_student, megatron_student
from deinfer_megatron.healing import state as run_state
from deinfer_megatron.healing.data import HealData, build_data
from deinfer_megatron.healing.hf_student import HFStudent, load_teacher
from deinfer_megatron.healing.loop import DISTILL, Healed, LoopSettings, train
from deinfer_megatron.healing.megatron_student import RankSettings, heal_on_ranks
from deinfer_megatron.healing.state import FINAL
from deinfer_megatron.healing.watch import HeldOut
from deinfer_megatron.models.hf_factored import TRAINABLE
from deinfer_megatron.runtime.job import Prepared, prepare, run_prepared
from deinfer_megatron.runtime.options import DType, Parallelism, warn_if_emulated
from deinfer_megatron.specs.layout import factored_layouts

log = logging.getLogger(__name__)
DTYPES = ("float32", "bfloat16")
LAYOUTS = tuple(layout.value for layout in factored_layouts())  # the layouts that keep factors to train


@dataclass(frozen=True)
class HealJob:
    model: Path
    teacher: Path
    out: Path
    calib_text: tuple[Path, ...] = ()
    calib_self: int | None = None
    source_weights: tuple[float, ...] = ()  # one per --calib-text file, then the conversations; () equal
    calib_temperature: float | None = None  # the conversations' sampling; None: SELF_TEMPERATURE
    calib_answers: str = "sampled"  # the conversations' answers: sampled or greedy
    tokens: int | None = None
    minutes: float | None = None
    lr: float = 1e-4
    warmup: int = 10
    batch: int = 4
    seq_len: int = 256
    train: str = "factors"
    ce_weight: float = 0.0
    distill: str = "logits"
    dtype: str = "float32"
    save_every: int = 0
    resume: bool = False
    json_log: Path | None = None
    seed: int = 0
    max_text_tokens: int = 200_000  # per text file
    eval_text: tuple[Path, ...] = ()  # held-out perplexity during healing (the curve)
    eval_every: int = 0
    eval_tokens: int = 2048
    overwrite: bool = False  # Python API only (the demo's cache): replace an --out this project wrote
    tp: int = 1
    pp: int = 1
    layout: str = "deinfer"  # the student's parallel layout (logit distillation)

    def settings(self) -> dict[str, Any]:
        """What a resume must repeat (JSON-comparable)."""
        d = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()
             if k not in ("resume", "json_log", "save_every", "eval_text", "eval_every", "eval_tokens",
                          "overwrite")}
        d["calib_text"] = [str(p) for p in self.calib_text]
        d["source_weights"] = list(self.source_weights)
        d["calib_temperature"] = self.temperature if self.calib_self else SELF_TEMPERATURE  # only conversations use it
        for key, default in self.omitted_settings().items():  # what runs made before these options recorded
            if d[key] == default:
                del d[key]
        return d

    @staticmethod
    def omitted_settings() -> dict[str, Any]:
        """The settings ``job.json`` leaves out at these, their defaults (equal turns, the default
        temperature, sampled answers): runs made before each option existed resume, and a resume
        reads a missing one as its default."""
        return {"source_weights": [], "calib_temperature": SELF_TEMPERATURE, "calib_answers": "sampled"}

    @property
    def temperature(self) -> float:
        return SELF_TEMPERATURE if self.calib_temperature is None else self.calib_temperature

    def loop_settings(self) -> LoopSettings:
        steps = None if self.tokens is None else math.ceil(self.tokens / (self.batch * self.seq_len))
        return LoopSettings(self.lr, self.warmup, self.batch, self.seq_len, steps,
                            None if self.minutes is None else self.minutes * 60, ce_weight=self.ce_weight,
                            seed=self.seed, save_every=self.save_every, bf16=self.dtype == "bfloat16",
                            distill=self.distill, eval_every=self.eval_every)


def _check_numbers(job: HealJob) -> None:
    if (job.tokens is None) == (job.minutes is None):
        raise ValueError("give exactly one budget: --tokens N or --minutes M")
    if job.tokens is not None and job.tokens <= 0:
        raise ValueError(f"--tokens must be a positive number of tokens, got {job.tokens}")
    if job.minutes is not None and not job.minutes > 0:
        raise ValueError(f"--minutes must be > 0, got {job.minutes}")
    for flag, value in (("--batch", job.batch), ("--seq-len", job.seq_len)):
        if value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    if not job.lr > 0:
        raise ValueError(f"--lr must be > 0, got {job.lr}")
    if job.warmup < 0 or job.save_every < 0 or job.eval_every < 0:
        raise ValueError("--warmup, --save-every and --eval-every must be ≥ 0")
    if job.eval_tokens < 2:
        raise ValueError(f"--eval-tokens must be at least 2, got {job.eval_tokens}")
    overlap = set(map(Path.resolve, job.eval_text)) & set(map(Path.resolve, job.calib_text))
    if overlap:
        raise ValueError(f"--eval-text {sorted(overlap)[0]} is also healing data; held-out text must not be")
    if job.ce_weight < 0:
        raise ValueError(f"--ce-weight must be ≥ 0, got {job.ce_weight}")
    if job.train not in TRAINABLE:
        raise ValueError(f"unknown --train {job.train!r}; choose one of {', '.join(TRAINABLE)}")
    if job.distill not in DISTILL:
        raise ValueError(f"unknown --distill {job.distill!r}; choose one of {', '.join(DISTILL)}")
    if job.layout not in LAYOUTS:
        raise ValueError(f"--layout {job.layout!r} cannot heal: choose {' or '.join(LAYOUTS)} (the dense layout "
                         "multiplies the factors out, so there are no factors to train)")
    if job.tp < 1 or job.pp < 1:
        raise ValueError(f"--tp and --pp must be positive integers, got {job.tp} and {job.pp}")
    if job.distill != "logits" and job.tp * job.pp > 1:
        raise ValueError(f"--distill {job.distill} runs in one process only; use --distill logits with "
                         "--tp/--pp, or drop --tp/--pp")
    if job.dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {job.dtype!r}; choose float32 or bfloat16")
    warn_if_emulated(DType(job.dtype))  # autocast: the products run in it
    if not job.calib_text and not job.calib_self:
        raise ValueError("heal needs data: pass --calib-text FILE (one or more) and/or --calib-self N")
    if job.calib_self is not None and job.calib_self < 1:
        raise ValueError(f"--calib-self must be a positive number of conversations, got {job.calib_self}")
    check_temperature(job.calib_temperature, job.calib_self)
    check_answers(job.calib_answers, job.calib_self)
    if job.source_weights:
        n = len(job.calib_text) + (1 if job.calib_self else 0)
        if len(job.source_weights) != n:
            raise ValueError(f"--source-weights gives {len(job.source_weights)} weights for {n} sources; give one "
                             "per --calib-text file, in order, then one for the --calib-self conversations")
        bad = [w for w in job.source_weights if not (math.isfinite(w) and w > 0)]
        if bad:
            raise ValueError(f"--source-weights must be positive finite numbers, got {bad[0]}")


def tokenizer_fingerprint(folder: Path) -> str | None:
    """What makes two tokenizers the same: the SHA-256 of ``tokenizer.json`` (None without one)."""
    f = Path(folder) / "tokenizer.json"
    return sha256(f) if f.is_file() else None


def check_models(job: HealJob) -> None:
    """The student is decomposed, the teacher dense, and both one architecture and tokenizer."""
    for flag, path in (("--model", job.model), ("--teacher", job.teacher)):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{flag} {path} is not a model folder (no config.json)")
    if not (job.model / RANK_CONFIG).is_file():
        raise ValueError(f"--model {job.model} is not decomposed (no {RANK_CONFIG}); heal a folder "
                         "written by `deinfer-megatron decompose`")
    if (job.teacher / RANK_CONFIG).is_file():
        raise ValueError(f"--teacher {job.teacher} is itself decomposed; the teacher is the dense model "
                         "the student was decomposed from")
    student, teacher = load_arch(job.model), load_arch(job.teacher)
    if student != teacher:
        field = next(k for k in asdict(student) if asdict(student)[k] != asdict(teacher)[k])
        raise ValueError(f"--model and --teacher are different architectures ({field}: "
                         f"{asdict(student)[field]} vs {asdict(teacher)[field]}); give the dense model "
                         "the student was decomposed from")
    if tokenizer_fingerprint(job.model) != tokenizer_fingerprint(job.teacher):
        raise ValueError("--model and --teacher have different tokenizers (tokenizer.json differs); "
                         "give the dense model the student was decomposed from")


def _check_output(job: HealJob) -> Path:
    folder = run_state.state_dir(job.out)
    if job.out.exists() and not (job.overwrite and is_project_folder(job.out)):
        raise ValueError(f"--out {job.out} exists; choose another --out (--resume continues a killed "
                         f"run, whose state is in {folder}, not a finished one)")
    claim_output(job.out, overwrite=job.overwrite, is_ours=is_project_folder, inputs=(job.model, job.teacher))
    resumable = (folder / "job.json").is_file()  # written last when a run starts; before it, nothing to keep
    if job.resume and not resumable:
        raise ValueError(f"--resume: there is no killed run to continue (no {folder / 'job.json'}); "
                         "run without --resume")
    if not job.resume and resumable:
        raise ValueError(f"{folder} holds the state of a killed heal into {job.out}; pass --resume to "
                         "continue it, or remove that folder to start over")
    if job.resume:
        run_state.check_same_job(folder, job.settings(), job.omitted_settings())
        if (folder / "state.pt").is_file() and run_state.checkpoint_dir(folder) is None:
            raise ValueError(f"{folder} was checkpointed by an earlier version of heal (state.pt), which this "
                             "one cannot continue; remove that folder and start again without --resume")
    if job.json_log is not None and job.json_log.exists() and not job.resume:
        raise ValueError(f"--json {job.json_log} exists; choose another log file")
    return folder


def validate(job: HealJob) -> tuple[Path, Prepared | None]:
    """Every check that needs no model loaded; returns the run's state folder and, for logit
    distillation on ranks, the student's prepared rank job (``runtime.job``: TP/PP sizes, plan,
    memory)."""
    _check_numbers(job)
    check_models(job)
    for flag, paths in (("--calib-text", job.calib_text), ("--eval-text", job.eval_text)):
        for path in paths:
            read_text(path, flag, max_chars=1000)
    folder = _check_output(job)
    return folder, prepare(_rank_settings(job, folder)) if job.distill == "logits" else None


def _data(job: HealJob, folder: Path, teacher: torch.nn.Module | None = None) -> HealData:
    """The run's windows: the saved ones on a resume, else built (the teacher is loaded here if
    conversations must be written and none was given) and saved before ``job.json``."""
    if job.resume:
        return _saved_data(folder)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(job.teacher)
    if teacher is None and job.calib_self:
        teacher = load_teacher(job.teacher)
    data = build_data(tokenizer, teacher, job.calib_text, job.calib_self, seq_len=job.seq_len,
                      max_text_tokens=job.max_text_tokens, seed=job.seed, weights=job.source_weights,
                      temperature=job.temperature, answers=job.calib_answers)
    folder.mkdir(parents=True, exist_ok=True)  # a run killed before its job.json left at most data.pt
    run_state.save_torch(folder / "data.pt", {"windows": data.windows, "sources": data.sources,
                                              "weights": data.weights})
    run_state.save_json(folder / "job.json", job.settings())  # last: its presence means resumable
    return data


def _rank_data(job: HealJob, folder: Path, rank: int) -> HealData:
    """Rank 0 builds (or, resuming, reads) the windows; the others read what it saved."""
    return _data(job, folder) if rank == 0 else _saved_data(folder)


def _saved_data(folder: Path) -> HealData:
    """The windows (and their sources) the run saved in ``data.pt``."""
    return HealData(**run_state.load_torch(folder / "data.pt"))


def _held_out(job: HealJob, max_positions: int) -> HeldOut | None:
    if not job.eval_text:
        return None
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(job.teacher)
    return HeldOut(tokenizer, job.eval_text, window=min(job.seq_len, max_positions), max_tokens=job.eval_tokens)


def _rank_settings(job: HealJob, folder: Path) -> RankSettings:
    return RankSettings(model=job.model, teacher=job.teacher, state_folder=folder,
                        parallel=Parallelism(job.tp, job.pp, job.layout), train=job.train, loop=job.loop_settings(),
                        json_log=job.json_log, resume=job.resume)


def _heal_in_process(job: HealJob, folder: Path, dec: ModelFolder) -> Healed:
    """The block-wise modes: the Hugging Face factor-pair student and its teacher in this process."""
    teacher = load_teacher(job.teacher)
    data = _data(job, folder, teacher)
    settings = job.loop_settings()
    student = HFStudent(dec, teacher, train=job.train, optimizer=settings.optimizer(),
                        ce_weight=job.ce_weight, bf16=settings.bf16)
    return train(student, data, settings, state_folder=folder, resume=job.resume, log=job.json_log,
                 held_out=_held_out(job, dec.arch.max_positions))


def run_heal(job: HealJob) -> dict[str, Any] | None:
    """Heal ``job.model`` and write ``job.out``; returns a summary (also in the manifest) on the
    process that reports (global rank 0 under a launcher) and None on the other ranks.

    ``--distill logits`` trains the project's Megatron student on ``tp × pp`` ranks
    (``healing.megatron_student``); the block-wise modes train the Hugging Face factor-pair
    student in this process (``healing.hf_student``). Both run ``healing.loop.train``."""
    folder, prepared = validate(job)
    torch.manual_seed(job.seed)
    start_time = time.perf_counter()
    dec = open_model(job.model)
    if prepared is not None:
        healed = run_prepared(prepared, heal_on_ranks, partial(_rank_data, job, folder),
                              _held_out(job, dec.arch.max_positions))
        if healed is None:
            return None
        tensors = megatron_student.read_final(folder / FINAL, dec)
    else:
        healed = _heal_in_process(job, folder, dec)
        tensors = hf_student.read_final(folder / FINAL)
    records, teacher_eval = healed.records, healed.teacher_eval
    data = _saved_data(folder)
    steps = records[-1]["step"] if records else 0
    kl = [r["kl"] for r in records if "kl" in r]
    tail = kl[-min(10, len(kl)):]
    summary = {
        "teacher": str(job.teacher), "student": str(job.model),
        "data": data.sources, "windows": data.count, "seq_len": job.seq_len,
        "tp": job.tp, "pp": job.pp, "layout": job.layout if job.distill == "logits" else None,
        "steps": steps, "tokens": steps * job.batch * job.seq_len,
        "distill": job.distill,
        "final_kl": sum(tail) / len(tail) if tail else None,  # the mean of the last 10 logit steps
        "first_kl": kl[0] if kl else None,
        "final_loss": records[-1]["loss"] if records else None,
        "train": job.train, "lr": job.lr, "warmup": job.warmup, "batch": job.batch, "dtype": job.dtype,
        "ce_weight": job.ce_weight, "seed": job.seed,
        "heal_seconds": round(records[-1]["elapsed_s"], 1) if records else 0.0,
    }
    if teacher_eval is not None:
        evals = [r for r in records if "eval" in r]
        summary["eval"] = {"teacher": teacher_eval, "before": evals[0]["eval"], "after": evals[-1]["eval"],
                           "tokens": job.eval_tokens}
    base = dict(dec.manifest or {})
    base.pop("files", None)
    base.pop("format", None)
    write_decomposed(job.out, config=json.loads((job.model / "config.json").read_text()),
                     tensors=tensors, rank_config=dec.rank_config,
                     tokenizer_dir=job.model, inputs=(job.model, job.teacher), overwrite=job.overwrite,
                     metadata={**base, "healing": summary})
    run_state.remove(folder)
    log.info("healed %d steps in %.1f s → %s", steps, time.perf_counter() - start_time, job.out)
    return summary
