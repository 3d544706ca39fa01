"""The model's own generation defaults, from the container's `generation_config.json`.

Hub checkpoints ship one: its `eos_token_id` list adds `<|endoftext|>` to the tokenizer's
`<|im_end|>`, and its sampling values are the ones the model was tuned for (Qwen3 Instruct
0.7 / top-p 0.8 / top-k 20; Thinking 0.6 / 0.95 / 20). The packer copies it into the
container; here it is read once per container and applied under the config and the request:

    request field  >  [sampling] key in the config  >  generation_config.json  >  API default

`do_sample: false` means greedy (temperature 0), as transformers reads it.

Hub checkpoints carry these files with odd values (`"temperature": "hot"`, a top_p of 0);
transformers warns and goes on, and so does this: a field of the wrong type or out of
range is logged (`generation_config.field_ignored`, naming it) and left unsaid, so the
config's `[sampling]` or the API default applies. A file that is not a JSON object at
all is refused, as transformers refuses it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import msgspec
import structlog

from actors.sampling_params import SamplingParams
from pipeline.config.sampling import OPTIONAL_KNOBS, SamplingConfig
from qpack.spec import QpackError

FILE = "generation_config.json"
log = structlog.get_logger("moestream.generation_config")


class GenerationConfig(msgspec.Struct, frozen=True):
    """The fields of transformers' generation_config.json that moestream honours."""

    eos_token_id: int | list[int] | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    def eos_ids(self) -> list[int]:
        ids = self.eos_token_id
        return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)

    def sampling(self) -> dict[str, Any]:
        """The sampling knobs it sets, in SamplingParams' terms."""
        values = {k: v for k in OPTIONAL_KNOBS if (v := getattr(self, k)) is not None}
        if self.do_sample is False:
            values["temperature"] = 0.0
        if values.get("top_k") == 0:
            values.pop("top_k")  # transformers' "off" is ours too; nothing to say
        return values


def read_generation_config(root: Path) -> GenerationConfig:
    """The container's generation_config.json; a missing file says nothing, a field that
    does not read (wrong type, out of range) is warned about and left out."""
    path = Path(root) / FILE
    if not path.is_file():
        return GenerationConfig()
    try:
        raw = msgspec.json.decode(path.read_bytes())
    except msgspec.DecodeError as exc:
        raise QpackError(path, f"{FILE} does not read: {exc}") from None
    except RecursionError:
        raise QpackError(path, f"nested too deeply to be a valid {FILE}") from None
    if not isinstance(raw, dict):
        raise QpackError(path, f"{FILE} does not read: a JSON object was expected, "
                         f"not {type(raw).__name__}")
    kept: dict[str, Any] = {}
    for field in msgspec.structs.fields(GenerationConfig):
        if field.name not in raw:
            continue
        try:
            kept[field.name] = _checked(field.name, field.type, raw[field.name])
        except (msgspec.ValidationError, ValueError) as exc:
            log.warning("generation_config.field_ignored", path=str(path), field=field.name,
                        value=repr(raw[field.name])[:80], reason=str(exc), using="default")
    return GenerationConfig(**kept)


def _checked(name: str, tp: Any, value: Any) -> Any:
    """`value` as field `name` of GenerationConfig, its range checked the way a generation
    would use it (SamplingParams' own checks); ValueError / ValidationError if not."""
    value = msgspec.convert(value, type=tp)
    alone = GenerationConfig(**{name: value})
    SamplingParams(**alone.sampling())
    for t in alone.eos_ids():
        if t < 0:
            raise ValueError(f"eos_token_id {t} is negative")
    return value


def eos_token_ids(root: Path) -> list[int] | None:
    """Every id that ends a generation: generation_config.json's list, else config.json's
    `eos_token_id` (top level or in text_config). None: leave it to the tokenizer."""
    ids = read_generation_config(root).eos_ids()
    if ids:
        return ids
    config_path = Path(root) / "config.json"
    if config_path.is_file():
        try:
            config = msgspec.json.decode(config_path.read_bytes())
        except (msgspec.DecodeError, RecursionError):
            return None  # the container's own check names this file
        if isinstance(config, dict):
            said = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
            listed = [said] if isinstance(said, int) else said
            if isinstance(listed, list) and all(isinstance(i, int) for i in listed):
                return listed
    return None


def model_defaults(root: Path) -> SamplingParams:
    """SamplingParams with the model's own values where it has them."""
    return SamplingParams(**read_generation_config(root).sampling())


@functools.lru_cache(maxsize=16)
def _resolved(root: str, section: SamplingConfig) -> SamplingParams:
    return section.params(model_defaults(Path(root)))


def default_params(root: Path, sampling: SamplingConfig, **overrides: Any) -> SamplingParams:
    """What a generation uses when its caller says nothing more: the config's `[sampling]`
    over the generation_config.json in the container at `root`; `overrides` on top.

        params = default_params(container.root, config.sampling, max_tokens=32)

    (`Engine.default_params(max_tokens=32)` says the same for an open engine.)
    """
    base = _resolved(str(Path(root).resolve()), sampling)
    return msgspec.structs.replace(base, **overrides) if overrides else base
