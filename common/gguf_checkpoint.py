"""Convert a GGUF file into an mlx-lm compatible checkpoint folder (HF layout).

The folder holds config.json, model.safetensors (quantized tensors kept MLX-style
as packed `.weight` + `.scales` + `.biases`) and tokenizer.json/tokenizer_config.json.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

# GGML type ids, by what mx.load (mlx 0.32) does with them. Q4_0/Q4_1/Q8_0 arrive
# as MLX affine triplets with group size 32; F32/F16 as they are, BF16 narrowed to
# float16; Q2_K/Q6_K dequantized to float16 by MLX (checked bit-exact against gguf-py).
_SUPPORTED = {0: "F32", 1: "F16", 30: "BF16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
_SUPPORTED |= {10: "Q2_K", 14: "Q6_K"}
_UNSUPPORTED = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 15: "Q8_K"}
_Q4K_NOTE = (  # mx.load would accept Q4_K, but silently wrong
    " (MLX decodes Q4_K with the previous sub-block's scale and min for the"
    " high-nibble half of every 64-weight group, so its weights come out wrong)"
)
_GROUP = 32  # every GGML type MLX keeps packed has 32-weight blocks
# architecture -> (HF class, whether llama.cpp's converter permuted the q/k rows)
_ARCHS = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_SPECIALS = {"bos": "bos", "eos": "eos", "unknown": "unk", "padding": "pad"}  # GGUF -> HF
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _scan_header(path: Path) -> tuple[str | None, dict[str, int]]:
    """Return general.architecture and each tensor's GGML type, read from the header.

    mx.load hides the source types (Q4_K and F16 both come back as float16) and
    refuses a whole file over one odd tensor without naming it, so we look first.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt: str) -> tuple[Any, ...]:
            nonlocal pos
            values = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return values

        def skip(vtype: int) -> str | None:  # skips one value; returns it if a string
            nonlocal pos
            if vtype == 8:
                (n,) = take("Q")
                pos += n
                if pos > len(buf):
                    raise ValueError("a string runs past the end of the file")
                return bytes(buf[pos - n : pos]).decode("utf-8")
            if vtype == 9:
                etype, count = take("IQ")
                if etype in _SCALAR_SIZE:
                    pos += count * _SCALAR_SIZE[etype]
                else:
                    for _ in range(count):
                        skip(etype)
            elif vtype in _SCALAR_SIZE:
                pos += _SCALAR_SIZE[vtype]
            else:
                raise ValueError(f"unknown metadata value type {vtype}")
            return None

        magic, version = take("4sI")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"no GGUF v2+ header (magic {magic!r}, version {version})")
        n_tensors, n_kv = take("QQ")
        arch, types = None, {}
        for _ in range(n_kv):
            key = skip(8)
            value = skip(take("I")[0])
            arch = value if key == "general.architecture" else arch
        for _ in range(n_tensors):
            name = skip(8)
            take(f"{take('I')[0]}Q")  # the shape
            types[name] = take("IQ")[0]
        return arch, types


def _inverse_permute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's per-head rotary row interleave (rows = output dim)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, src: Path) -> tuple[str, str]:
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj', 'weight')."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if suffix in ("weight", "scales", "biases", "bias"):
        if base in _TOP:
            return _TOP[base], suffix
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
            return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}", suffix
    raise ValueError(f"{src}: unsupported tensor {gguf_name!r}")


