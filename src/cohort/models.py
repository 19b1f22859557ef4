"""Load policy / reference models and tokenizers, wrap them with LoRA, and build a tiny local model.

Everything goes through ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``: a tiny model
built by :func:`build_tiny_model` is saved with ``save_pretrained`` and loaded back exactly like a
real checkpoint, so the demo exercises the same code path as a 7B run.

The tiny tokenizer is character-level for ASCII but stored in GPT-2's byte-level alphabet (space is
``Ġ``, newline ``Ċ``), with every one of the 256 bytes in the vocabulary. Why: transformers 5 loads
any folder whose config says ``model_type: qwen2`` with ``Qwen2Tokenizer``, whatever
``tokenizer_config.json`` names, and that class rebuilds a byte-level pre-tokenizer and decoder on
top of the saved vocabulary. A plain character vocabulary (a literal ``" "`` token) then loses every
space on the way through. In the byte-level alphabet both loaders, ``Qwen2Tokenizer`` and
``PreTrainedTokenizerFast``, produce the same ids and decode any UTF-8 string losslessly.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import os
import string
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cohort.choices import DTYPE_NAMES
from cohort.episodes.templates import install_tool_format
from cohort.errors import first_line
from cohort.report.progress import quiet_hf_progress

if TYPE_CHECKING:
    from cohort.config import LoraConfig

__all__ = [
    "ADAPTER_CONFIG",
    "CHAR_VOCAB",
    "DTYPES",
    "TINY_CHAT_TEMPLATE",
    "TINY_SIZES",
    "adapter_base",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "cache_kwargs",
    "count_parameters",
    "forward_accepts",
    "fix_adapter_base_path",
    "is_adapter_folder",
    "load_model",
    "load_tokenizer",
    "looks_like_path",
    "model_not_found",
    "resolve_dtype",
    "run_dir_hint",
    "save_merged",
    "stop_token_ids",
    "unwrap",
    "wrap_lora",
]

CHAR_VOCAB: str = "\n " + string.digits + string.ascii_letters + string.punctuation
"""Characters of the tiny tokenizer that get the lowest ids (one token each), in id order after the
special tokens. Any other character still round-trips as its UTF-8 bytes (one token per byte)."""

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|bos|>"

TINY_CHAT_TEMPLATE: str = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}"
    # an explicit '\n' expression: HF renders templates with trim_blocks, which eats a literal newline
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
"""Plain-text chat template of the tiny tokenizer: ``"User: 1+2=\\nAssistant: "``."""

TINY_SIZES: dict[str, dict[str, int]] = {
    # about 0.52 M parameters with the 258-token vocabulary (untied embeddings)
    "0.5m": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 416},
    # about 14.4 M parameters
    "14m": {"hidden_size": 384, "num_layers": 8, "num_heads": 6, "intermediate_size": 1024},
}
"""Named size presets for :func:`build_tiny_model`: ``build_tiny_model(d, **TINY_SIZES["14m"])``."""

DTYPES: dict[str, torch.dtype | str] = {
    name: "auto" if kind == "auto" else getattr(torch, kind) for name, kind in DTYPE_NAMES.items()
}
"""Parameter dtypes by name (the values of ``model.dtype`` and ``load_model(dtype=...)``); "auto" keeps
the checkpoint's own dtype. The names are ``cohort.choices.DTYPE_NAMES`` (what the config checks)."""


