"""Fused ONNX graphs through the onnxruntime-genai model builder: onnx-int4, onnx-int8, onnx-fp32.

The builder (``python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p PRECISION -e cpu``)
emits fused GroupQueryAttention, SkipSimplifiedLayerNormalization and, for int4/int8, MatMulNBits
(dequantization fused into the matmul). The export runs once per (base or built) folder and
precision into the variant cache, beside a manifest; ONNX Runtime GenAI runs it
(backends/ort_genai.py). These recipes end a chain: ``prune-heads:0.3+onnx-int4`` exports the
pruned model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import shutil
import subprocess
import sys
import time
from typing import Any, ClassVar

from variantbench.errors import UserError
from variantbench.variants.base import Recipe, register

PRECISIONS = {"onnx-int4": "int4", "onnx-int8": "int8", "onnx-fp32": "fp32"}


class OnnxExport(Recipe):
    stage: ClassVar[str] = "engine"

    @property
    def precision(self) -> str:
        return PRECISIONS[self.kind]


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
    import hashlib

    from variantbench.variants.build import _versions, base_identity

    key = hashlib.sha256(
        json.dumps(
            {"base": base_identity(source), "recipe": recipe.spec(), **_versions()}, sort_keys=True
        ).encode()
    ).hexdigest()[:24]
    final = root / f"onnx-{key}"
    if (final / "manifest.json").exists():
        return final
    if say:
        say(f"exporting {recipe.kind} with the onnxruntime-genai builder (once; cached in {root})")
    root.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(f"{final.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(partial),
           "-p", recipe.precision, "-e", "cpu"]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, check=False, env={**os.environ, "TQDM_DISABLE": "1"}
        )
        if proc.returncode != 0 or not (partial / "genai_config.json").exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"{recipe.kind}: the onnxruntime-genai builder failed: {tail[0]}")
        manifest = {
            "name": recipe.kind,
            "source": str(source),
            "key": final.name,
            "precision": recipe.precision,
            "bytes_on_disk": sum(f.stat().st_size for f in partial.rglob("*") if f.is_file()),
            "build_s": round(time.perf_counter() - started, 2),
            "builder": " ".join(cmd[1:4]) + f" -p {recipe.precision} -e cpu",
            "versions": _versions(),
        }
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=2))
        try:
            partial.rename(final)
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final
