"""Each family's synthetic config.json, key by key, against the public code that reads it:
transformers' config class and modeling file for the family, and mlx-lm's ModelArgs. A
key neither reads is one the hub's config.json carries for other code (remote code,
training, openai's reference implementation), listed here by name; every key mlx-lm needs
is there. Tensor names and shapes are checked against transformers' model on load
(helpers_family.assert_close_to_transformers: no missing, unexpected or mismatched key)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

import pytest

from qpack.families import family
from qpack.synth.presets import get_preset

# transformers 5 folds these into `rope_parameters` / `dtype` when it reads a config.
LEGACY = {"rope_theta", "rope_scaling", "partial_rotary_factor", "torch_dtype"}
# In the hub's config.json, read by neither transformers nor mlx-lm.
HUB_ONLY = {
    "qwen3_moe": {"max_window_layers"},  # Qwen2's sliding-window split, off (use_sliding_window false)
    "glm4_moe": set(),
    # DeepSeek's remote code: training-time keys (load balancing, expert parallelism).
    "deepseek_v3": {"aux_loss_alpha", "ep_size", "seq_aux"},
    "gpt_oss": {"experts_per_token", "initial_context_length"},  # openai's reference implementation
}


def _read_keys(name: str) -> tuple[set[str], set[str]]:
    """(keys transformers reads: its config class's fields and aliases, and `config.X` in
    its modeling file; mlx-lm's ModelArgs fields without a default)."""
    import transformers

    cls = type(transformers.AutoConfig.for_model(name))
    keys = {k for c in cls.__mro__ for k in getattr(c, "__annotations__", {})}
    aliases = getattr(cls, "attribute_map", {})
    keys |= set(aliases) | set(aliases.values())
    src = inspect.getsource(importlib.import_module(f"transformers.models.{name}.modeling_{name}"))
    keys |= set(re.findall(r"config\.(\w+)", src)) | set(re.findall(r'getattr\(\s*config\s*,\s*"(\w+)"', src))
    args = dataclasses.fields(importlib.import_module(f"mlx_lm.models.{name}").ModelArgs)
    keys |= {f.name for f in args}
    needed = {f.name for f in args if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return keys, needed


@pytest.mark.parametrize("name", list(HUB_ONLY))
def test_every_config_key_is_one_the_public_code_reads_or_the_hub_ships(name):
    fam = family(name)
    keys, needed = _read_keys(name)
    for preset in ("tiny", *fam.full_size):
        for layout in fam.layouts:
            cfg = fam.hf_config(get_preset(name, preset), "bfloat16", layout)
            assert set(cfg) - keys - LEGACY - {"quantization_config"} == HUB_ONLY[name], (preset, layout)
            assert needed <= set(cfg), (preset, sorted(needed - set(cfg)))
            assert cfg["model_type"] == name and cfg["architectures"][0].lower().startswith(name.replace("_", ""))