# ---------------------------------------------------------------------------------------------
# tiny model factory
# ---------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """Returns GPT-2's reversible byte -> printable character map (the ByteLevel alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tiny_tokenizer(*, add_bos: bool = False):
    """Returns the tiny character-level ``PreTrainedTokenizerFast`` (pad id 0, eos id 1, chat template set).

    ``add_bos=True`` adds a ``<|bos|>`` token (id 2) that the tokenizer prepends whenever it adds
    special tokens, as Llama-family tokenizers do; the chat template does not write it.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_char = _bytes_to_unicode()
    specials = [PAD_TOKEN, EOS_TOKEN] + ([BOS_TOKEN] if add_bos else [])
    tokens = specials + [byte_char[ord(c)] for c in CHAR_VOCAB]
    seen = set(tokens)
    tokens += [byte_char[b] for b in range(256) if byte_char[b] not in seen]
    vocab = {tok: i for i, tok in enumerate(tokens)}

    # BPE without merges = one token per byte; the same pipeline Qwen2Tokenizer rebuilds on load.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN if add_bos else None,
        # like Llama's tokenizers: encoding with add_special_tokens=True prepends the BOS (a post-processor,
        # saved in tokenizer.json, so every loader keeps it)
        add_bos_token=add_bos,
        # WordPiece-style cleanup turns "a , b" into "a, b" on decode; 5.23 skips it for BPE, older 5.x don't
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    out_dir: str | os.PathLike,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
    vocab_size: int | None = None,
    add_bos: bool = False,
    tie_word_embeddings: bool = False,
    tool_format: str | None = None,
) -> Path:
    """Returns ``out_dir`` after saving a randomly initialised tiny Qwen2ForCausalLM and its char tokenizer there.

    ``vocab_size=None`` uses the tokenizer's size (258, or 259 with ``add_bos``); a larger value pads
    the embedding (e.g. 151936, Qwen2.5's vocabulary, for memory benchmarks) and leaves the extra ids
    unused. ``intermediate_size=None`` means ``4 * hidden_size``. Sizes: see :data:`TINY_SIZES`.

    Embeddings are untied by default: in a model this small, with tied weights every policy-gradient
    step on the output side of the digit tokens also moves their input embeddings, and GRPO from a
    half-trained warm start then loses accuracy instead of gaining it (measured: 28 % -> 7 % held-out
    in 100 steps tied, 40 % -> 52 % in 60 steps untied, same recipe).

    ``tool_format`` ("hermes", "llama3", "mistral") installs cohort's tool-calling chat template of that family
    on the tokenizer (its turn markers become tokens of their own, the turn's end the EOS), for tool-use runs.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden_size <= 0 or num_layers <= 0 or num_heads <= 0:
        raise ValueError(
            f"hidden_size={hidden_size}, num_layers={num_layers}, num_heads={num_heads} must all be positive"
        )
    if hidden_size % num_heads:
        raise ValueError(
            f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}; "
            f"pick e.g. num_heads in {[h for h in range(1, 17) if hidden_size % h == 0]}"
        )
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must be a positive divisor of num_heads={num_heads}")

    tokenizer = build_tiny_tokenizer(add_bos=add_bos)
    if tool_format is not None:
        install_tool_format(tokenizer, tool_format)
    n_tokens = len(tokenizer)
    vocab_size = n_tokens if vocab_size is None else vocab_size
    if vocab_size < n_tokens:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the tiny tokenizer's {n_tokens} tokens; "
            f"use None (exactly {n_tokens}) or a larger value such as 151936"
        )

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        use_sliding_window=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with quiet_hf_progress():  # no "Writing model shards" bar for a model of a few MiB
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 writes its internal name "TokenizersBackend"; the public alias also loads in 4.x
    # and in tools that resolve the class by name (the byte-level vocabulary keeps ids identical either way)
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text(encoding="utf-8"))
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    return out


def count_parameters(model: torch.nn.Module, *, trainable: bool = False) -> int:
    """Returns the number of (distinct, so tied weights count once) parameters, optionally trainable only."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def _not_found(name_or_path: str, reason: str) -> ValueError:
    """Returns the error raised when a model/tokenizer can be neither found locally nor downloaded."""
    return ValueError(
        f"{name_or_path!r} is neither a local model folder nor a model that could be downloaded from the "
        f"Hugging Face Hub ({reason}). Pass the path of a folder saved with save_pretrained, e.g. the tiny "
        "model that `cohort demo` builds (or cohort.models.build_tiny_model(DIR)), or a Hub name such as "
        "'Qwen/Qwen2.5-0.5B-Instruct' on a machine that can reach the Hub."
    )


def model_not_found(name_or_path: str | os.PathLike, exc: BaseException) -> ValueError:
    """Returns the error for a model or tokenizer that transformers' loader could neither find locally nor
    download (its OSError `exc`), as cohort's own loaders word it."""
    return _not_found(os.fspath(name_or_path), first_line(exc))


def corrupt_weights_error(name_or_path: str, exc: Exception) -> ValueError | None:
    """Returns the error for a weights file that exists but cannot be read (truncated, overwritten), else None."""
    import pickle

    if type(exc).__name__ != "SafetensorError" and not isinstance(exc, (pickle.UnpicklingError, EOFError)):
        return None
    folder = Path(name_or_path).expanduser()
    files = sorted(p.name for p in folder.glob("*.safetensors")) + sorted(
        p.name for p in folder.glob("*.bin")
    )
    named = f" ({', '.join(files)})" if files else ""
    reason = first_line(exc)
    return ValueError(
        f"the weights file of {name_or_path!r}{named} is corrupt or truncated ({reason}); copy or download the "
        "model again, or save it again with save_pretrained"
    )


