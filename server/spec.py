"""The run spec: what a client submits (`RunCreate`, validated once at the API) and what every layer after it
reads by attribute, from the route through the domain and the worker to the host call.

The database keeps a spec as JSON (`spec_dict`); `stored_spec` reads it back as the same typed object, once per
row (server/models.py: `Run.typed_spec`, `Attempt.typed_spec`). The server's schemas (server/schemas.py) and the
worker import it from here; nothing outside this module reads a spec by its keys (tests/test_spec_reads.py).
"""

import posixpath
import re
import unicodedata
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from server.log_patterns import FORMATS as LOG_FORMATS
from server.log_patterns import MAX_PATTERNS as MAX_LOG_PATTERNS
from server.log_patterns import compile_pattern, total_from_arguments

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL bytes")
    return value


def normalized_path(value: str) -> str:
    """An absolute path with `.`, empty components and trailing slashes gone: `//`, `/./` and `/.` are `/`
    (posixpath.normpath alone keeps a leading `//`)."""
    return "/" + posixpath.normpath(value).lstrip("/")


def is_inside(path: str, directory: str) -> bool:
    """Whether `path` lies strictly below `directory`, both compared normalised (no `..` may climb out)."""
    path, directory = normalized_path(path), normalized_path(directory)
    return ".." not in path.split("/") and path != directory and posixpath.commonpath([path, directory]) == directory


def _absolute_path(value: str) -> str:
    _no_nul(value)
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path (starting with /), got {value!r}")
    if ".." in value.split("/"):
        raise ValueError("must not contain '..' components")
    return normalized_path(value)


# bounds on what a run may carry to its host; the whole launch is bounded once more in server/runs.py
MAX_ARGS, MAX_ARG_CHARS = 1024, 16 * 1024
MAX_ENV_VARS, MAX_ENV_NAME, MAX_ENV_VALUE = 256, 256, 32 * 1024
# a path or name: PATH_MAX on Linux
MAX_STR = 4096


def _env(value: dict[str, str]) -> dict[str, str]:
    if len(value) > MAX_ENV_VARS:
        raise ValueError(f"at most {MAX_ENV_VARS} variables, got {len(value)}")
    for key, val in value.items():
        if len(key) > MAX_ENV_NAME or len(val) > MAX_ENV_VALUE:
            raise ValueError(f"{key[:64]!r}: names are at most {MAX_ENV_NAME} characters and values "
                             f"{MAX_ENV_VALUE}")
        if not ENV_NAME_RE.match(key):
            raise ValueError(f"{key!r} is not a valid environment variable name")
        if key.startswith("LONGRUN_"):
            raise ValueError(f"{key!r}: LONGRUN_* variables are set by longrun itself")
        _no_nul(val)
    return value


# what the API shows instead of an env value: values are write-only (a token in `env` must not leak through
# GET /v1/runs, a run's events or a dry run); the job still gets the real value
SECRET = "***"


