"""The public API: what `pipeline` and `qpack` export, and that it stays light to import."""

from __future__ import annotations

import subprocess
import sys

import pipeline
import qpack


def test_pipeline_exports_are_pinned() -> None:
    assert pipeline.__all__ == [
        "ConfigError",
        "Done",
        "Engine",
        "Event",
        "GenerationStats",
        "PipelineConfig",
        "SamplingParams",
        "TextDelta",
        "config_from_dict",
        "load_config",
        "open_engine",
    ]
    for name in pipeline.__all__:
        assert getattr(pipeline, name) is not None


def test_qpack_exports_are_pinned() -> None:
    assert qpack.__all__ == ["Container", "QpackError", "pack", "verify"]
    for name in qpack.__all__:
        assert getattr(qpack, name) is not None
    assert issubclass(qpack.QpackError, Exception)


def test_unknown_names_are_attribute_errors() -> None:
    for module in (pipeline, qpack):
        try:
            module.no_such_name  # noqa: B018
        except AttributeError as exc:
            assert "no_such_name" in str(exc)
        else:
            raise AssertionError("an unknown name was found")


def test_the_cli_and_the_packages_import_without_mlx() -> None:
    code = (
        "import sys, pipeline, qpack, actors, pipeline.cli\n"
        "pipeline.cli.build_parser()\n"
        # `mlx_lm` itself may be there as an unexecuted package (qpack/mlx_lm_package.py):
        # only code that runs costs memory and time.
        "heavy = [m for m in ('mlx', 'mlx.core', 'mlx_lm.models', 'transformers', 'torch')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