def looks_like_path(name: str) -> bool:
    """Returns True when ``name`` can only be a filesystem path, never a Hub repo id ("org/name").

    Besides names that no Hub id can have (``./x``, ``../x``, ``/x``, ``~/x``, two or more slashes),
    an ``org/name`` whose ``org`` is a folder in the working directory counts as a path into that folder
    (``runs/tiny-typo``). Only the local filesystem is consulted, never the network.
    """
    return (
        name.startswith((".", "/", "~"))
        or "\\" in name
        or name.count("/") > 1
        or name.endswith("/")
        or (os.name == "nt" and len(name) > 1 and name[1] == ":")
        or (name.count("/") == 1 and Path(name.split("/", 1)[0]).is_dir())
    )


def _missing_reason(name: str) -> str:
    """Returns why the local path ``name`` is not a folder: its deepest existing parent and what that holds."""
    path = Path(name).expanduser()
    parent = next((p for p in path.parents if p.is_dir()), None)
    if parent is None or parent == Path("."):
        return "no such folder"
    try:
        entries = sorted(p.name for p in parent.iterdir() if not p.name.startswith("."))
    except OSError:
        entries = []
    shown = f"{entries[:10]}{' ...' if len(entries) > 10 else ''}"
    reason = f"no such folder; {str(parent)!r} exists and holds {shown}"
    if not name.startswith((".", "/", "~")) and name.count("/") == 1:
        reason += (
            f"; a name 'org/model' whose org is a folder here ({str(parent)!r}) is read as a local path, "
            "so to download a Hub model of that name run from another folder"
        )
    return reason


def _check_source(name_or_path: str | os.PathLike, needed: str) -> str:
    """Returns the source as a string (the absolute path of a local folder) after rejecting local paths
    that cannot be a saved model.

    A local folder is returned absolute so that what records it (``config._name_or_path``, and through
    it the ``base_model_name_or_path`` of a LoRA adapter saved by peft) still resolves from elsewhere.
    """
    name = os.fspath(name_or_path)
    if not isinstance(name, str) or not name:
        raise ValueError(f"model name or path {name_or_path!r} must be a non-empty string or path")
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(
                f"{name!r} is a file, not a model folder; pass the folder that holds config.json "
                "(as written by save_pretrained)"
            )
        if not (path / needed).exists():
            raise ValueError(
                f"folder {name!r} exists but holds no {needed}; pass a folder written by save_pretrained "
                f"(found: {sorted(p.name for p in path.iterdir())[:10]}){run_dir_hint(name)}"
            )
        return os.path.abspath(path)
    if looks_like_path(name):
        raise _not_found(name, _missing_reason(name))
    return name


RUN_DIR_MARKERS = ("metrics.jsonl", "evals.jsonl", "summary.json", "checkpoints")
"""What a cohort run directory (a training run's out_dir) holds and a model folder does not."""

RUN_MODEL_FOLDERS = ("final", "model")
"""Where a run directory keeps its trained model: final/ (`cohort train`), model/ (`cohort rm`)."""


def _holds_model(folder: Path) -> bool:
    """Returns True when `folder` holds a saved model or LoRA adapter (config.json or adapter_config.json)."""
    return (folder / "config.json").is_file() or (folder / ADAPTER_CONFIG).is_file()