def _config(arch: str, meta: dict[str, Any], raw: dict[str, mx.array], src: Path) -> dict:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{src}: GGUF metadata lacks {arch}.{key}")
        return value.item() if isinstance(value, mx.array) else value

    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{src}: GGUF metadata lacks the tokenizer (tokenizer.ggml.tokens)")
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{src}: partial rotary embeddings are not supported")
    if (scaling := get("rope.scaling.type", "none")) != "none":
        raise ValueError(f"{src}: unsupported rope scaling {scaling!r}")
    cfg = {
        "model_type": arch,
        "architectures": [_ARCHS[arch][0]],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        # GGUF floats are float32: keep their shortest repr (1e-05, not 9.99999974e-06).
        "rms_norm_eps": float(str(np.float32(get("attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in raw,
        "tie_word_embeddings": "output.weight" not in raw,
        "torch_dtype": "float16",
    }
    for key in ("bos", "eos", "padding"):
        if (value := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            cfg[f"{key[:3]}_token_id"] = int(value.item())
    return cfg


def _quantization(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """mlx-lm's "quantization" entry: the commonest bit width, plus per-layer overrides."""
    bits = {
        key[: -len(".scales")]: weights[key[: -len(".scales")] + ".weight"].shape[-1]
        // weights[key].shape[-1]  # uint32 words per group = bits (group of 32)
        for key in weights
        if key.endswith(".scales")
    }
    if not bits:
        return None
    common = Counter(bits.values()).most_common(1)[0][0]
    quant: dict[str, Any] = {"group_size": _GROUP, "bits": common}
    for base, b in sorted(bits.items()):
        if b != common:
            quant[base] = {"group_size": _GROUP, "bits": b}
    for key, value in sorted(weights.items()):  # float matrices beside them stay float
        if key.endswith(".weight") and value.ndim == 2 and key[:-7] not in bits:
            quant[key[:-7]] = False
    return quant


def _pre_tokenizer(pre: str) -> Any:
    """llama.cpp's pre-tokenizer name -> the split its model was trained with."""
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pt

    gpt2 = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        return gpt2
    if pre == "smollm":
        return pt.Sequence([pt.Digits(individual_digits=True), gpt2])
    if pre in ("qwen2", "llama-bpe"):  # same split but Llama 3 groups up to 3 digits
        numbers = r"\p{N}" if pre == "qwen2" else r"\p{N}{1,3}"
        words = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
        rest = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        split = pt.Split(Regex(words + numbers + rest), "isolated")
        return pt.Sequence([split, pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    return None


def _save_tokenizer(meta: dict[str, Any], src: Path, out: Path, max_len: int) -> None:
    """Write a HF fast tokenizer built from the GGUF metadata (byte-level BPE only).

    transformers' own GGUF import needs the gguf package and drops smollm's
    digit splitting, so the tokenizer is assembled here.
    """
    import tokenizers as tk
    from transformers import PreTrainedTokenizerFast

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(f"{src}: unsupported tokenizer model {kind!r} (only 'gpt2' BPE)")
    if (pre_tokenizer := _pre_tokenizer(pre)) is None:
        raise ValueError(f"{src}: unsupported pre-tokenizer {pre!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = tk.Tokenizer(tk.models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, tk.decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", mx.array([], mx.int32)).tolist()
    # GGML token type 3 = control (special), 4 = user-defined (matched whole, not special).
    tok.add_special_tokens([tk.AddedToken(tokens[i], special=True) for i in _where(types, 3)])
    tok.add_tokens([tk.AddedToken(tokens[i], normalized=False) for i in _where(types, 4)])
    specials = {}  # e.g. bos_token="<|im_start|>"
    for gguf_key, hf_key in _SPECIALS.items():
        if (value := meta.get(f"tokenizer.ggml.{gguf_key}_token_id")) is not None:
            specials[f"{hf_key}_token"] = tokens[int(value.item())]
    if "bos_token" in specials and meta.get("tokenizer.ggml.add_bos_token", mx.array(0)).item():
        bos, bos_id = specials["bos_token"], int(meta["tokenizer.ggml.bos_token_id"].item())
        tok.post_processor = tk.processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, bos_id)]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **specials)
    fast.chat_template = template = meta.get("tokenizer.chat_template")
    fast.save_pretrained(str(out))
    # transformers 5 writes the template only to chat_template.jinja and names its
    # own backend class; record the portable class and the template here too.
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config |= {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
    config |= {"chat_template": template} if template else {}
    path.write_text(json.dumps(config, indent=2) + "\n")


def _where(values: list[int], wanted: int) -> list[int]:
    return [i for i, v in enumerate(values) if v == wanted]


def convert_gguf(gguf_path: Path, out_dir: Path, *, _unpermute: bool = True) -> Path:
    """Convert `gguf_path` into an MLX checkpoint folder at `out_dir` and return it.

    `out_dir` must not exist or be empty; the folder appears whole or not at all.
    `_unpermute=False` is for tests only: it keeps llama.cpp's q/k row order.
    """
    src, out_dir = Path(gguf_path), Path(out_dir)
    if not src.is_file():
        raise ValueError(f"GGUF file not found: {src}")
    try:
        arch, types = _scan_header(src)
    except (OSError, ValueError, struct.error, UnicodeDecodeError, MemoryError) as e:
        raise ValueError(f"{src} is not a readable GGUF file: {e}") from e
    if arch not in _ARCHS:
        raise ValueError(f"{src}: unsupported architecture {arch!r} (supported: {list(_ARCHS)})")
    for name, t in types.items():
        if t not in _SUPPORTED:
            kind, note = _UNSUPPORTED.get(t, f"GGML type {t}"), _Q4K_NOTE if t == 12 else ""
            raise ValueError(f"{src}: tensor {name!r} has unsupported type {kind}{note}")
    try:
        raw, meta = mx.load(str(src), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{src} is not a readable GGUF file: {e}") from e

    cfg = _config(arch, meta, raw, src)
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    weights: dict[str, mx.array] = {}
    for name, value in raw.items():
        base, suffix = _hf_name(name, src)
        proj = base.rsplit(".", 1)[-1]
        if _ARCHS[arch][1] and _unpermute and proj in heads:  # biases were permuted too
            value = _inverse_permute(value, heads[proj])
        if value.dtype != mx.uint32:
            value = value.astype(mx.float16)  # norms come as float32; one dtype for all
        if types.get(name) == 30 and mx.isinf(value).any().item():
            raise ValueError(f"{src}: BF16 tensor {name!r} overflows float16")
        weights[f"{base}.{suffix}"] = value
    if quant := _quantization(weights):
        cfg["quantization"] = cfg["quantization_config"] = quant

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared model folder from others
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        _save_tokenizer(meta, src, tmp, cfg["max_position_embeddings"])
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        os.rename(tmp, out_dir)  # fails if out_dir is non-empty: never clobber a folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