def without_env_values(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec (or restart overrides) as the API shows it: `env` names kept, every value SECRET."""
    env = spec.get("env")
    if not isinstance(env, dict):
        return spec
    return {**spec, "env": dict.fromkeys(env, SECRET)}


AbsPath = Annotated[str, Field(max_length=MAX_STR), AfterValidator(_absolute_path)]
SafeStr = Annotated[str, Field(max_length=MAX_STR), AfterValidator(_no_nul)]
Arg = Annotated[str, Field(max_length=MAX_ARG_CHARS), AfterValidator(_no_nul)]
Env = Annotated[dict[str, str], AfterValidator(_env)]


def _unencodable(value: Any) -> bool:
    """Whether a string in `value` (JSON as parsed: any depth, keys too) is not text UTF-8 can encode: JSON's
    escapes let a lone surrogate (`"\\ud800"`) through, which no answer, log or host environment can carry."""
    if isinstance(value, str):
        if value.isascii():
            return False
        try:
            value.encode()
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_unencodable(k) or _unencodable(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_unencodable(v) for v in value)
    return False


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _text_only(cls, value: Any, info: ValidationInfo) -> Any:
        """Every field: no lone surrogate (pydantic lets them through a `str` without constraints, an `env` value or
        a restart's overrides); a field that is a model of its own says it of its own fields."""
        if _stored(info) or not isinstance(value, str | dict | list):
            return value
        annotation = cls.model_fields[info.field_name].annotation if info.field_name else None
        if isinstance(value, dict) and any(isinstance(a, type) and issubclass(a, Strict)
                                           for a in (annotation, *get_args(annotation))):
            return value
        if _unencodable(value):
            raise ValueError("must be text UTF-8 can encode: it holds a lone surrogate (such as \\ud800)")
        return value


# the validation context of a spec read back from the database (stored_spec): the rules between fields and the
# compilation of log patterns were applied when it was accepted, so a spec stored before a rule was added still reads
STORED = {"stored": True}


def _stored(info: ValidationInfo) -> bool:
    return bool(info.context) and info.context.get("stored") is True


# C0, DEL and C1: what a terminal obeys rather than shows (ESC starts a sequence that clears the screen, sets the
# title or writes the clipboard)
CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f]")


# Unicode's format characters (category Cf: zero-width spaces and joiners, bidi overrides and isolates, the BOM,
# soft hyphens) and its line and paragraph separators: unseen, or reordering what follows, so that `train` and
# `train` + U+200B are two names that look one, and U+202E shows `txt.exe` as `exe.txt` (UAX #31 keeps Cf out of
# identifiers; Trojan Source, CVE-2021-42574)
INVISIBLE_CATEGORIES = frozenset({"Cf", "Zl", "Zp"})


def _identifier(value: str, info: ValidationInfo) -> str:
    """A name or address: what the CLI and the page show and other requests name it by; no control characters nor
    invisible format characters (one stored before these rules still reads)."""
    if _stored(info):
        return value
    if found := CONTROL_CHARS.search(value):
        raise ValueError(f"must not hold control characters (U+{ord(found[0]):04X} at position {found.start()})")
    for i, char in enumerate(value):
        if unicodedata.category(char) in INVISIBLE_CATEGORIES:
            raise ValueError(f"must not hold invisible format characters (U+{ord(char):04X} "
                             f"{unicodedata.name(char, 'unnamed')} at position {i}): a name that holds one looks "
                             "like another without it")
    return value


Identifier = Annotated[str, Field(max_length=MAX_STR), AfterValidator(_identifier)]


class TrainerSpec(Strict):
    """The bundled trainer's flags (`python -m trainer.train --help`); unset ones take the trainer's defaults."""

    verifier_path: AbsPath
    data_dir: AbsPath
    data_format: Literal["auto", "longrun", "speculators", "specforge"] | None = None
    layer_ids: str | None = Field(None, pattern=r"^\d{1,4}(,\d{1,4}){2}$", description="the verifier layers whose "
                                  "inputs the features are, e.g. 2,16,29 (speculators >= 0.5 data records none)")
    vocab_mapping_dir: AbsPath
    output_dir: AbsPath
    epochs: int | None = Field(None, gt=0)
    lr: float | None = Field(None, gt=0)
    max_seq_len: int | None = Field(None, gt=0)
    num_workers: int | None = Field(None, ge=0)
    ttt_steps: int = Field(3, gt=0, le=64)
    ttt_step_decay: float | None = Field(None, gt=0, le=1)
    noise_std: float | None = Field(None, ge=0)
    scheduler: Literal["cosine", "linear", "constant"] | None = None
    warmup_ratio: float | None = Field(None, ge=0, le=1)
    val_ratio: float | None = Field(None, ge=0, lt=1)
    sim_depth: int | None = Field(None, ge=0, le=64, description="each validation simulates chain drafting to this "
                                  "depth: sim_acc_k, sim_tau_d (trainer default 16; 0: off)")
    sim_samples: int | None = Field(None, ge=0, description="validation sequences the simulation reads (0: all)")
    batch_size: int | None = Field(None, gt=0)
    global_batch_size: int | None = Field(None, gt=0, description="sequences per optimizer step over all ranks")
    global_batch_tokens: int | None = Field(None, gt=0)
    pack_samples: bool | None = None
    init_lm_head_from_verifier: bool | None = None
    draft_num_heads: int | None = Field(None, gt=0, description="default: the verifier's (DeepSeek-V3 / Kimi-K2: 56)")
    draft_num_kv_heads: int | None = Field(None, gt=0, description="default: the verifier's (DeepSeek-V3 / Kimi-K2: 8)")
    draft_head_dim: int | None = Field(None, gt=0, description="default: the verifier's (DeepSeek-V3 / Kimi-K2: 128)")
    fc_norm: bool | None = Field(None, description="EAGLE 3.1: an RMSNorm per captured feature before fc")
    norm_output: bool | None = Field(None, description="EAGLE 3.1: each TTT step reads the previous one after the final norm")
    export_format: str | None = Field(None, pattern=r"^(engine|speculators)(,(engine|speculators))*$",
                                      description="engine (always written), speculators: also <output_dir>/speculators/")
    grad_clip: float | None = Field(None, gt=0)
    save_every: int | None = Field(None, ge=0)
    max_steps: int | None = Field(None, gt=0)
    seed: int | None = None
    init_from: AbsPath | None = None
    no_resume: bool | None = None
    eval_corpus: AbsPath | None = Field(None, description="held-out text: the trainer measures acceptance by depth at the end")
    eval_max_depth: int | None = Field(None, gt=0, le=64)
    eval_samples: int | None = Field(None, gt=0)
    eval_new_tokens: int | None = Field(None, gt=0)
    report_to: str | None = Field(None, pattern=r"^(tensorboard|wandb)(,(tensorboard|wandb))*$",
                                  description="experiment trackers, e.g. tensorboard or tensorboard,wandb: one tracker "
                                  "run per longrun run, across its attempts")
    tracking_dir: AbsPath | None = Field(None, description="where trackers write; default <records>/<run>/tracking")


def _log_pattern(value: str, info: ValidationInfo) -> str:
    if not _stored(info):
        compile_pattern(value)  # the worker compiles a stored one again, leaving out one that no longer compiles
    return value


class LogMetricsSpec(Strict):
    """How progress is read from an `entrypoint` run's log (docs/guide.md: "Progress from your own trainer")."""

    formats: list[Literal["tqdm", "key_value", "json"]] = Field(
        default_factory=lambda: list(LOG_FORMATS), description="built-in formats recognised; [] for none")
    patterns: list[Annotated[str, AfterValidator(_log_pattern)]] = Field(
        default_factory=list, max_length=MAX_LOG_PATTERNS,
        description="regular expressions searched in each log line; each named group that matches a number is a "
                    "series (`step` and `total_steps` give progress), e.g. `it (?P<step>\\d+) loss (?P<loss>\\S+)`")
    total_steps: int | None = Field(None, gt=0, lt=2**31, description="the run's steps, when its log does not say")


# Slurm's spellings: partitions (a comma-separated list), accounts, time limits (minutes, MM:SS, HH:MM:SS, D-HH,
# D-HH:MM, D-HH:MM:SS, or UNLIMITED), GPUs per node (a count, or type:count)
SLURM_PARTITION_RE = re.compile(r"^[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*$")
SLURM_ACCOUNT_RE = re.compile(r"^[A-Za-z0-9_.+-]+$")
SLURM_TIME_RE = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
SLURM_GPUS_RE = re.compile(r"^([A-Za-z0-9_.-]+:)?[1-9]\d{0,3}$")
SLURM_OPTION_RE = re.compile(r"^--[a-z][a-z0-9-]*(=.*)?$")
# what longrun itself sets on every batch job: a run spec may not change it
SLURM_OWN_OPTIONS = frozenset({"--output", "--error", "--input", "--job-name", "--export", "--export-file", "--chdir",
                               "--open-mode", "--nodes", "--ntasks-per-node", "--ntasks", "--parsable", "--wrap",
                               "--array", "--partition", "--account", "--time", "--gpus-per-node"})
# sbatch reads options with getopt_long, which takes any unique prefix of a long option for it (`--arr=0-2` is
# `--array`) and an exact name before any prefix: these options of sbatch's own are exact names that also begin
# one of longrun's, so they stay theirs
SBATCH_OPTIONS_BEGINNING_OWN = frozenset({"--gpus"})


def _sbatch_option_meant(name: str) -> str | None:
    """The option of longrun's that sbatch would read `name` as, if any: itself, or one it abbreviates (an
    ambiguous abbreviation is refused too, being one of the possibilities)."""
    if name in SLURM_OWN_OPTIONS:
        return name
    if name in SBATCH_OPTIONS_BEGINNING_OWN:
        return None
    return next((own for own in sorted(SLURM_OWN_OPTIONS) if own.startswith(name)), None)


def _slurm_value(pattern: re.Pattern[str], what: str) -> Any:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value[:64]!r} is not a Slurm {what}")
        return value
    return AfterValidator(check)