def run_dir_hint(name_or_path: str | os.PathLike) -> str:
    """Returns "; NAME is a cohort run directory: ..." naming the model folder inside it (its final model,
    else its newest checkpoint that holds one) when `name_or_path` is a run directory, else ""."""
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    try:
        if not path.is_dir() or not any((path / m).exists() for m in RUN_DIR_MARKERS):
            return ""
        final = next((path / f for f in RUN_MODEL_FOLDERS if _holds_model(path / f)), None)
        if final is not None:
            return (
                f"; {name} is a cohort run directory: its trained model is {os.path.join(name, final.name)}"
            )
        steps = [(int(p.name[5:]), p) for p in (path / "checkpoints").glob("step-*") if p.name[5:].isdigit()]
        newest = next((p for _, p in sorted(steps, reverse=True) if _holds_model(p)), None)
    except OSError:  # an unreadable folder: the error it goes with says enough
        return ""
    final_path = os.path.join(name, "final")
    resume = "run its command again (with resume=auto for `cohort train`) to finish it"
    if newest is not None:
        return (
            f"; {name} is a cohort run directory without its final model (the run stopped before its final "
            f"save): pass its newest checkpoint, {os.path.join(name, 'checkpoints', newest.name)}, or {resume} "
            f"and write {final_path}"
        )
    return (
        f"; {name} is a cohort run directory without a trained model (no {final_path}, no checkpoint holding "
        f"one): {resume} and write {final_path}"
    )


def check_model_source(name_or_path: str | os.PathLike, *, files: tuple[str, ...] = ()) -> None:
    """Returns None when `name_or_path` may name a model (a folder that exists, or a Hub name); raises the
    loader's ValueError for a local path that is no folder, before anything is loaded or imported.

    `files`: what an existing local folder must also hold, checked as the loaders check it (a folder
    without them, such as a run directory or a data folder, gets the loaders' message)."""
    name = os.fspath(name_or_path)
    if name and not Path(name).expanduser().exists() and looks_like_path(name):
        raise _not_found(name, _missing_reason(name))
    if name and Path(name).expanduser().exists():
        for needed in files:
            _check_source(name, needed)


ADAPTER_CONFIG = "adapter_config.json"
"""The file that marks a folder as a peft adapter (written by ``PeftModel.save_pretrained``)."""


def is_adapter_folder(name_or_path: str | os.PathLike) -> bool:
    """Returns True when ``name_or_path`` is a local folder holding a peft adapter (an adapter_config.json)."""
    try:
        return (Path(os.fspath(name_or_path)).expanduser() / ADAPTER_CONFIG).is_file()
    except (TypeError, ValueError, OSError):
        return False


def adapter_base(folder: str | os.PathLike) -> str:
    """Returns the base model (Hub name or folder) of a LoRA adapter folder: its adapter_config.json's
    ``base_model_name_or_path``."""
    path = Path(os.fspath(folder)).expanduser() / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the adapter config {str(path)!r}: {exc}") from exc
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(base, str) or not base:
        raise ValueError(
            f"{str(path)!r} names no base model (base_model_name_or_path is {base!r}); set it to the folder "
            "or Hub name of the model the adapter was trained on"
        )
    return base


