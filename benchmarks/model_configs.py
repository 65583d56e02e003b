"""The models behind the benchmark shapes: fields of their public ``config.json``, by model.

Only the fields that decide the KV cache are kept. ``derived_shape`` turns them into the numbers
``kvbridge.workloads.shapes`` uses, and ``differences`` compares the two, so a shape cannot drift
from its model unnoticed (``python benchmarks/model_configs.py``; ``tests/test_bench.py`` runs it
too).
The cache dtype is the model's ``torch_dtype`` (vLLM's default ``kv_cache_dtype="auto"``).
"""

from __future__ import annotations

import sys
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3.5-hybrid": {
        "model": "Qwen/Qwen3-Next-80B-A3B-Instruct",
        "config": {
            "num_hidden_layers": 48,
            "full_attention_interval": 4,  # layers 3, 7, ... 47 are full attention, the rest GDN
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "torch_dtype": "bfloat16",
        },
    },
    "deepseek-mla": {
        "model": "deepseek-ai/DeepSeek-V3",
        "config": {
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "torch_dtype": "bfloat16",
        },
    },
    "llama3-70b-dense": {
        "model": "meta-llama/Meta-Llama-3-70B",
        "config": {
            "num_hidden_layers": 80,
            "hidden_size": 8192,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "torch_dtype": "bfloat16",
        },
    },
    "gpt-oss-sliding": {
        "model": "openai/gpt-oss-20b",
        "config": {
            "num_hidden_layers": 24,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
            "torch_dtype": "bfloat16",
        },
    },
}

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def derived_shape(name: str) -> dict[str, Any]:
    """The cache-shape numbers a model's config gives, named as in ``ModelShape``."""
    c = CONFIGS[name]["config"]
    shape: dict[str, Any] = {
        "num_layers": c["num_hidden_layers"],
        "dtype_bytes": _DTYPE_BYTES[c["torch_dtype"]],
    }
    if "kv_lora_rank" in c:  # MLA caches one latent per token: compressed KV plus the rope key
        shape["mla_latent_dim"] = c["kv_lora_rank"] + c["qk_rope_head_dim"]
        return shape
    shape["num_kv_heads"] = c["num_key_value_heads"]
    shape["head_dim"] = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if "full_attention_interval" in c:
        shape["full_attention_interval"] = c["full_attention_interval"]
        for key in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"):
            shape[f"linear_{key}"] = c[f"linear_{key}"]
        shape["linear_conv_kernel_dim"] = c["linear_conv_kernel_dim"]
        # Per GDN layer and request: the causal-conv window over q, k and v (kernel - 1 steps)
        # and the recurrent state, one key x value matrix per value head.
        conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + (
            c["linear_num_value_heads"] * c["linear_value_head_dim"]
        )
        dtype = shape["dtype_bytes"]
        shape["conv_state_bytes"] = (c["linear_conv_kernel_dim"] - 1) * conv_dim * dtype
        shape["ssm_state_bytes"] = (
            c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"]
        ) * dtype
    if "sliding_window" in c:
        shape["sliding_window"] = c["sliding_window"]
        kinds = c["layer_types"]
        # kvbridge's shape alternates full and sliding layers: the config must have half each.
        shape["sliding_layers"] = kinds.count("sliding_attention")
    return shape


def differences(name: str) -> list[str]:
    """Fields where ``kvbridge.workloads.shapes`` disagrees with the model's config."""
    from kvbridge.workloads.shapes import SHAPES

    kv_shape = SHAPES[name]
    problems = []
    if CONFIGS[name]["model"] not in kv_shape.source:
        problems.append(f"source {kv_shape.source!r} does not name {CONFIGS[name]['model']}")
    for field, value in derived_shape(name).items():
        if field == "sliding_layers":
            mine = kv_shape.num_layers // 2 if kv_shape.sliding_window else 0
        else:
            mine = getattr(kv_shape, field)
        if mine != value:
            problems.append(f"{field}: config gives {value}, kvbridge.workloads.shapes has {mine}")
    return problems


def main() -> int:
    """Print each model's derived shape; exit 1 when a shape disagrees with its config."""
    failed = False
    for name, entry in CONFIGS.items():
        problems = differences(name)
        failed |= bool(problems)
        print(f"{name:18} {entry['model']:36} {'ok' if not problems else 'MISMATCH'}")
        for field, value in derived_shape(name).items():
            print(f"    {field} = {value}")
        for problem in problems:
            print(f"    ! {problem}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
