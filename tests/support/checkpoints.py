"""Tiny random float32 checkpoints in the Hugging Face layout, for parity tests.

The weights come from transformers' own model classes (so tensor names and the MoE expert layout are
exactly what `save_pretrained` writes), re-initialised with a larger, seeded spread so that the
predictive entropies vary between rows: WeDLM thresholds must sometimes fill one slot and sometimes
several.
"""

from __future__ import annotations

import json
import math
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.utils import logging as hf_logging

FAMILIES = ("qwen3", "qwen2", "llama", "qwen3_moe", "wedlm_qwen3", "wedlm_qwen2")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<mask>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5's template, tools included: mlx-lm reads `<tool_call>` and `tool_call.name` in it
# and parses calls with its json_tools parser.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
    "tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}"
    '{{- \'\\n<tool_call>\\n{\\"name\\": \\"\' }}{{- tool_call.name }}'
    '{{- \'\\", \\"arguments\\": \' }}{{- tool_call.arguments | tojson }}'
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CORPUS = (
    "Once upon a time there was a little robot who liked to count: one, two, three, four, five. "
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > ? ! . , ; : "
    "def main(): return sum(range(10)) # parallel decoding with a sliding window of masks\n"
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells. "
)

# Output head init: std HEAD_GAIN / sqrt(hidden), columns scaled by exp(SPREAD * N(0, 1)).
# Tuned so that mask-row entropies span ~0.5-3.5 nats (10th-90th percentile), tau 0.4 fills
# several slots in a few percent of steps and tau 2.0 in about half of them.
SPREAD = 1.0
HEAD_GAIN = 5.5
_BASE: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "torch_dtype": "float32",
}
# family -> (config class, model class, architectures, extra config fields)
_FAMILY: dict[str, tuple[type, type, str, dict[str, Any]]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, "Qwen3ForCausalLM", {"attention_bias": False}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "llama": (
        LlamaConfig,
        LlamaForCausalLM,
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
            "rms_norm_eps": 1e-5,
        },
    ),
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        "Qwen3MoeForCausalLM",
        {
            "attention_bias": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
            "mlp_only_layers": [],
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        },
    ),
    "wedlm_qwen3": (
        Qwen3Config,
        Qwen3ForCausalLM,
        "WeDLMForCausalLM",
        {"attention_bias": False, "qk_norm": True},
    ),
    "wedlm_qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        "WeDLMForCausalLM",
        {"attention_bias": True, "qk_norm": False},
    ),
}