def fix_adapter_base_path(folder: str | os.PathLike) -> str | None:
    """Returns the base model recorded in ``folder``'s adapter_config.json (None when the folder holds no
    adapter), after rewriting a relative local folder there as an absolute path.

    peft records the base as it was given to ``from_pretrained``; a relative path (``runs/base``) only
    resolves from the working directory training ran in. It is resolved against the current working
    directory, so call this right after ``save_pretrained``, from the folder the base was loaded in.
    """
    path = Path(os.fspath(folder)).expanduser() / ADAPTER_CONFIG
    if not path.is_file():
        return None
    base = adapter_base(folder)
    local = Path(base).expanduser()
    if local.is_absolute() or not local.is_dir():
        return base  # already absolute, or a Hub name
    config = json.loads(path.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = absolute = os.path.abspath(local)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
    return absolute


def load_tokenizer(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False):
    """Returns the ``AutoTokenizer`` for a folder or Hub name, with a pad token (eos if none) and left padding.

    Left padding because cohort only pads prompts, for batched generation. A LoRA adapter folder without
    tokenizer files gives its base model's tokenizer.
    """
    from transformers import AutoTokenizer

    name = os.fspath(name_or_path)
    if is_adapter_folder(name) and not (Path(name).expanduser() / "tokenizer_config.json").exists():
        name = adapter_base(name)  # an adapter saved without tokenizer files: its base model's tokenizer
    source = _check_source(name, "tokenizer_config.json")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise _not_found(name, str(exc).splitlines()[0]) from exc
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"tokenizer of {name!r} has neither a pad nor an eos token; set one with "
                "tokenizer.add_special_tokens({'pad_token': ...}) and save it"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def stop_token_ids(model: torch.nn.Module | None, tokenizer: Any) -> tuple[list[int], int]:
    """Returns (eos_ids, pad_id) for sampling: the tokenizer's EOS and the model's generation-config EOS ids
    (sorted, no repeats), and the tokenizer's pad id, or the first EOS id when it has none.

    Instruct models often end a turn with a token (Qwen's ``<|im_end|>``) that only their
    ``generation_config`` names, so both sources count.
    """
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    gen_eos = list(gen_eos) if isinstance(gen_eos, (list, tuple)) else [] if gen_eos is None else [gen_eos]
    eos_ids = sorted({tokenizer.eos_token_id, *gen_eos} - {None})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids), None)
    if pad is None:
        raise ValueError(
            "neither the tokenizer nor the model's generation_config names an EOS or pad token, so "
            "completions could not be padded; set tokenizer.pad_token (load_tokenizer does this from eos)"
        )
    return eos_ids, pad


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """Returns the torch dtype (or the string "auto") for a dtype name such as "bfloat16"."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)} or a torch.dtype")


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    lora: LoraConfig | None = None,
    attn_implementation: str | None = "sdpa",
    trainable_adapter: bool = False,
    **from_pretrained_kwargs: Any,
):
    """Returns the ``AutoModelForCausalLM`` for a folder or Hub name on ``device``, LoRA-wrapped if ``lora``.

    ``lora`` is a :class:`cohort.config.LoraConfig`; the adapter is added whenever one is given (its
    ``enabled`` flag is the run config's switch, read by the trainer before it passes the section here).
    With it only the adapter weights require grad (peft freezes the base model); the base model stays
    reachable for a reference pass through ``model.disable_adapter()``.

    A LoRA adapter folder (one with an adapter_config.json, as ``PeftModel.save_pretrained`` and cohort's
    LoRA checkpoints write) loads its base model (``base_model_name_or_path``) with these settings, then
    the adapter on top, frozen for inference (``trainable_adapter=True``: its adapter weights train, the
    base stays frozen, as when it was trained); use :func:`save_merged` to turn it into a plain model.

    ``device="meta"`` reads no weights: the same model (config, generation config, LoRA modules) is built
    with every tensor on the meta device, for a sharded run whose process 0 sends each process its shard.
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    if lora is not None:
        lora.check()  # before the model loads: a bad rank costs no download
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device={device!r} is not a valid torch device; use 'cpu', 'cuda' or 'cuda:0'"
        ) from exc
    if is_adapter_folder(name_or_path):
        return _load_adapter(
            os.fspath(name_or_path),
            lora=lora,
            trainable=trainable_adapter,
            dtype=torch_dtype,
            device=device,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
            **from_pretrained_kwargs,
        )
    source = _check_source(name_or_path, "config.json")
    kwargs = dict(from_pretrained_kwargs)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if device.type == "meta":
        model = _empty_model(source, torch_dtype, trust_remote_code=trust_remote_code, **kwargs)
        return wrap_lora(model, lora) if lora is not None else model
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, trust_remote_code=trust_remote_code, **kwargs
        )
    except OSError as exc:
        raise _not_found(os.fspath(name_or_path), str(exc).splitlines()[0]) from exc
    except Exception as exc:
        corrupt = corrupt_weights_error(os.fspath(name_or_path), exc)
        if corrupt is None:
            raise
        raise corrupt from None
    # transformers wraps PreTrainedModel.to with functools.wraps, whose stub mypy misreads as unbound:
    model.to(device)  # type: ignore[arg-type]
    if lora is not None:
        model = wrap_lora(model, lora)
    return model


