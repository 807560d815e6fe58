"""Tiny checkpoints of a family that answer one fixed text, so a tool call and reasoning
written in the family's own format can be asserted exactly through every API.

`scripted_checkpoint` builds one with mlx-lm's classes (tests.support.checkpoints), gives its
tokenizer the family's marker tokens (added tokens, special where the real tokenizer has
them special), then turns the weights into a bigram table: every layer's output
projections are zeroed (attention and MLP add nothing to the residual), so the logits
depend only on the current token, and the embedding and head send each token of the
script to the next one. The script's tokens must therefore each appear once (checked)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from tests.support.checkpoints import _tokenizer_json, make_mlx_checkpoint

BASE_VOCAB = 320  # the trained tokenizer's size; the added tokens follow it
ROOM = 32  # ids reserved for added tokens


def _add_tokens(folder: Path, special: list[str], plain: list[str]) -> None:
    """The tokenizer of BASE_VOCAB tokens, then `special` and `plain` added tokens; the
    config's special ids renumbered to that tokenizer's."""
    text, ids = _tokenizer_json(BASE_VOCAB)
    tok = json.loads(text)
    added = list(tok["added_tokens"])
    for n, content in enumerate([*special, *plain]):
        added.append({"id": BASE_VOCAB + n, "content": content, "single_word": False,
                      "lstrip": False, "rstrip": False, "normalized": False,
                      "special": content in special})  # fmt: skip
    assert len(added) - len(ids) <= ROOM
    tok["added_tokens"] = added
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {
        str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("config.json", "generation_config.json"):
        c = json.loads((folder / name).read_text())
        c.update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
        if "pad_token_id" in c:
            c["pad_token_id"] = ids["<|endoftext|>"]
        (folder / name).write_text(json.dumps(c, indent=2))


def script_ids(folder: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).encode(text, add_special_tokens=False)


def scripted_checkpoint(
    folder: Path,
    family: str,
    template: str,
    special: list[str],
    plain: list[str],
    after: str,
    script: str,
    **overrides: Any,
) -> Path:
    """A `family` checkpoint with chat `template` whose greedy answer, after a prompt
    ending in the token `after`, is `script` then <|im_end|>."""
    import mlx.core as mx

    folder = make_mlx_checkpoint(folder, family, seed=3, chat_template=template,
                                 vocab_size=BASE_VOCAB + ROOM, **overrides)  # fmt: skip
    _add_tokens(folder, special, plain)
    last = script_ids(folder, after)
    end = _tokenizer_json(BASE_VOCAB)[1]["<|im_end|>"]
    chain = last[-1:] + script_ids(folder, script) + [end]
    repeated = {t for t in chain[:-1] if chain[:-1].count(t) > 1}
    assert not repeated, f"the script repeats tokens {repeated}: a bigram cannot say it"
    weights = mx.load(str(folder / "model.safetensors"))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    assert len(chain) <= hidden, "the script is longer than the hidden size"
    for name, w in weights.items():
        if ".o_proj." in name or ".down_proj." in name:  # the layers add nothing
            weights[name] = mx.zeros_like(w)
    weights["model.norm.weight"] = mx.ones((hidden,))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    eye = mx.eye(hidden)
    for i, (token, nxt) in enumerate(itertools.pairwise(chain)):
        embed[token] = eye[i]  # token i of the chain is direction i ...
        head[nxt] = head[nxt] + 20.0 * eye[i]  # ... which the head reads as the next token
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return folder


# GLM-4.7's marker tokens (special as in zai-org/GLM-4.7's tokenizer_config.json), and
# the answer: reasoning (the prompt opened <think>), then one call.
GLM_SPECIAL = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
# The script's words are whole tokens too (so that each is said once; a real vocabulary
# has them in a token or a few).
GLM_PLAIN = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
             "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"]  # fmt: skip
GLM_WORDS = ["Sky?", "get_weather", "city", "Paris"]
# (the words are passed with the plain markers: scripted_checkpoint(..., GLM_PLAIN + GLM_WORDS))
GLM_REASONING = "Sky?"
GLM_SCRIPT = (f"{GLM_REASONING}</think><tool_call>get_weather<arg_key>city</arg_key>"
              "<arg_value>Paris</arg_value></tool_call>")  # fmt: skip

# gpt-oss's harmony control tokens (special in o200k_harmony) and a few whole words of
# its vocabulary (so that the script's pieces are each said once); the answer: one call
# in the commentary channel (of a function without parameters: JSON's quotes would repeat).
HARMONY_SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                   "<|return|>", "<|call|>"]  # fmt: skip
HARMONY_WORDS = ["assistant", "commentary", " to=functions.", "json", "get_time"]
HARMONY_SCRIPT = (
    "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>"
)

# MiniMax-M2's turn tokens (special) and markers; the answer: reasoning (the prompt opened
# <think>), then one call, without the newlines the real model writes between tags (a
# bigram says each token once; the parser reads both).
MINIMAX_SPECIAL = ["]~!b[", "]~b]", "[e~["]
MINIMAX_PLAIN = ["<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"]
MINIMAX_WORDS = ["Sky?", '<invoke name="', 'get_weather">', '<parameter name="', 'city">',
                 "Paris", "</parameter>", "</invoke>"]  # fmt: skip
MINIMAX_SCRIPT = ('Sky?</think><minimax:tool_call><invoke name="get_weather"><parameter '
                  'name="city">Paris</parameter></invoke></minimax:tool_call>')  # fmt: skip
