"""ONNX Runtime GenAI backend: the fused graphs of the onnx-* variants, greedy, with per-token times.

Requests are encoded with the model's Hugging Face tokenizer exactly as the PyTorch backend does
(chat template included), so both engines see the same token ids; each request runs in its own
generator (one at a time: a batch is served sequentially), timed at every generated token.
Picklable until ``load()``.
"""

from __future__ import annotations

import gc
from pathlib import Path
import time
from typing import Any

from variantbench.backends.base import (
    GenerationRequest,
    GenerationResult,
    LoadInfo,
    encode_request,
    failed_result,
    sequential_result,
)
from variantbench.variants.spec import Artifact, VariantSpec, ensure_artifact


class OrtGenAIBackend:
    def __init__(self, model_dir: str, variant: str | VariantSpec, threads: int | None = None, build_seed: int = 0,
                 artifact: Artifact | None = None) -> None:  # fmt: skip
        self.model_dir = str(model_dir)
        self.spec = variant if isinstance(variant, VariantSpec) else VariantSpec.parse(variant)
        self.name = self.spec.name
        self.artifact = artifact
        self.threads = threads
        self.build_seed = build_seed
        self.status: Any = None
        self._model: Any = None
        self._tokenizer: Any = None
        self._stop_ids: tuple[int, ...] = ()
        self._info: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        if self._model is not None:
            raise TypeError("a loaded OrtGenAIBackend cannot be pickled; pickle it before load()")
        return self.__dict__.copy()

    def load(self) -> LoadInfo:
        from variantbench.variants.onnx import OnnxExport, require_genai

        require_genai()
        self.artifact = ensure_artifact(self.model_dir, self.spec, self.artifact, self.build_seed, self.status,
                                        engine_type=OnnxExport)  # fmt: skip
        t0 = time.perf_counter_ns()
        import onnxruntime_genai as og
        from transformers import AutoTokenizer

        engine, source = self.spec.engine, self.artifact.source_dir
        folder = Path(self.artifact.engine_path or "")
        config = og.Config(str(folder))
        if self.threads:
            config.set_provider_option("cpu", "intra_op_num_threads", str(self.threads))
        self._model = og.Model(config)
        self._tokenizer = AutoTokenizer.from_pretrained(source)
        import json

        genai = json.loads((folder / "genai_config.json").read_text())
        eos = genai.get("model", {}).get("eos_token_id", self._tokenizer.eos_token_id)
        self._stop_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
        nbytes = sum(f.stat().st_size for f in Path(folder).glob("model.onnx*"))
        self._info = {
            "backend": "onnxruntime-genai",
            "variant": self.name,
            "weight_format": type(engine).weight_format,
            "precision": engine.precision,
            "onnx_dir": str(folder),
            "genai_version": getattr(og, "__version__", None),
            "device": "cpu",
        }
        self.generate(
            [GenerationRequest("warm", prompt="Hello", max_new_tokens=1)]
        )  # ready = a token can come out
        startup_s = (time.perf_counter_ns() - t0) / 1e9
        return LoadInfo(startup_s=startup_s, param_bytes=nbytes, details=dict(self._info))

    def info(self) -> dict[str, Any]:
        return dict(self._info) if self._info else {"backend": "onnxruntime-genai", "variant": self.name}

    def close(self) -> None:
        self._model = None
        self._tokenizer = None
        gc.collect()

    def token_log_probs(self, ids: list[int]) -> Any:
        """Next-token log-probabilities at every position (logit fidelity): float32 [len(ids), vocab].

        One generator takes the whole sequence as its prompt; its ``logits`` output then holds every
        position, as the PyTorch engine's ``log_probs`` does.
        """
        import numpy as np
        import onnxruntime_genai as og
        import torch

        if self._model is None:
            raise RuntimeError("token_log_probs() before load()")
        params = og.GeneratorParams(self._model)
        params.set_search_options(max_length=len(ids) + 1)
        gen = og.Generator(self._model, params)
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        logits = torch.from_numpy(np.asarray(gen.get_output("logits"), dtype=np.float32))[0]
        if logits.shape[0] != len(ids):
            raise RuntimeError(
                f"ONNX Runtime GenAI returned logits for {logits.shape[0]} of {len(ids)} positions"
            )
        return torch.log_softmax(logits, dim=-1)

    def tokenize(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def _one(self, req: GenerationRequest) -> GenerationResult:
        import onnxruntime_genai as og

        start = time.perf_counter_ns()
        try:
            ids = encode_request(self._tokenizer, req)
            if not ids:
                raise ValueError("prompt encodes to zero tokens")
            params = og.GeneratorParams(self._model)
            params.set_search_options(max_length=len(ids) + req.max_new_tokens, do_sample=False)
            gen = og.Generator(self._model, params)
            gen.append_tokens(ids)
            tokens: list[int] = []
            token_ns: list[int] = []
            while not gen.is_done() and len(tokens) < req.max_new_tokens:
                gen.generate_next_token()
                token_ns.append(time.perf_counter_ns())
                tokens.append(int(gen.get_next_tokens()[0]))
                if tokens[-1] in self._stop_ids:
                    break
        except Exception as exc:  # noqa: BLE001 - a failed request is data
            return failed_result(req.request_id, exc, start)
        return sequential_result(
            req.request_id, self._tokenizer, ids, tokens, token_ns, start, self._stop_ids
        )

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self._model is None:
            raise RuntimeError("generate() before load()")
        return [self._one(r) for r in requests]
