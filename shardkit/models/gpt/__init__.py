"""The GPT's wing: a Llama-style causal decoder, dense or mixture-of-experts, on
``ShardedModel``: ``model`` (config, plan and its checks, params, the twin, the sharded
decoder, the text data) and ``cost`` (its train step's collectives on paper)."""

from shardkit.models.gpt.cost import (
    GPTExpectation,
    expectation,
    expected,
    model_flops,
    no_terms_reason,
)
from shardkit.models.gpt.model import (
    CHARS,
    VOCAB,
    GPTConfig,
    GPTPlan,
    check_plan,
    init,
    moe_config,
    param_axes,
    rules,
    sharded_gpt,
    twin_logits,
    twin_loss,
    windows,
)

__all__ = [
    "CHARS",
    "VOCAB",
    "GPTConfig",
    "GPTExpectation",
    "GPTPlan",
    "check_plan",
    "expectation",
    "expected",
    "init",
    "model_flops",
    "moe_config",
    "no_terms_reason",
    "param_axes",
    "rules",
    "sharded_gpt",
    "twin_logits",
    "twin_loss",
    "windows",
]
