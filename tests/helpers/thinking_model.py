"""A tiny real checkpoint that thinks: after any prompt it writes ``<think>{thought}</think>
{answer}`` and ends, whatever the sampling. For serving reasoning output where no request field
can hold a model to think tags (the Responses API has no regex): a Llama whose attention and MLP
add nothing, so each next token depends on the current one only, and whose embeddings and head
chain the reply's tokens one to the next. The tokenizer is the default model's with Qwen3's
``<think>`` / ``</think>`` added as (non-special) tokens of their own."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

THINK, END_THINK = "<think>", "</think>"


def save_thinking_model(out: Path, tokenizer_dir: Path, thought: list[str],
                        answer: list[str]) -> Path:
    """Save the model under ``out``; ``thought`` / ``answer``: the reply's pieces, each one
    token of the tokenizer, all different (ValueError otherwise). Returns ``out``."""
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK, END_THINK)])
    tok.save(str(out / "tokenizer.json"))
    ids = []
    for piece in [THINK, *thought, END_THINK, *answer]:
        enc = tok.encode(piece, add_special_tokens=False).ids
        if len(enc) != 1:
            raise ValueError(f"{piece!r} is {len(enc)} tokens, not one")
        ids.append(enc[0])
    if len(set(ids)) != len(ids):
        raise ValueError("the reply's tokens must all differ (each names its successor)")
    eos = 2  # the default model's <|im_end|>
    hidden = 64
    if len(ids) + 1 > hidden:
        raise ValueError(f"at most {hidden - 1} tokens in the reply")
    cfg = tf.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden,
                         intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=eos)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # the layer adds nothing: the last hidden state is the token's embedding
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        emb[:, 0] = 1.0  # any other token (the prompt's last): state 0, which opens the thought
        chain = [*ids, eos]
        head[chain[0], 0] = 5.0
        for k, t in enumerate(ids, start=1):  # token k-1 of the reply: state k, names token k
            emb[t].zero_()
            emb[t, k] = 1.0
            head[chain[k], k] = 5.0  # logit 40 after the norm, every other 0
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}\n')
    return out
