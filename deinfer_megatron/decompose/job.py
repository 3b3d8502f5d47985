"""The ``decompose`` job: dense model folder (or Megatron checkpoint) in, decomposed folder out."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deinfer_megatron.checkpoints.folder import RANK_CONFIG, is_project_folder, open_model, write_decomposed
from deinfer_megatron.decompose.allocation import ALLOCATOR_VERSION, check_ratio, layer_of, uniform_ranks
from deinfer_megatron.decompose.calibration import (SELF_TEMPERATURE, check_answers, check_temperature,
                                                    check_text_budget, self_dialogues, self_samples, text_windows)
from deinfer_megatron.decompose.run import Plan, decompose_model, decomposed_state, nothing_to_decompose
from deinfer_megatron.decompose.update import UPDATE_DAMP, UPDATES
from deinfer_megatron.files.staging import claim_output
from deinfer_megatron.files.text import read_text
from deinfer_megatron.arch.model import ModelArch, arch_from_hf_config, load_arch
from deinfer_megatron.checkpoints.megatron_ckpt import (
    detect_megatron_checkpoint,
    read_megatron_checkpoint,
    tokenizer_folder,
)
from deinfer_megatron.specs.rank_config import RankConfig

log = logging.getLogger(__name__)
METHODS = ("svd", "asvd", "svd-llm")
ALLOCATIONS = ("uniform", "variadic", "fisher")


@dataclass(frozen=True)
class DecomposeJob:
    model: Path
    method: str
    ratio: float | None = None
    rank_config: Path | None = None
    allocation: str = "uniform"
    calib_text: Path | tuple[Path, ...] | None = None  # one file, or several sharing the windows
    calib_self: int | None = None
    calib_tokens: int = 4096
    calib_seq_len: int = 256
    layers: str | None = None
    sequential: bool = True
    out: Path | None = None
    tokenizer: Path | None = None
    seed: int = 0
    asvd_alpha: float = 1.0
    overwrite: bool = False
    update: str = "none"
    update_damp: float = UPDATE_DAMP
    calib_temperature: float | None = None  # --calib-self sampling; None: SELF_TEMPERATURE
    calib_answers: str = "sampled"  # --calib-self answers: sampled or greedy (chat models)

    @property
    def calib_files(self) -> tuple[Path, ...]:
        """The ``--calib-text`` files as a tuple (empty without text calibration)."""
        if self.calib_text is None:
            return ()
        return (Path(self.calib_text),) if isinstance(self.calib_text, (str, Path)) else tuple(map(Path, self.calib_text))

    @property
    def temperature(self) -> float:
        return SELF_TEMPERATURE if self.calib_temperature is None else self.calib_temperature


def parse_layers(spec: str, num_layers: int) -> frozenset[int]:
    """``"0-9,12"`` → {0..9, 12}; every index must exist."""
    out: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--layers {spec!r} is not a list of layers like '0-9,12'") from None
    bad = sorted(i for i in out if not 0 <= i < num_layers)
    if bad or not out:
        raise ValueError(f"--layers {spec!r} names layers outside 0..{num_layers - 1}")
    return frozenset(out)


def _load_dense(job: DecomposeJob) -> tuple[Any, dict[str, Any], Path | None]:
    """(Hugging Face model in float32, its config dict, the folder holding its tokenizer)."""
    import transformers

    if detect_megatron_checkpoint(job.model) is not None:
        tokenizer_dir = job.tokenizer or tokenizer_folder(job.model)
        if tokenizer_dir is None:
            raise ValueError("a Megatron checkpoint has no Hugging Face tokenizer: pass --tokenizer DIR")
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        config, state = read_megatron_checkpoint(job.model, vocab_size=len(tokenizer))
        hf_config = transformers.AutoConfig.for_model(**config)
        model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
        model.load_state_dict(state, strict=not config.get("tie_word_embeddings", False))
        if config.get("tie_word_embeddings"):
            model.tie_weights()
        _check_finite(model, job.model)
        return model.float().eval(), config, tokenizer_dir
    config_path = job.model / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{job.model} is neither a Hugging Face model folder (config.json) nor a Megatron checkpoint"
        )
    if (job.model / RANK_CONFIG).is_file():
        raise ValueError(f"{job.model} is already decomposed; decompose the dense model it came from")
    # Shapes (and a fetch-model folder's checksums) are checked before transformers reads the
    # weights: it would silently re-initialise a tensor whose shape does not match config.json.
    open_model(job.model)
    config = json.loads(config_path.read_text())
    transformers.utils.logging.disable_progress_bar()  # decompose draws its own progress
    model = transformers.AutoModelForCausalLM.from_pretrained(
        job.model, attn_implementation="sdpa", dtype=torch.float32
    )
    _check_finite(model, job.model)
    return model.eval(), config, job.tokenizer or job.model


def _check_finite(model: Any, source: Path) -> None:
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise ValueError(f"{source}: tensor {name} holds NaN or infinite values; the checkpoint "
                             "is corrupted — re-create or re-download it")


def _calibration(job: DecomposeJob, model: Any, tokenizer_dir: Path | None, arch: ModelArch) -> tuple[torch.Tensor | None, dict]:
    needs_data = (job.method != "svd" or job.update != "none"
                  or (job.allocation in ("variadic", "fisher") and job.rank_config is None))
    if not needs_data:
        return None, {"source": "none"}
    if job.calib_text is not None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        ids = text_windows(tokenizer, job.calib_files, seq_len=job.calib_seq_len, max_tokens=job.calib_tokens)
        source = "text:" + ",".join(f.name for f in job.calib_files)
        return ids, {"source": source, "tokens": ids.numel(), "seq_len": job.calib_seq_len}
    if job.calib_self is not None:
        tokenizer = _maybe_tokenizer(tokenizer_dir)
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            ids = self_dialogues(model, tokenizer, n=job.calib_self, seq_len=job.calib_seq_len, seed=job.seed,
                                 temperature=job.temperature, answers=job.calib_answers)
            kind = "self-dialogues"
        elif job.calib_answers != "sampled":
            raise ValueError(f"--calib-answers {job.calib_answers} needs a chat model (a tokenizer with a chat "
                             "template): this model has no turns to answer; drop --calib-answers")
        elif arch.bos_token_id is not None:
            ids = self_samples(model, arch.bos_token_id, n=job.calib_self, seq_len=job.calib_seq_len, seed=job.seed,
                               temperature=job.temperature)
            kind = "self"
        else:
            raise ValueError("the model has neither a chat template nor a bos_token_id to sample from; use --calib-text")
        made = {"source": f"{kind}:{job.calib_self}", "tokens": ids.numel(), "seq_len": job.calib_seq_len,
                "temperature": job.temperature}
        return ids, made | ({"answers": job.calib_answers} if job.calib_answers != "sampled" else {})
    if job.method == "svd" and job.update == "none" and job.allocation != "fisher":
        return None, {"source": "none"}  # variadic svd ranks from plain singular values
    raise ValueError(f"{job.method} needs calibration data: pass --calib-text FILE or --calib-self N")


def _maybe_tokenizer(tokenizer_dir: Path | None) -> Any:
    """The folder's tokenizer, or None when it has none (a bare config + weights folder)."""
    import transformers

    if tokenizer_dir is None or not any((Path(tokenizer_dir) / f).is_file()
                                        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def _validate(job: DecomposeJob) -> None:
    if job.method not in METHODS:
        raise ValueError(f"unknown --method {job.method!r}; choose one of {', '.join(METHODS)}")
    if (job.ratio is None) == (job.rank_config is None):
        raise ValueError("give exactly one of --ratio R or --rank-config FILE")
    if job.ratio is not None:
        check_ratio(job.ratio)
    if job.rank_config is not None and job.layers is not None:
        raise ValueError("--layers selects layers for --ratio; a --rank-config already lists its modules")
    if job.allocation not in ALLOCATIONS:
        raise ValueError(f"unknown --allocation {job.allocation!r}; choose one of {', '.join(ALLOCATIONS)}")
    if job.update not in UPDATES:
        raise ValueError(f"unknown --update {job.update!r}; choose one of {', '.join(UPDATES)}")
    if job.calib_text is not None and job.calib_self is not None:
        raise ValueError("give at most one of --calib-text and --calib-self")
    if job.calib_text is None and job.calib_self is None:
        if job.method != "svd":
            raise ValueError(f"{job.method} needs calibration data: pass --calib-text FILE or --calib-self N")
        if job.update != "none":
            raise ValueError(f"--update {job.update} fits the factors to calibration data: "
                             "pass --calib-text FILE or --calib-self N, or --update none")
        if job.allocation == "fisher" and job.rank_config is None:
            raise ValueError("--allocation fisher measures each matrix's sensitivity on calibration data: "
                             "pass --calib-text FILE or --calib-self N, or use --allocation variadic")
    if job.calib_self is not None and job.calib_self < 1:
        raise ValueError(f"--calib-self must be at least 1 sequence, got {job.calib_self}")
    check_temperature(job.calib_temperature, job.calib_self)
    check_answers(job.calib_answers, job.calib_self)
    if not job.update_damp >= 0:  # NaN fails too
        raise ValueError(f"--update-damp must be a number ≥ 0 (a fraction of the mean diagonal of XᵀX), "
                         f"got {job.update_damp}")
    if job.asvd_alpha <= 0:
        raise ValueError(f"--asvd-alpha must be > 0, got {job.asvd_alpha}")
    if job.calib_tokens < job.calib_seq_len:
        raise ValueError(f"--calib-tokens {job.calib_tokens} is less than one window of {job.calib_seq_len}")
    if not job.model.exists():
        raise FileNotFoundError(f"--model {job.model} does not exist")
    if job.calib_text is not None:  # before the model is loaded: a binary file fails in a second
        check_text_budget(len(job.calib_files), seq_len=job.calib_seq_len, max_tokens=job.calib_tokens)
        for path in job.calib_files:
            read_text(path, "calibration text", max_chars=job.calib_tokens * 12)
    if (job.model / "config.json").is_file():  # a Hugging Face folder: its sizes are known now
        arch = load_arch(job.model)
        if job.rank_config is not None:
            RankConfig.load(job.rank_config, arch)
        if job.layers is not None:
            parse_layers(job.layers, arch.num_layers)
        if job.ratio is not None and job.allocation == "uniform":  # known before anything is loaded
            layers = parse_layers(job.layers, arch.num_layers) if job.layers else None
            if not uniform_ranks(arch, job.ratio, layers):
                raise ValueError(nothing_to_decompose(job.ratio))
    claim_output(job.out or default_out(job), overwrite=job.overwrite, is_ours=is_project_folder,
                 inputs=(job.model,))


def default_out(job: DecomposeJob) -> Path:
    tag = f"r{job.ratio:g}-{job.allocation}" if job.ratio is not None else job.rank_config.stem
    if job.update != "none":
        tag += f"-{job.update}-update"
    return job.model.parent / f"{job.model.name}-{job.method}-{tag}"


def run_decompose(job: DecomposeJob) -> Path:
    """Decompose ``job.model`` and write the folder; returns its path."""
    _validate(job)
    torch.manual_seed(job.seed)
    start = time.perf_counter()
    model, config, tokenizer_dir = _load_dense(job)
    arch = arch_from_hf_config(config)
    explicit = RankConfig.load(job.rank_config, arch).modules if job.rank_config else None
    layers = parse_layers(job.layers, arch.num_layers) if job.layers else frozenset(range(arch.num_layers))
    calib, calib_info = _calibration(job, model, tokenizer_dir, arch)
    plan = Plan(job.method, explicit, job.ratio, job.allocation, layers, job.sequential, job.asvd_alpha, job.update,
                job.update_damp)
    ranks, factors = decompose_model(model, arch, plan, calib)
    rank_config = RankConfig.from_mapping(ranks, arch)
    tensors = decomposed_state(model, factors, arch.tied_embeddings)
    shapes = arch.linear_shapes()
    factored = sum(r * sum(shapes[n]) for n, r in ranks.items())
    kept = factored / max(1, sum(m * k for n, (m, k) in shapes.items() if n in ranks))
    # the ratio's budget: every matrix of the chosen layers, those kept dense at m·n
    targeted = {n: s for n, s in shapes.items() if layer_of(arch, n) in layers or n in ranks}
    dense = sorted(n for n in targeted if n not in ranks)
    kept_all = (factored + sum(m * k for n, (m, k) in targeted.items() if n not in ranks)) / max(
        1, sum(m * k for m, k in targeted.values()))
    out = job.out or default_out(job)
    write_decomposed(
        out,
        config=config,
        tensors=tensors,
        rank_config=rank_config,
        tokenizer_dir=tokenizer_dir,
        overwrite=job.overwrite,
        inputs=(job.model,),
        metadata={
            "method": job.method,
            "ratio": job.ratio,
            "allocation": job.allocation if job.rank_config is None else "rank-config",
            "sequential": job.sequential,
            "update": job.update,
            **({"update_damp": job.update_damp} if job.update != "none" else {}),
            **({"asvd_alpha": job.asvd_alpha} if job.method == "asvd" else {}),
            "calibration": calib_info,
            "layers": sorted(layers),
            "kept_fraction_of_decomposed": round(kept, 6),
            "kept_fraction": round(kept_all, 6),
            "dense_matrices": len(dense),
            "allocator": ALLOCATOR_VERSION,
            "source_model": str(job.model),
        },
    )
    log.info("decomposed %d matrices (%d kept dense) in %.1f s → %s", len(ranks), len(dense),
             time.perf_counter() - start, out)
    return out
