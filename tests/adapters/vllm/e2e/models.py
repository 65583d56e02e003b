"""Tiny models built locally for end-to-end vLLM runs (no downloads): config, tokenizer, weights.

``build_llama(path)`` writes a dense Llama-style model (a few layers, GQA, random weights from a
fixed seed, saved as safetensors) and a WordLevel ``tokenizer.json`` whose words are ``w0`` ...
``w<N>``, so prompts are easy to write: ``" ".join(f"w{i}" for i in ...)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SPECIALS = ["<unk>", "<s>", "</s>"]


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    words = SPECIALS + [f"w{i}" for i in range(vocab_size - len(SPECIALS))]
    vocab = {w: i for i, w in enumerate(words)}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": w,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, w in enumerate(SPECIALS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 4096,
                "add_bos_token": False,
                "add_eos_token": False,
                # Chat requests: each message's words, one after the other.
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
            }
        )
    )
    (path / "special_tokens_map.json").write_text(
        json.dumps({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})
    )


def llama_config(vocab_size: int = 512, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def _llama_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def rnd(*shape: int, scale: float = 0.0) -> torch.Tensor:
        std = scale or 1.0 / shape[-1] ** 0.5
        return torch.randn(*shape, generator=gen) * std

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(v, h, scale=1.0),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": rnd(v, h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = rnd(q, h)
        w[p + "self_attn.k_proj.weight"] = rnd(kv, h)
        w[p + "self_attn.v_proj.weight"] = rnd(kv, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, q)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
    return w


def build_llama(path: str | Path, *, seed: int = 1234, **overrides: Any) -> Path:
    """Write a tiny Llama (config, tokenizer, float32 safetensors weights) into ``path``."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(**overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    _write_tokenizer(out, cfg["vocab_size"])
    weights = {k: t.contiguous() for k, t in _llama_weights(cfg, seed).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_eagle_head(path: str | Path, *, seed: int = 5, **overrides: Any) -> Path:
    """Write an EAGLE-1 head for the tiny Llama into ``path``: a one-layer Llama config (vLLM
    makes it ``EagleLlamaForCausalLM``), one decoder layer without its input norm and ``fc``
    (2h -> h); the embedding and LM head are the target's. Random weights: vLLM runs it, few of
    its proposals are accepted."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(**{**overrides, "num_hidden_layers": 1})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    layer = {
        name.removeprefix("model."): t
        for name, t in _llama_weights(cfg, seed).items()
        if name.startswith("model.layers.0.") and "input_layernorm" not in name
    }
    h = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 1)
    layer["fc.weight"] = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
    save_file({k: t.contiguous() for k, t in layer.items()}, str(out / "model.safetensors"))
    return out


def prompts(
    count: int = 4,
    *,
    seed: int = 7,
    lengths: tuple[int, ...] = (45, 80, 130, 33, 64, 5),
    vocab_size: int = 512,
) -> list[list[int]]:
    """Token-id prompts of varied lengths (some crossing block boundaries), fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        ids = torch.randint(len(SPECIALS), vocab_size, (n,), generator=gen).tolist()
        out.append([int(t) for t in ids])
    return out


def qwen3_next_config(vocab_size: int = 512, **overrides: Any) -> dict[str, Any]:
    """Tiny Qwen3-Next: 3 gated-DeltaNet layers and 1 full-attention layer, a small MoE."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        # GDN on the CPU needs bf16 and linear head dims of 128.
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


def _save_transformers_model(
    path: str | Path, cfg: dict[str, Any], config_cls: str, model_cls: str, seed: int
) -> Path:
    """Random weights from transformers' own init (fixed seed), saved in bf16 with ``cfg``."""
    import transformers

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**cfg)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    _write_tokenizer(out, cfg["vocab_size"])
    return out


def build_qwen3_next(path: str | Path, *, seed: int = 1234, **overrides: Any) -> Path:
    """Write a tiny Qwen3-Next (random weights from transformers' own init, fixed seed)."""
    cfg = qwen3_next_config(**overrides)
    return _save_transformers_model(path, cfg, "Qwen3NextConfig", "Qwen3NextForCausalLM", seed)


def deepseek_mla_config(vocab_size: int = 512, **overrides: Any) -> dict[str, Any]:
    """Tiny DeepSeek-V2 with MLA attention and dense MLPs (no MoE layer).

    vLLM's CPU MLA kernels only take a latent cache row of 576 (``kv_lora_rank`` 512 +
    ``qk_rope_head_dim`` 64). On an AMX host vLLM picks its AMX MLA backend: bf16 only (float32
    fails loading, "expect weight to be bfloat16, ..."), attention block size a multiple of 32.
    float32 runs on the reference backend (``attention_config={"backend": "CPU_MLA"}``), which
    forces block size 16 and turns prefix caching and chunked prefill off. Either way the KV
    cache spec is ``MLAAttentionSpec`` (one 576-wide head).
    """
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        # Every layer dense (first_k_dense_replace = num_hidden_layers, set below); the expert
        # fields only satisfy the config's validation (transformers wants ints there).
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "moe_intermediate_size": 128,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        # YaRN with factor 1.0 is plain RoPE (same inv_freq, mscale 1), but it makes vLLM use
        # DeepseekScalingRotaryEmbedding, whose CPU forward is the PyTorch one. A "default" rope
        # takes vLLM's CPU rotary_embedding kernel, which mis-rotates MLA's 3-D, multi-head q
        # (q[..., nope:] of shape [tokens, heads, rope]): outputs then depend on batch
        # composition and on prefix-cache hits, and do not match transformers.
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 1.0,
            "original_max_position_embeddings": 2048,
        },
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.2,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    cfg.setdefault("first_k_dense_replace", cfg["num_hidden_layers"])
    return cfg


def build_deepseek_mla(path: str | Path, *, seed: int = 1234, **overrides: Any) -> Path:
    """Write a tiny DeepSeek-V2 MLA model (random weights from transformers' init, fixed seed)."""
    cfg = deepseek_mla_config(**overrides)
    return _save_transformers_model(path, cfg, "DeepseekV2Config", "DeepseekV2ForCausalLM", seed)
