"""The token embedding left in the container (pipeline/models/file_embedding.py): rows read
from dense.safetensors give the resident table's embeddings bit for bit, hold nothing
resident, and a tied embedding (the lm_head) stays resident."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers_forward import tiny_pair
from mlx.utils import tree_flatten

from pipeline.models.dense import held_bytes, load_dense
from pipeline.models.file_embedding import FileEmbedding
from pipeline.models.text_parts import text_parts
from qpack.reader import Container
from qpack.safetensors_io import load_safetensors

TOKENS = [[4791, 11, 1879, 0, 11, 151, 3000, 4791], [5, 5, 5, 77, 1234, 999, 42, 6500]]


def _held(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("bits", [None, 4, 8], ids=["fp32", "q4", "q8"])
def test_rows_from_the_file_are_the_resident_table(synth_checkpoint, packed, bits):
    _, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_5_moe", bits)
    with Container.open(qpack) as c:
        resident = load_dense(c.config, c.dense_path)
        on_file = load_dense(c.config, c.dense_path, embedding_on_file=True)
        table = text_parts(on_file).embed_tokens
        assert isinstance(table, FileEmbedding)
        total = c.manifest.dense_bytes
        assert _held(resident) - _held(on_file) == table.file_bytes
        assert held_bytes(c.dense_path, total, embedding_on_file=True, head_dtype=None) == total - table.file_bytes
        assert held_bytes(c.dense_path, total, embedding_on_file=False, head_dtype=None) == total
        ids = mx.array(TOKENS)
        want = text_parts(resident).embed_tokens(ids)
        got = table(ids)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.array_equal(got, want).item()
        lazy = (ids + 1) - 1  # a token not yet evaluated (pipelined decode)
        assert mx.array_equal(table(lazy[:, :1]), want[:, :1]).item()
        with pytest.raises(IndexError):
            table(mx.array([[table.num_embeddings]]))


def test_a_tied_embedding_stays_resident(synth_checkpoint, packed, tmp_path: Path):
    """Tied, the embedding is also the lm_head (every row, every step): never on file."""
    _, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_5_moe", 4)
    with Container.open(qpack) as c:
        weights = {k: v for k, v in load_safetensors(c.dense_path).items() if "lm_head" not in k}
        config = {**c.config, "text_config": {**c.config["text_config"], "tie_word_embeddings": True}}
    dense = tmp_path / "dense.safetensors"
    mx.save_safetensors(str(dense), weights)
    model = load_dense(config, dense, embedding_on_file=True)
    parts = text_parts(model)
    assert parts.lm_head is None and isinstance(parts.embed_tokens, nn.QuantizedEmbedding)
    assert held_bytes(dense, dense.stat().st_size, embedding_on_file=True, head_dtype=None) == dense.stat().st_size


def test_a_widened_head_gives_the_same_logits(synth_checkpoint, packed):
    """float32 activations: the lm_head's bfloat16 scales widened once at load (no cast per
    call), the same logits bit for bit, and the plan's count of the dense core held."""
    _, qpack = tiny_pair(synth_checkpoint, packed, "qwen3_5_moe", 4)
    with Container.open(qpack) as c:
        plain = load_dense(c.config, c.dense_path, embedding_on_file=True)
        wide = load_dense(c.config, c.dense_path, embedding_on_file=True, head_dtype=mx.float32)
        want = held_bytes(c.dense_path, c.manifest.dense_bytes, embedding_on_file=True,
                          head_dtype=mx.float32)
        total = c.manifest.dense_bytes
    head = text_parts(wide).lm_head
    assert isinstance(head, nn.QuantizedLinear) and head.scales.dtype == mx.float32
    widened = _held(wide) - _held(plain)
    assert widened == (head.scales.nbytes + head.biases.nbytes) // 2
    assert want == total - text_parts(wide).embed_tokens.file_bytes + widened
    h = mx.random.normal((1, 3, head.scales.shape[-1] * 64), key=mx.random.key(0))
    assert mx.array_equal(text_parts(plain).head(h), text_parts(wide).head(h)).item()
