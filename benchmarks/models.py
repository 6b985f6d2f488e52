"""Real models for bench.py: timm and HF transformers, built from config with
random weights (nothing is downloaded).

Each builder takes a device and returns (callable, example inputs), as
bench.py's own workloads do.  Inference models are in eval mode; the
training step returns a loss for bench.py to call ``backward()`` on, and
carries ``zero_grad``, which bench.py calls before each step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Built = tuple[Callable[..., Any], tuple[Any, ...]]


def _timm(name: str, batch: int, size: int) -> Callable[[str], Built]:
    def build(device: str) -> Built:
        import timm
        import torch

        model = timm.create_model(name, pretrained=False).to(device).eval()
        return model, (torch.randn(batch, 3, size, size, device=device),)

    return build


def _ids(device: str, batch: int, seq: int, vocab: int) -> Any:
    import torch

    return torch.randint(0, vocab, (batch, seq), device=device)


def _gpt2_config(layers: int, **overrides: Any) -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=layers,
        n_embd=256,
        n_head=4,
        n_positions=512,
        use_cache=False,
        attn_implementation="sdpa",
        **overrides,
    )


def gpt2(device: str) -> Built:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(_gpt2_config(4)).to(device).eval()

    def logits(ids: Any) -> Any:
        return model(ids).logits

    return logits, (_ids(device, 2, 64, model.config.vocab_size),)


def gpt2_dynamic(device: str) -> Built:
    """The GPT-2 above; bench.py compiles it with dynamic=True."""
    return gpt2(device)


def gpt2_train_step(device: str) -> Built:
    """One layer, in train mode (its dropout on); the loss, for backward()."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(_gpt2_config(1)).to(device).train()

    def loss(ids: Any) -> Any:
        return model(ids, labels=ids).loss

    # What a training loop does before each step (optimizer.zero_grad()):
    # the gradients are the backward's outputs, not sums over steps.
    loss.zero_grad = lambda: model.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    return loss, (_ids(device, 2, 64, model.config.vocab_size),)


def bert(device: str) -> Built:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        attn_implementation="sdpa",
    )
    model = BertModel(config).to(device).eval()

    def hidden(ids: Any) -> Any:
        return model(ids).last_hidden_state

    return hidden, (_ids(device, 2, 128, config.vocab_size),)


def t5(device: str) -> Built:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        d_model=256,
        d_ff=1024,
        d_kv=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        use_cache=False,
    )
    model = T5ForConditionalGeneration(config).to(device).eval()

    def logits(ids: Any, decoder_ids: Any) -> Any:
        return model(input_ids=ids, decoder_input_ids=decoder_ids).logits

    return logits, (
        _ids(device, 2, 64, config.vocab_size),
        _ids(device, 2, 32, config.vocab_size),
    )


resnet18 = _timm("resnet18", batch=2, size=224)
vit_tiny = _timm("vit_tiny_patch16_224", batch=2, size=224)
mobilenetv3 = _timm("mobilenetv3_large_100", batch=2, size=224)


# -- tiny families, for model_sweep.py ---------------------------------------
#
# One small model per architecture that transformers ships, two layers and
# 128 wide: what each family puts in a graph (grouped-query attention, rotary
# or ALiBi positions, mixtures of experts, state-space scans, relative
# attention, convolutions ahead of an encoder-decoder) compiles in seconds.
# Each callable carries its model as `.module`, for model_sweep.py's
# gradient comparison.

_TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 1000,
}
_SEQ2SEQ = {
    "d_model": 128,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 256,
    "decoder_ffn_dim": 256,
    "vocab_size": 1000,
}


def _transformers_model(
    config_name: str, model_name: str, config: dict[str, Any], device: str
) -> tuple[Any, Any]:
    """A transformers model built from its config (random weights, eval
    mode), and that config."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = getattr(transformers, config_name)(**config)
    return getattr(transformers, model_name)(cfg).to(device).eval(), cfg


def _family(config_name: str, model_name: str, **config: Any) -> Callable[[str], Built]:
    """A tiny transformers model, called on token ids (logits, or the last
    hidden state for an encoder)."""

    def build(device: str) -> Built:
        model, _ = _transformers_model(config_name, model_name, config, device)

        def run(ids: Any) -> Any:
            out = model(ids)
            return out.logits if "logits" in out else out.last_hidden_state

        run.module = model  # type: ignore[attr-defined]
        return run, (_ids(device, 2, 24, 1000),)

    return build


def _seq2seq(
    config_name: str, model_name: str, **config: Any
) -> Callable[[str], Built]:
    """A tiny encoder-decoder; Whisper's encoder takes features, not ids."""

    def build(device: str) -> Built:
        import torch

        model, cfg = _transformers_model(config_name, model_name, config, device)
        decoder_ids = _ids(device, 2, 8, 1000)
        if config_name == "WhisperConfig":
            inputs: Any = torch.randn(2, cfg.num_mel_bins, 64, device=device)
            key = "input_features"
        else:
            inputs, key = _ids(device, 2, 24, 1000), "input_ids"

        def run(x: Any, decoder_ids: Any) -> Any:
            return model(**{key: x}, decoder_input_ids=decoder_ids).logits

        run.module = model  # type: ignore[attr-defined]
        return run, (inputs, decoder_ids)

    return build


FAMILIES: dict[str, Callable[[str], Built]] = {
    "llama": _family("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_TINY),
    "mistral": _family(
        "MistralConfig",
        "MistralForCausalLM",
        num_key_value_heads=2,
        sliding_window=16,
        **_TINY,
    ),
    "qwen2": _family("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **_TINY),
    "gemma2": _family(
        "Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=32, **_TINY
    ),
    "phi3": _family(
        "Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2, pad_token_id=0, **_TINY
    ),
    "mixtral": _family(
        "MixtralConfig",
        "MixtralForCausalLM",
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        **_TINY,
    ),
    "qwen2_moe": _family(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        **_TINY,
    ),
    "gpt_neox": _family(
        "GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.25, **_TINY
    ),
    "bloom": _family(
        "BloomConfig",
        "BloomForCausalLM",
        hidden_size=128,
        n_layer=2,
        n_head=4,
        vocab_size=1000,
    ),
    "opt": _family(
        "OPTConfig",
        "OPTForCausalLM",
        hidden_size=128,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=1000,
        word_embed_proj_dim=128,
    ),
    "mamba": _family(
        "MambaConfig",
        "MambaForCausalLM",
        hidden_size=64,
        state_size=8,
        num_hidden_layers=2,
        vocab_size=1000,
    ),
    "roberta": _family("RobertaConfig", "RobertaModel", **_TINY),
    "deberta_v2": _family("DebertaV2Config", "DebertaV2Model", **_TINY),
    "modernbert": _family(
        "ModernBertConfig", "ModernBertModel", pad_token_id=0, **_TINY
    ),
    "clip_text": _family("CLIPTextConfig", "CLIPTextModel", **_TINY),
    "bart": _seq2seq("BartConfig", "BartForConditionalGeneration", **_SEQ2SEQ),
    "whisper": _seq2seq(
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        num_mel_bins=16,
        max_source_positions=32,
        decoder_start_token_id=0,
        pad_token_id=0,
        **_SEQ2SEQ,
    ),
}
