"""`specdistill serve`'s options: one pydantic model, `ServeOptions`, that states each flag's
type, default, bound and help once.

The command line is generated from it (serve/flags.py), and so is docs/cli.md's serve
section; `Server` (serve/server.py) takes it. A value out of its bounds is one `UserError`
naming the flag (`flag_error`): `ServeOptions(max_queue=-1)` says "--max-queue must be an
integer >= 0, got -1", and the command line says the same (one line, exit 2) before any
model loads. From the options come the limits each request is checked against
(`Limits`, serve/schema.py) and the draft length (`GammaSetting`, eval/length_policy.py).

Standard library, pydantic and light project modules only: `specdistill serve --help` loads
no model library.
"""

from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Literal, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from specdistill.errors import UserError
from specdistill.eval.cli_args import DEFAULT_GAMMA, DEFAULT_MAX_GAMMA, parse_gamma
from specdistill.serve.traffic import DEFAULT_SHARD_BYTES

MIN_POLL_S = 0.05  # --poll-s below this re-reads the drafts root in a busy loop
MAX_PORT = 65535
MAX_TOP_LOGPROBS = 20  # top logprobs a request (and the traffic log) may ask for
MIB = 1024 * 1024
PROMPT_CHARS_PER_TOKEN = 16  # --max-prompt-chars' default: this many per --max-model-len token,
MIN_PROMPT_CHARS = 4096  # and at least this many
MAX_JSON_DEPTH = 32
MAX_STOPS = 16
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class Cli:
    """A field's command-line extras: more names for its flag (`aliases`), and the required
    either-or group it belongs to (`one_of`: the group's name)."""

    aliases: tuple[str, ...] = ()
    one_of: str | None = None


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (serve/schema.py checks them): from `ServeOptions.limits`;
    the fixed ones are the same for every server."""

    max_model_len: int
    default_max_tokens: int
    max_body_bytes: int
    max_prompt_chars: int
    max_messages: int
    max_stops: int = MAX_STOPS
    max_stop_chars: int = MAX_STOP_CHARS
    max_json_depth: int = MAX_JSON_DEPTH


def _gamma(value):
    """--gamma: None (the default), or what `eval.cli_args.parse_gamma` reads."""
    return None if value is None else parse_gamma(value)


Source = Cli(one_of="source")  # --draft or --drafts, one of them


class ServeOptions(BaseModel):
    """Every option of `specdistill serve`, in --help's order (serve/server.py describes
    them; `Server` reads the ones it wires, the command line the address and the threads)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True, strict=True)

    target: Annotated[
        str, Field(description="HF id, local dir, embedded:<name> or registry:<name>")
    ]
    target_adapter: Annotated[
        str | None,
        Field(
            description="a peft LoRA adapter directory put on the target, unmerged (the target "
            "identity in the traffic log covers its files)"
        ),
    ] = None
    draft: Annotated[
        str | None, Source, Field(description="draft dir / HF id / embedded:<name>, or 'none'")
    ] = None
    drafts: Annotated[
        str | None, Source, Field(description="a published root: ROOT/vNNNNNN/ + ROOT/current")
    ] = None
    gamma: Annotated[
        int | Literal["auto"] | None,
        BeforeValidator(_gamma),
        Field(
            description="draft tokens per round (>= 1) or 'auto' (default: auto when the draft "
            f"has an acceptance head, else {DEFAULT_GAMMA}). Under auto the draft lengths follow "
            "measured timings and the load: a seeded request's output is still distributed "
            "exactly as the target's, and greedy output is the target's own, but seeded sampled "
            "output is not bit-reproducible across loads or machines (a fixed --gamma keeps it "
            "reproducible)"
        ),
    ] = None
    max_gamma: Annotated[
        int, Field(ge=1, description="most draft tokens per round under --gamma auto")
    ] = DEFAULT_MAX_GAMMA
    host: Annotated[str, Field(description="the address to listen on")] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=MAX_PORT, description="the port to listen on")] = 8000
    traffic: Annotated[str | None, Field(description="directory of the traffic log")] = None
    traffic_shard_mb: Annotated[
        float, Field(ge=1 / 1024, description="rotate traffic shards past this size")
    ] = DEFAULT_SHARD_BYTES / MIB
    log_top_logprobs: Annotated[
        int,
        Field(
            ge=0,
            le=MAX_TOP_LOGPROBS,
            description=f"log the target's top-K logprobs per token (K <= {MAX_TOP_LOGPROBS})",
        ),
    ] = 0
    max_num_seqs: Annotated[
        int,
        Cli(aliases=("--max-batch",)),
        Field(ge=1, description="rows decoded together (--max-batch: the same)"),
    ] = 8
    max_queue: Annotated[
        int,
        Field(
            ge=0,
            description="requests admitted beyond the running rows; past them 503 with Retry-After",
        ),
    ] = 64
    max_model_len: Annotated[
        int | None,
        Field(
            ge=2,
            description="prompt + completion tokens per request (default: the target's "
            "max_position_embeddings); more is a 400",
        ),
    ] = None
    max_body_bytes: Annotated[int, Field(ge=1024, description="request body cap (413 past it)")] = (
        1 << 20
    )
    max_prompt_chars: Annotated[
        int | None,
        Field(
            ge=1,
            description="prompt characters, checked before tokenising (default: "
            f"{PROMPT_CHARS_PER_TOKEN} x --max-model-len, at least {MIN_PROMPT_CHARS})",
        ),
    ] = None
    max_messages: Annotated[int, Field(ge=1, description="messages per chat request")] = 1024
    api_key: Annotated[
        str | None,
        Field(
            description="required as 'Authorization: Bearer KEY' on /v1/*; several "
            "comma-separated (default: $SPECDISTILL_API_KEY)"
        ),
    ] = None
    insecure: Annotated[
        bool, Field(description="allow serving beyond loopback (--host) without an API key")
    ] = False
    drain_s: Annotated[
        float,
        Field(ge=0, description="on SIGTERM/SIGINT: seconds running requests may take to finish"),
    ] = 30.0
    body_timeout_s: Annotated[
        float,
        Field(
            ge=0.1,
            description="seconds a client may take to send a request's body (408 past them); "
            "a request takes an admission slot only once its body is read",
        ),
    ] = 30.0
    poll_s: Annotated[
        float,
        Field(ge=MIN_POLL_S, description=f"--drafts: seconds between polls (>= {MIN_POLL_S})"),
    ] = 2.0
    max_tokens: Annotated[int, Field(ge=1, description="default max_tokens")] = 16
    served_model_name: Annotated[
        str | None, Field(description="the model name clients send (default: --target)")
    ] = None
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"], Field(description="the models' dtype")
    ] = "float32"
    device: Annotated[
        str | None, Field(description="cuda, cpu, ... (default: cuda if present)")
    ] = None
    threads: Annotated[
        int | None,
        Field(
            ge=1,
            description="torch intra-op CPU threads, at most 4 per core (default: the cores "
            "free at start-up, re-checked)",
        ),
    ] = None

    def __init__(self, **values):
        """The options, checked; a value out of bounds is a `UserError` naming its flag."""
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise UserError(flag_error(e, type(self))) from None

    @model_validator(mode="after")
    def _one_source(self) -> "ServeOptions":
        if self.draft is not None and self.drafts is not None:
            raise ValueError("give --draft or --drafts, not both")
        return self

    @property
    def shard_bytes(self) -> int:
        """--traffic-shard-mb in bytes."""
        return int(self.traffic_shard_mb * MIB)

    @property
    def model_name(self) -> str:
        """The name clients send and responses carry."""
        return self.served_model_name or self.target

    @property
    def target_name(self) -> str:
        """The target as the traffic records name it: with its adapter, if any."""
        return f"{self.target}+{self.target_adapter}" if self.target_adapter else self.target

    def limits(self, context: int | None) -> Limits:
        """What one request may ask for; `context`: the target's positions (its config's
        max_position_embeddings; None: unnamed), --max-model-len's default."""
        if self.max_model_len is None and not context:
            raise UserError(
                f"{self.target}: its config names no max_position_embeddings; give --max-model-len"
            )
        max_model_len = self.max_model_len or context
        prompt_chars = max(PROMPT_CHARS_PER_TOKEN * max_model_len, MIN_PROMPT_CHARS)
        return Limits(
            max_model_len=max_model_len,
            default_max_tokens=self.max_tokens,
            max_body_bytes=self.max_body_bytes,
            max_prompt_chars=self.max_prompt_chars or prompt_chars,
            max_messages=self.max_messages,
        )


