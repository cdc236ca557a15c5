"""Fused ONNX graphs through the onnxruntime-genai model builder: onnx-int4, onnx-int8, onnx-fp32.

The builder (``python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p PRECISION -e cpu``)
emits fused GroupQueryAttention, SkipSimplifiedLayerNormalization and, for int4/int8, MatMulNBits
(dequantization fused into the matmul). The export runs once per (base or built) folder and
precision into the variant cache, beside a manifest; ONNX Runtime GenAI runs it
(backends/ort_genai.py). These recipes end a chain: ``prune-heads:0.3+onnx-int4`` exports the
pruned model.
"""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys
from typing import Any, ClassVar

from variantbench.devices import DeviceNeed
from variantbench.errors import UserError
from variantbench.variants.base import Recipe, register

PRECISIONS = {"onnx-int4": "int4", "onnx-int8": "int8", "onnx-fp32": "fp32"}


class OnnxExport(Recipe):
    stage: ClassVar[str] = "engine"
    engine_backend: ClassVar[str] = "variantbench.backends.ort_genai:OrtGenAIBackend"
    devices: ClassVar[DeviceNeed] = DeviceNeed(
        cuda="onnxruntime-genai runs the export on its CPU provider here; use --device cpu"
    )

    @property
    def precision(self) -> str:
        return PRECISIONS[self.kind]

    def artifact(self, source: str | Path, root: Path, say: Any = None) -> Path:
        return export(source, self, root, say=say)


class OnnxInt4(OnnxExport):
    weight_format: ClassVar[str] = "int4 (MatMulNBits)"


class OnnxInt8(OnnxExport):
    weight_format: ClassVar[str] = "int8 (MatMulNBits)"


class OnnxFp32(OnnxExport):
    weight_format: ClassVar[str] = "float32 (ONNX)"


def _not_in_process(model: Any, recipe: Recipe) -> Any:
    raise UserError(f"{recipe.kind} is an export to ONNX Runtime GenAI, not a PyTorch transform")


register("onnx-int4", OnnxInt4, "ONNX Runtime GenAI, int4 weights fused into MatMulNBits (CPU)")(
    _not_in_process
)
register("onnx-int8", OnnxInt8, "ONNX Runtime GenAI, int8 weights fused into MatMulNBits (CPU)")(
    _not_in_process
)
register("onnx-fp32", OnnxFp32, "ONNX Runtime GenAI, float32 with fused attention and norms (CPU)")(
    _not_in_process
)


def require_genai() -> None:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        raise UserError("onnx-* variants need onnxruntime-genai: pip install 'variantbench[onnx]'") from None


def export(source: str | Path, recipe: OnnxExport, root: Path, say: Any = None) -> Path:
    """The ONNX folder of ``source`` at the recipe's precision: cached, built now if missing."""
    require_genai()
    from variantbench.variants.build import base_identity, cache_key, cached_build

    final = root / f"onnx-{cache_key({'base': base_identity(source), 'recipe': recipe.model_dump()})}"
    if not (final / "manifest.json").exists() and say:
        say(f"exporting {recipe.kind} with the onnxruntime-genai builder (once; cached in {root})")

    def make(folder: Path) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(folder),
               "-p", recipe.precision, "-e", "cpu"]  # fmt: skip
        env = {**os.environ, "TQDM_DISABLE": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if proc.returncode != 0 or not (folder / "genai_config.json").exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"{recipe.kind}: the onnxruntime-genai builder failed: {tail[0]}")
        return {
            "name": recipe.kind,
            "source": str(source),
            "precision": recipe.precision,
            "builder": f"onnxruntime_genai.models.builder -p {recipe.precision} -e cpu",
        }

    return cached_build(final, make)