def _load_adapter(
    folder: str, *, lora: LoraConfig | None, trainable: bool, device: torch.device, **base_kwargs: Any
):
    """Returns the peft model of a LoRA adapter folder on its base model on ``device``: frozen for inference,
    or with its adapter weights trainable (`trainable`) to continue training it."""
    if lora is not None:
        raise ValueError(
            f"{folder!r} is a LoRA adapter folder (it holds {ADAPTER_CONFIG}), and a new LoRA adapter cannot be "
            "added on top of it; drop the lora settings (model.lora.enabled=false) to train this adapter further, "
            "or merge it first (`cohort merge`) and put a new adapter on the merged folder"
        )
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            f"{folder!r} is a LoRA adapter folder, and loading it needs the optional dependency peft, which is "
            "not installed: pip install 'cohort[peft]'"
        ) from exc
    base = adapter_base(folder)
    if is_adapter_folder(base):
        raise ValueError(
            f"the LoRA adapter {folder!r} names another adapter folder {base!r} as its base model; merge that "
            "one first (cohort.models.save_merged) and point base_model_name_or_path at the merged folder"
        )
    hint = (
        f" (the base model of the LoRA adapter {folder!r}, base_model_name_or_path in its {ADAPTER_CONFIG}: "
        "a relative folder there is read from the working directory; make it absolute, e.g. with "
        "cohort.models.fix_adapter_base_path run where training ran)"
    )
    try:
        model = load_model(base, device=device, **base_kwargs)
    except ValueError as exc:
        raise ValueError(f"{exc}{hint}") from exc
    if device.type == "meta":  # the adapter's modules without its weights (process 0 sends them)
        config = peft.PeftConfig.from_pretrained(folder)
        config.inference_mode = not trainable
        with _peft_quiet():
            return peft.get_peft_model(model, config).eval()
    with _peft_quiet():
        model = peft.PeftModel.from_pretrained(model, folder, is_trainable=trainable)
    model.to(device)
    return model.eval()