def _sbatch_option(value: str) -> str:
    if any(c in value for c in "\n\r\x00"):
        raise ValueError("an #SBATCH line must not hold a line break or NUL")
    if not SLURM_OPTION_RE.match(value):
        raise ValueError(f"{value[:64]!r}: give one long option per item, `--name` or `--name=value` "
                         "(e.g. `--qos=high`, `--exclusive`)")
    name, _, rest = value.partition("=")
    if (own := _sbatch_option_meant(name)) is not None:
        spelled = "" if own == name else f" (sbatch reads {name} as {own})"
        raise ValueError(f"{own} is set by longrun (or by its own field in `slurm`){spelled}")
    if "'" in rest:
        raise ValueError("a value must not hold a single quote: sbatch cannot read it back from an #SBATCH line")
    return value


class SlurmSpec(Strict):
    """How a run's attempts are submitted on a host of kind `slurm`: each is one batch job (`sbatch`)."""

    nodes: int = Field(1, ge=1, le=1024, description="nodes per attempt; torchrun runs on each (srun), the first "
                       "node serving the c10d rendezvous")
    partition: Annotated[str, Field(max_length=255), _slurm_value(SLURM_PARTITION_RE, "partition")] | None = None
    account: Annotated[str, Field(max_length=255), _slurm_value(SLURM_ACCOUNT_RE, "account")] | None = None
    time_limit: Annotated[str, Field(max_length=32), _slurm_value(SLURM_TIME_RE, "time limit")] | None = Field(
        None, description="sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH:MM:SS or UNLIMITED; an attempt that Slurm "
        "ends at its limit is requeued as a new attempt that resumes from its checkpoint")
    gpus_per_node: Annotated[int, Field(ge=1, le=1024)] | Annotated[
        str, Field(max_length=64), _slurm_value(SLURM_GPUS_RE, "GPU count")] | None = Field(
        None, description="sbatch --gpus-per-node: a count, or type:count (h100:8)")
    sbatch_options: list[Annotated[str, Field(max_length=1024), AfterValidator(_sbatch_option)]] = Field(
        default_factory=list, max_length=64, description="more #SBATCH lines, one long option each (`--qos=high`, "
        "`--constraint=h100`, `--exclusive`)")