# ----------------------------------------------------------------------------- fields


def flag_name(field: str) -> str:
    """The flag of a field: `max_num_seqs` -> `--max-num-seqs`."""
    return "--" + field.replace("_", "-")


def cli_of(field: FieldInfo) -> Cli:
    """The field's command-line extras (none: `Cli()`)."""
    return next((m for m in field.metadata if isinstance(m, Cli)), Cli())


def value_type(field: FieldInfo):
    """The field's one type besides None (int, str, a Literal, ...); None for a union."""
    annotation = field.annotation
    if get_origin(annotation) in (Union, UnionType):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else None
    return annotation


def choices(field: FieldInfo) -> tuple | None:
    """The values a Literal field takes (None: not a Literal)."""
    kind = value_type(field)
    return get_args(kind) if get_origin(kind) is Literal else None


def bound_text(field: FieldInfo) -> str:
    """What the field takes, for an error: "an integer >= 1", "a finite number in [0, 1]"."""
    kind = value_type(field)
    if choices(field):
        return "one of " + ", ".join(map(str, choices(field)))
    noun = {int: "an integer", float: "a finite number", bool: "true or false"}.get(kind, "text")
    low = next((m.ge for m in field.metadata if hasattr(m, "ge")), None)  # Field(ge=...)
    high = next((m.le for m in field.metadata if hasattr(m, "le")), None)
    if low is not None and high is not None:
        return f"{noun} in [{low}, {high}]"
    return f"{noun} >= {low}" if low is not None else noun


def flag_error(e: ValidationError, model: type[BaseModel]) -> str:
    """The first of `e`'s errors as one line that names the flag."""
    error = e.errors(include_url=False)[0]
    if not error["loc"]:  # a check across options: its own message
        return str(error["ctx"]["error"])
    name = str(error["loc"][0])
    flag = flag_name(name)
    if error["type"] == "extra_forbidden":
        return f"{name}: not an option of `specdistill serve` (docs/cli.md)"
    if error["type"] == "missing":
        return f"{flag} is required"
    if error["type"] == "value_error":
        return f"{flag} {error['ctx']['error']}"
    shown = error["input"]
    return f"{flag} must be {bound_text(model.model_fields[name])}, got {shown!r}"