@lru_cache(maxsize=8)
def _tokenizer_json(vocab_size: int) -> tuple[str, dict[str, int]]:
    """Byte-level BPE: `vocab_size - 4` regular tokens, then the 4 special tokens at the end."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert tok.get_vocab_size() <= vocab_size, "tokenizer vocabulary must fit the model"
    return tok.to_str(), {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def _write_tokenizer(
    out_dir: Path, vocab_size: int, chat_template: str = CHAT_TEMPLATE
) -> dict[str, int]:
    text, ids = _tokenizer_json(vocab_size)
    (out_dir / "tokenizer.json").write_text(text)
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "mask_token": "<mask>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return ids


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with a wide spread (the default std 0.02 gives near-uniform predictions)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim == 1 and "norm" in name:
                # not all ones, so that a loader which drops a norm weight fails parity
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:  # q/k/v biases
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                # (vocab, hidden): uneven column scales make some hidden directions decisive, so
                # the entropy varies from row to row instead of clustering (llama ties these)
                cols = torch.exp(SPREAD * torch.randn(p.shape[-1], generator=gen))
                cols = cols / cols.square().mean().sqrt()
                p.copy_(
                    HEAD_GAIN / math.sqrt(p.shape[-1]) * cols * torch.randn(p.shape, generator=gen)
                )
            else:
                gain = 3.0 if name.endswith("mlp.gate.weight") else 1.5
                p.copy_(gain / math.sqrt(p.shape[-1]) * torch.randn(p.shape, generator=gen))


def _write_shards(out_dir: Path, n: int) -> None:
    """Split model.safetensors into `n` shards plus an index, as `save_pretrained` would."""
    single = out_dir / "model.safetensors"
    tensors = load_file(single)
    names = sorted(tensors)
    per = math.ceil(len(names) / n)
    weight_map: dict[str, str] = {}
    for i in range(n):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in names[i * per : (i + 1) * per]}
        save_file(part, out_dir / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    single.unlink()


# The record a WeDLM-adapted checkpoint's config.json carries (ModelConfig.wedlm_trained):
# random test weights are decoded as if WeDLM-trained unless a test asks for a plain model,
# so that mode "auto" exercises the WeDLM paths the tests were written for.
WEDLM_RECORD = {"note": "random test weights: decoded as a WeDLM-trained checkpoint"}


def make_checkpoint(
    out_dir: Path,
    family: str,
    seed: int = 0,
    shards: int = 1,
    wedlm_record: bool = True,
    chat_template: str = CHAT_TEMPLATE,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random float32 checkpoint of `family` (see FAMILIES) into `out_dir`.
    `wedlm_record=False`: a plain checkpoint (mode "auto" decodes it autoregressively)."""
    if family not in _FAMILY:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    config_cls, model_cls, arch, extra = _FAMILY[family]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = {**_BASE, **extra, **config_overrides}
    ids = _write_tokenizer(out_dir, fields["vocab_size"], chat_template)
    fields.update(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        mask_token_id=ids["<mask>"],
    )

    hf_fields = {k: v for k, v in fields.items() if k not in ("qk_norm", "torch_dtype")}
    model = model_cls(config_cls(**hf_fields)).to(torch.float32)
    _reinit(model, seed)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        # save_pretrained writes hub tensor names (per-expert MoE tensors) and drops a tied lm_head
        model.save_pretrained(tmp)
        (out_dir / "model.safetensors").write_bytes((Path(tmp) / "model.safetensors").read_bytes())
    if bar:
        hf_logging.enable_progress_bar()
    for stale in out_dir.glob("model-*-of-*.safetensors"):
        stale.unlink()
    (out_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    if shards > 1:
        _write_shards(out_dir, shards)

    # config.json in the classic hub form (top-level rope_theta, num_experts), written by hand
    model_type = "wedlm" if family.startswith("wedlm") else model.config.model_type
    config = {"architectures": [arch], "model_type": model_type, **fields}
    if wedlm_record:
        config["wedlm"] = WEDLM_RECORD
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {
        "bos_token_id": fields["bos_token_id"],
        "eos_token_id": fields["eos_token_id"],
        "do_sample": False,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out_dir


# Tiny configs of mlx-lm families with no transformers writer here: the checkpoint is made
# from mlx-lm's own classes (make_mlx_checkpoint). Windows of 8 so that prompts cross them.
SLIDING_WINDOW = 8
_MLX_BASE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
}
_DEEPSEEK_V3: dict[str, Any] = {
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}
_KIMI_K2: dict[str, Any] = {
    **_DEEPSEEK_V3,
    "n_routed_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
_MINISTRAL3: dict[str, Any] = {
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "llama_4_scaling_beta": 0.1,
        "original_max_position_embeddings": SLIDING_WINDOW,
    },
    "sliding_window": SLIDING_WINDOW,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "tie_word_embeddings": False,
}
_GEMMA4: dict[str, Any] = {
    "model_type": "gemma4_text",
    "global_head_dim": 32,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "sliding_window": SLIDING_WINDOW,
    "sliding_window_pattern": 2,
    "use_double_wide_mlp": False,
    "vocab_size_per_layer_input": 512,
}
# key -> (architectures, extra config fields, tied head); the key is the model_type
# unless the fields name one (a second config of one family)
MLX_FAMILIES: dict[str, tuple[str, dict[str, Any], bool]] = {
    # sliding windows on alternate layers, attention sinks, MoE of 4 experts
    "gpt_oss": (
        "GptOssForCausalLM",
        {
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": SLIDING_WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        False,
    ),
    # local/global layers (every second global), embedding scale, its own RMSNorm (1 + w)
    "gemma3_text": (
        "Gemma3ForCausalLM",
        {
            "query_pre_attn_scalar": 16,
            "sliding_window": SLIDING_WINDOW,
            "sliding_window_pattern": 2,
            "rope_local_base_freq": 10000.0,
        },
        False,
    ),
    # Gemma 3 in the multimodal layout (model_type gemma3, the text model's fields under
    # text_config, its layers at language_model.model.layers): mlx-lm's text part
    "gemma3": (
        "Gemma3ForConditionalGeneration",
        {
            "text_config": {
                "model_type": "gemma3_text",
                "query_pre_attn_scalar": 16,
                "sliding_window": SLIDING_WINDOW,
                "sliding_window_pattern": 2,
                "rope_local_base_freq": 10000.0,
            }
        },
        False,
    ),
    # soft-capped attention scores and logits, a mask it applies itself, a tied head
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "query_pre_attn_scalar": 16,
            "sliding_window": SLIDING_WINDOW,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
        True,
    ),
    # dense, of another shape: fused gate/up, post-attention and post-MLP norms, partial RoPE
    "glm4": (
        "Glm4ForCausalLM",
        {"attention_bias": True, "partial_rotary_factor": 0.5},
        False,
    ),
    # q/k norms over all heads, norms after attention and MLP
    "olmo2": ("Olmo2ForCausalLM", {"tie_word_embeddings": False}, False),
    # embedding, attention, residual and logit multipliers (the head divides the logits)
    "granite": (
        "GraniteForCausalLM",
        {
            "logits_scaling": 4.0,
            "attention_multiplier": 0.25,
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "attention_bias": False,
            "mlp_bias": False,
        },
        False,
    ),
    # sliding layers and one global in every 2, layer norm, logit scale, a tied head
    "cohere2": (
        "Cohere2ForCausalLM",
        {
            "sliding_window": SLIDING_WINDOW,
            "sliding_window_pattern": 2,
            "logit_scale": 0.5,
            "layer_norm_eps": 1e-5,
        },
        True,
    ),
    # multi-head latent attention (MLA), a dense first layer, then routed + shared experts
    "deepseek_v3": ("DeepseekV3ForCausalLM", _DEEPSEEK_V3, False),
    # Kimi K2: a deepseek_v3-typed config with grouped expert routing and YaRN RoPE
    "kimi_k2": ("DeepseekV3ForCausalLM", {"model_type": "deepseek_v3", **_KIMI_K2}, False),
    # Kimi K2.5 in the multimodal layout: DeepSeek V3 under text_config
    "kimi_k25": (
        "KimiK25ForConditionalGeneration",
        {"text_config": {"model_type": "deepseek_v3", **_DEEPSEEK_V3}},
        False,
    ),
    # GLM-4.5/4.7: MoE with sigmoid routing and a dense first layer, q/k norms, partial RoPE
    "glm4_moe": (
        "Glm4MoeForCausalLM",
        {
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 1,
            "n_routed_experts": 4,
            "routed_scaling_factor": 1.0,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "rope_scaling": None,
            "use_qk_norm": True,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
        },
        False,
    ),
    # MiniMax M2.x: every layer MoE (sigmoid routing with a correction bias), q/k norms
    # over all heads, partial RoPE
    "minimax": (
        "MiniMaxM2ForCausalLM",
        {
            "intermediate_size": 32,
            "num_experts_per_tok": 2,
            "num_local_experts": 4,
            "shared_intermediate_size": 0,
            "rotary_dim": 8,
            "use_qk_norm": True,
        },
        False,
    ),
    # Mistral 3 in the multimodal layout with a Mistral (llama) text model
    "mistral3": (
        "Mistral3ForConditionalGeneration",
        {"text_config": {"model_type": "mistral", "tie_word_embeddings": False}},
        False,
    ),
    # Ministral 3: sliding and full layers, a query scale that grows with the position
    # past original_max_position_embeddings (8 here: the prompts cross it)
    "ministral3": ("Ministral3ForCausalLM", _MINISTRAL3, False),
    # Mistral 3 as the hub ships Ministral 3: the multimodal layout, ministral3 text model
    "mistral3_ministral3": (
        "Mistral3ForConditionalGeneration",
        {"model_type": "mistral3", "text_config": {"model_type": "ministral3", **_MINISTRAL3}},
        False,
    ),
    # Gemma 4 (31B's shape): sliding layers, global layers of wider heads, logit soft-cap
    "gemma4_text": ("Gemma4ForCausalLM", _GEMMA4, False),
    # Gemma 4 26B-A4B's shape: an MoE block beside the MLP, keys that are the values on
    # global layers (attention_k_eq_v), in the multimodal layout
    "gemma4": (
        "Gemma4ForConditionalGeneration",
        {
            "text_config": {
                **_GEMMA4,
                "enable_moe_block": True,
                "num_experts": 4,
                "top_k_experts": 2,
                "moe_intermediate_size": 32,
                "attention_k_eq_v": True,
                "num_global_key_value_heads": 1,
            }
        },
        False,
    ),
    # Llama 4: chunked attention on three layers of four (chunks of 8), MoE every second
    "llama4": (
        "Llama4ForConditionalGeneration",
        {
            "text_config": {
                "model_type": "llama4_text",
                "attention_bias": False,
                "attention_chunk_size": SLIDING_WINDOW,
                "interleave_moe_layer_step": 2,
                "intermediate_size_mlp": 128,
                "num_experts_per_tok": 1,
                "num_local_experts": 4,
                "rope_scaling": None,
                "use_qk_norm": True,
            }
        },
        False,
    ),
    # Llama 4's text model alone: q/k norms, RoPE skipped on every fourth layer
    "llama4_text": (
        "Llama4ForCausalLM",
        {"intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 1, 0], "use_qk_norm": True},
        False,
    ),
}


# Families mlx-lm has that the engine refuses at load, each with a tiny config that mlx-lm
# builds: DeepSeek V3.2 and GLM-5's sparse attention (DSA) keeps an indexer's keys in a
# second cache per layer, which the engine's per-row KV has no room for.
_DSA: dict[str, Any] = {
    **_DEEPSEEK_V3,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 8,
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "attention_bias": False,
}
REFUSED_FAMILIES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "deepseek_v32": ("DeepseekV32ForCausalLM", _DSA, False),
    "glm_moe_dsa": (
        "GlmMoeDsaForCausalLM",
        {**_DSA, "rope_parameters": {"rope_theta": 10000.0}, "indexer_rope_interleave": True},
        False,
    ),
}


def _mlx_reinit(params: dict[str, Any], seed: int, norm_center: float) -> dict[str, Any]:
    """The spread of `_reinit`, for mlx-lm parameter names (experts stacked: fan-in last).
    Norm weights spread around `norm_center` (0 for Gemma's norms, which scale by 1 + w)."""
    import mlx.core as mx

    out = {}
    for i, (name, p) in enumerate(sorted(params.items())):
        key, col_key = mx.random.split(mx.random.key(seed * 100_003 + i))
        noise = mx.random.normal(p.shape, key=key)
        if p.ndim == 1 and "norm" in name:
            value = norm_center + 0.2 * noise
        elif p.ndim == 1:  # biases, attention sinks
            value = 0.3 * noise
        elif "embed_tokens" in name or "lm_head" in name:
            cols = mx.exp(SPREAD * mx.random.normal((p.shape[-1],), key=col_key))
            cols = cols / mx.sqrt(mx.mean(cols * cols))
            value = HEAD_GAIN / math.sqrt(p.shape[-1]) * cols * noise
        else:
            gain = 3.0 if name.endswith(("router.weight", "mlp.gate.weight")) else 1.5
            value = gain / math.sqrt(p.shape[-1]) * noise
        out[name] = value.astype(mx.float32)
    return out


def make_mlx_checkpoint(
    out_dir: Path,
    model_type: str,
    seed: int = 0,
    chat_template: str = CHAT_TEMPLATE,
    spec: tuple[str, dict[str, Any], bool] | None = None,
    **config_overrides: Any,
) -> Path:
    """A tiny random float32 checkpoint of an mlx-lm family (see MLX_FAMILIES, or `spec`:
    (architecture, config fields, tied head) for a family described elsewhere), built from
    mlx-lm's own Model and ModelArgs and saved as mlx-lm saves one (its parameter names,
    safetensors, config.json, the tokenizer files): what `mlx_lm.load` reads back."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    arch, extra, tied = spec if spec is not None else MLX_FAMILIES[model_type]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fields = {**_MLX_BASE, **extra, **config_overrides}
    if "text_config" in extra:  # a multimodal layout: the sizes are the text model's
        text = {**_MLX_BASE, **extra["text_config"], **config_overrides}
        fields = {"text_config": text, "vocab_size": text["vocab_size"], "torch_dtype": "float32"}
        if "model_type" in extra:  # a second config of one family, named by its key
            fields["model_type"] = extra["model_type"]
    ids = _write_tokenizer(out_dir, fields["vocab_size"], chat_template)
    fields.update(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=tied,
    )
    config = {"architectures": [arch], "model_type": model_type, **fields}
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    if tied:
        params.pop("lm_head.weight", None)
    # Gemma 2 and 3 scale by 1 + w; Gemma 4 by w, as most families do
    one_plus_w = config["model_type"] in ("gemma", "gemma2", "gemma3", "gemma3_text")
    weights = _mlx_reinit(params, seed, 0.0 if one_plus_w else 1.0)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "do_sample": False,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out_dir


def mlx_lm_greedy(
    path: Path, prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...]
) -> list[int]:
    """mlx-lm's own greedy tokens (generate_step, float32), up to a stop token included."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path))
    model.set_dtype(mx.float32)
    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        out.append(int(token))
        if out[-1] in stop_ids:
            break
    return out