ENGINE_VERSION_RE = r"^v?\d{1,3}(\.\d{1,4}){0,2}([.+-][A-Za-z0-9.+-]{0,32})?$"


class DeploySpec(Strict):
    """Where the draft will be served: the proposal (GET /v1/runs/{id}/proposal) prices depths on this host's
    measured all-reduce table (`longrun hosts probe-interconnect HOST`) the way this engine runs the draft, for
    the verifier of its own config.json, and picks the retrain that pays most over what the deployment serves."""

    host: Identifier = Field(min_length=1, max_length=64, description="a registered host whose interconnect is measured")
    tp: int | None = Field(None, ge=1, le=64, description="the verifier's tensor parallelism (default: the "
                           "measured table's)")
    engine: Literal["sglang", "vllm", "measured"] = Field(
        "sglang", description="sglang: draft sharded at tp; vllm: by engine_version (V1, the default: sharded at "
        "tp; V0: draft_tp 1 replicated, or tp); measured: round_ms as timed")
    topk: int = Field(1, ge=1, le=64, description="1: chain drafting; more: a tree of top-k per draft step")
    draft_tp: int | None = Field(None, ge=1, le=64, description="vllm only: draft_tensor_parallel_size")
    round_ms: dict[int, Annotated[float, Field(gt=0)]] | None = Field(
        None, max_length=65, description="measured only: a round's cost by depth, ms (0: without speculation)")
    max_depth: int | None = Field(None, ge=1, le=64, description="the deepest speculation the deployment runs "
                                  "(SGLang's speculative_num_steps, vLLM's num_speculative_tokens): proposals stay "
                                  "within it")
    engine_version: Annotated[str, Field(max_length=48, pattern=ENGINE_VERSION_RE)] | None = Field(
        None, description="the engine's version (0.11.0; v0 / v1 for vLLM): where it places the draft. vLLM V1 (0.8 "
        "on, the default) shards an EAGLE draft at the target's tp whatever draft_tp says; V0 honours draft_tp 1")
    verifier: AbsPath | None = Field(None, description="the served verifier's config.json or model directory "
                                     "(default: the trainer's verifier_path): its layers, experts, attention and "
                                     "weight bits price each verifier forward")
    dp_attention: int | None = Field(None, ge=1, le=64, description="sglang only: --enable-dp-attention with "
                                     "--dp-size N; attention and the EAGLE-3 draft run in groups of tp/N ranks")
    ep: int | None = Field(None, ge=1, le=64, description="expert parallelism of an MoE verifier: 1 (experts "
                           "sliced by tp, the default) or the tp (whole experts per GPU, all-to-all dispatch)")
    context_tokens: int | None = Field(None, ge=0, le=1 << 24, description="the context whose KV cache each "
                                       "decode step reads (default 4096)")
    serve_tokens: float | None = Field(None, ge=0, le=1e18, description="tokens the draft will serve over its "
                                       "life: a restart is proposed only where the serving GPU-hours it saves over "
                                       "them exceed its extra training GPU-hours")
    train_gpu_hour_price: float | None = Field(None, ge=0, le=1e6, description="with serve_gpu_hour_price and "
                                               "serve_tokens: weigh training and serving GPU-hours at these prices")
    serve_gpu_hour_price: float | None = Field(None, ge=0, le=1e6)

    @model_validator(mode="after")
    def _engine_fields(self, info: ValidationInfo) -> "DeploySpec":
        if _stored(info):
            return self
        if self.draft_tp is not None and self.engine != "vllm":
            raise ValueError("draft_tp is vLLM's draft_tensor_parallel_size: give it with engine vllm")
        if self.dp_attention not in (None, 1) and (self.engine != "sglang" or (self.tp and self.tp % self.dp_attention)):
            raise ValueError("dp_attention is SGLang's --dp-size with --enable-dp-attention: engine sglang, and a tp "
                             "that is a multiple of it")
        if (self.round_ms is not None) != (self.engine == "measured"):
            raise ValueError("round_ms goes with engine measured, and engine measured needs it")
        if (self.train_gpu_hour_price is None) != (self.serve_gpu_hour_price is None):
            raise ValueError("give train_gpu_hour_price and serve_gpu_hour_price together")
        if self.train_gpu_hour_price is not None and self.serve_tokens is None:
            raise ValueError("GPU-hour prices weigh the GPU-hours over serve_tokens: give serve_tokens with them")
        if self.ep is not None and self.tp is not None and self.ep not in (1, self.tp):
            raise ValueError(f"ep is 1 (experts sliced by tp) or the tp ({self.tp}), not {self.ep}")
        return self