def _empty_model(source: str, dtype: torch.dtype | str, *, trust_remote_code: bool, **kwargs: Any):
    """Returns the causal LM of a model folder or Hub name with every tensor on the meta device (no weights read),
    in `dtype` ("auto": the config's), with the folder's generation config."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    if dtype == "auto":
        saved = getattr(config, "dtype", None)
        dtype = resolve_dtype(saved) if isinstance(saved, str) else saved or torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs
        )
    try:  # the stop tokens an instruct model names only there (from_pretrained reads it too)
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:
        pass  # no generation_config.json: the one derived from the config stays, as from_pretrained's
    return model.eval()


def save_merged(model: torch.nn.Module, tokenizer: Any, folder: str | os.PathLike) -> Path:
    """Returns ``folder`` after saving there the model with its LoRA adapter merged into the base weights
    (a plain ``save_pretrained`` folder that ``AutoModelForCausalLM`` loads without peft) and the tokenizer.

    The merge (peft's ``merge_and_unload``) runs on a copy, so ``model`` keeps its adapter and can go on
    training; the copy needs memory for a second model while it is saved. A model without an adapter is
    saved as it is. ``tokenizer=None`` saves the model only.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    to_save: Any = model
    if callable(getattr(model, "merge_and_unload", None)):  # a peft model
        to_save = copy.deepcopy(to_save).merge_and_unload()
    to_save.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def wrap_lora(model, lora: LoraConfig):
    """Returns ``model`` wrapped in a peft LoRA model whose only trainable weights are the adapters."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            "LoRA needs the optional dependency peft, which is not installed: pip install 'cohort[peft]' "
            "(or drop the lora settings to train all weights)"
        ) from exc

    from transformers.pytorch_utils import Conv1D  # GPT-2-style projections, which peft adapts too

    linear_names = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, mod in model.named_modules()
            if isinstance(mod, (torch.nn.Linear, Conv1D))
        }
    )
    missing = [m for m in lora.target_modules if m not in linear_names]
    if missing:
        raise ValueError(
            f"LoRA target_modules {missing} match no Linear layer of this model; "
            f"its Linear layers are named {linear_names}: set model.lora.target_modules to some of them"
        )
    conv_names = {name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, Conv1D)}
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        fan_in_fan_out=set(lora.target_modules) <= conv_names,  # Conv1D stores its weight transposed
    )
    with _peft_quiet():
        return peft.get_peft_model(model, config)


@contextlib.contextmanager
def _peft_quiet() -> Iterator[None]:
    """A block in which peft's reads of transformers' deprecated `is_gradient_checkpointing` do not warn (transformers
    5 warns at each: nothing a user can change)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


def checkpoint_activations(model: torch.nn.Module) -> bool:
    """Returns whether `model` now recomputes its activations in the backward pass (False: it cannot, not being a
    transformers model). Non-reentrant: no input needs requires_grad (LoRA's frozen embeddings included), and the
    recomputation sees the same masks. Newer transformers name it activation_checkpointing_enable (5.25 deprecates
    the old name, v6 removes it); 5.0 has only gradient_checkpointing_enable."""
    if callable(getattr(model, "activation_checkpointing_enable", None)):
        model.activation_checkpointing_enable(  # type: ignore[operator]
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
        return True
    if callable(getattr(model, "gradient_checkpointing_enable", None)):
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        return True
    return False


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Returns the transformers model inside a peft PeftModel (LoRA layers stay injected), else model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def input_device(model: torch.nn.Module) -> torch.device:
    """Returns the device of the model's input embeddings (where input ids must live)."""
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if callable(get_emb) else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.device
    return next(model.parameters()).device


@functools.lru_cache(maxsize=256)
def _parameters_of(forward: Any) -> tuple[frozenset[str], bool]:
    """Returns (named parameters, takes **kwargs) of a forward function (cached per function)."""
    try:
        sig = inspect.signature(forward)
    except (TypeError, ValueError):
        return frozenset(), False
    params = sig.parameters.values()
    return frozenset(p.name for p in params), any(p.kind is p.VAR_KEYWORD for p in params)


def _forward_signature(model: torch.nn.Module) -> tuple[frozenset[str], bool]:
    """Returns (named parameters, takes **kwargs) of ``model.forward`` (a hook may have replaced it per instance)."""
    forward = model.forward
    return _parameters_of(getattr(forward, "__func__", forward))


def forward_accepts(model: torch.nn.Module, name: str) -> bool:
    """Returns whether ``model.forward`` takes a keyword ``name`` (explicitly or through **kwargs)."""
    named, var_keyword = _forward_signature(model)
    return name in named or var_keyword


def cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """Returns the forward() keywords that hand the KV cache ``cache`` to ``model`` and ask it to fill it.

    transformers renamed the argument from ``past_key_values`` to ``cache`` (5.24 warns on the old name
    and announces its removal for 5.40); a model whose forward names ``cache`` gets that, any other (older
    transformers, remote code) the old name. The cache object is filled in place either way. A peft wrapper
    passes its keywords on to the model it wraps, whose forward decides.
    """
    get_base = getattr(model, "get_base_model", None)
    named, _ = _forward_signature(get_base() if callable(get_base) else model)
    key = "cache" if "cache" in named else "past_key_values"
    return {key: cache, "use_cache": True}


def float_dtype(model: torch.nn.Module) -> torch.dtype:
    """Returns the dtype of the model's first floating-point parameter (float32 if it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def text_config(model: torch.nn.Module):
    """Returns the decoder's text config of a model (its own config for a plain causal LM), or None."""
    get_base = getattr(model, "get_base_model", None)  # peft wrappers
    inner = get_base() if callable(get_base) else model
    config: Any = getattr(inner, "config", None)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def full_attention_span(model: torch.nn.Module) -> int | None:
    """Returns how many positions a sequence may span with every layer attending to all of it (None: no limit).

    Sliding-window layers (Mistral's `sliding_window` without `layer_types`, "sliding_attention"
    entries in `layer_types`, GPT-Neo's "local" `attention_layers` with their `window_size`) see only
    their window: a sequence no longer than it is attended exactly as under full attention. Other
    non-full layer kinds (chunked, linear) give 0: never.
    """
    config = text_config(model)
    if config is None:
        return None
    if "local" in {str(t) for t in (getattr(config, "attention_layers", None) or [])}:
        size = getattr(config, "window_size", None)
        return size if isinstance(size, int) and size > 0 else 0
    kinds = {str(t) for t in (getattr(config, "layer_types", None) or [])}
    window = getattr(config, "sliding_window", None)
    window = window if isinstance(window, int) and window > 0 else None
    if kinds - {"full_attention", "sliding_attention"}:
        return 0
    if "sliding_attention" in kinds:
        return window or 0
    if not kinds and window is not None and getattr(config, "use_sliding_window", True) is not False:
        return window
    return None


def attention_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """Returns (query heads, key/value heads, head size) from the model's config, or None if it lacks them."""
    config = text_config(model)
    try:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    except AttributeError:
        return None
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Yields with every submodule in eval mode, then restores each module's own flag.

    Generation must run in eval mode: besides dropout, transformers drops the KV cache of layers that
    are in training mode with gradient checkpointing enabled, which would silently corrupt sampling.
    """
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, was_training in flags:
            m.training = was_training


def resolve_device(name: str, option: str = "model.device") -> torch.device:
    """Returns the torch device a device string means ("auto" = this process's CUDA GPU when there is one, else
    the CPU); `option` names the setting in the error for a GPU this torch cannot reach."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{option}={name!r}: CUDA is not available in this torch build; use cpu or auto")
    return device