class RunCreate(Strict):
    name: Identifier = Field("run", min_length=1, max_length=255)
    host: Identifier | None = None
    hosts: list[Identifier] | None = Field(None, min_length=1, max_length=64)
    nproc_per_node: int = Field(1, gt=0, le=256)
    trainer: TrainerSpec | None = None
    entrypoint: AbsPath | None = None
    args: list[Arg] = Field(default_factory=list, max_length=MAX_ARGS)
    env: Env = Field(default_factory=dict, description="the job's environment; values are write-only: responses "
                     "and events show each name with `***` (a restart that overrides `env` sends every value again)")
    cwd: AbsPath | None = None
    output_dir: AbsPath | None = Field(None, description="what a restart with clean=true empties (trainer runs: trainer.output_dir)")
    max_retries: int = Field(0, ge=0, le=100)
    on_stall: Literal["restart"] | None = Field(
        None, description="`restart`: an attempt whose step stops moving (LONGRUN_STALL_FACTOR x its own step time, "
        "at least LONGRUN_STALL_FLOOR seconds) is restarted from its last checkpoint, counted against max_retries; "
        "unset: it is only marked stalled")
    log_metrics: LogMetricsSpec | None = Field(None, description="entrypoint runs: how progress is read from the log")
    slurm: SlurmSpec | None = Field(None, description="runs on a host of kind `slurm`: nodes, partition, account, "
                                    "time limit, GPUs per node and more #SBATCH options of each attempt's batch job")
    deploy: DeploySpec | None = Field(None, description="where the draft will be served: after each validation "
                                      "the service proposes a deeper TTT restart when it pays off there")
    on_proposal: Literal["restart"] | None = Field(
        None, description="`restart`: take a restart proposal by itself (clean, at the proposed TTT), at most once "
        "per run; unset: only propose")
    auto_restart_max_factor: float | None = Field(
        None, ge=1, le=1000, description="on_proposal: restart takes no restart (or probe) that would make what is "
        "left of the run more than this many times the current attempt's ETA (default 2)")

    @model_validator(mode="after")
    def _one_target(self, info: ValidationInfo) -> "RunCreate":
        if _stored(info):
            return self
        if (self.host is None) == (self.hosts is None):
            raise ValueError("give exactly one of `host` or `hosts`")
        if (self.trainer is None) == (self.entrypoint is None):
            raise ValueError("give exactly one of `trainer` or `entrypoint`")
        if self.trainer is not None and self.args:
            raise ValueError("`args` goes with `entrypoint`; trainer runs take their flags in `trainer`")
        if self.trainer is not None and self.log_metrics is not None:
            raise ValueError("`log_metrics` goes with `entrypoint`; the bundled trainer writes its metrics itself")
        return self

    @property
    def host_names(self) -> list[str]:
        return list(self.hosts) if self.hosts is not None else [self.host]  # type: ignore[list-item]

    @property
    def clean_dir(self) -> str | None:
        return self.trainer.output_dir if self.trainer else self.output_dir

    @property
    def ranks(self) -> int:
        """The processes the spec starts: nproc_per_node on each of its hosts."""
        return max(1, self.nproc_per_node) * max(1, len(self.host_names))

    @property
    def gpus(self) -> int:
        """The GPUs it trains on: nproc_per_node on each of its nodes (a Slurm run's `slurm.nodes`)."""
        return self.nproc_per_node * (self.slurm.nodes if self.slurm else len(self.host_names))

    @property
    def ttt_steps(self) -> int | None:
        """The TTT depth a bundled-trainer run trains with; None for an entrypoint run."""
        return self.trainer.ttt_steps if self.trainer else None

    @property
    def stated_total_steps(self) -> int | None:
        """An entrypoint run's total steps as its spec states them: `log_metrics.total_steps`, else its trainer's
        arguments (server/log_patterns.py total_from_arguments)."""
        given = self.log_metrics.total_steps if self.log_metrics else None
        return given or total_from_arguments(self.args, self.ranks)


# top-level fields a restart may override; any trainer field may be overridden too
RESTART_TOP_LEVEL = frozenset({"args", "nproc_per_node", "env", "name", "max_retries", "entrypoint", "cwd",
                               "log_metrics", "on_stall", "slurm", "deploy", "on_proposal",
                               "auto_restart_max_factor"})
TRAINER_FIELDS = frozenset(TrainerSpec.model_fields)


def spec_dict(spec: RunCreate) -> dict[str, Any]:
    """The spec as the database stores it (and the API shows it, env values hidden): JSON, unset fields left out."""
    return spec.model_dump(mode="json", exclude_none=True)


def stored_spec(stored: dict[str, Any]) -> RunCreate:
    """The typed spec of a stored one (spec_dict's output), read without the rules it passed when accepted."""
    return RunCreate.model_validate(stored, context=STORED)
