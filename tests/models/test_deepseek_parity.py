"""DeepSeek-V3 and V3.2 against transformers on checkpoints transformers itself saved (the tiny
presets' random weights, with a non-zero routing correction bias): fp32 prompt logprobs within
1e-4 and 24 greedy tokens identical, for prompts of 40 and 600 tokens (V3.2: the 600-token one
is longer than index_topk = 64, so prefill and decode both attend sparsely), over several
chunks, page sizes 1 and 16, radix-cache hits, and the PP2 and TP2 layouts."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import test_hf_parity
import torch

from pipeserve.device import native_bf16_pairs, native_sparse_expanded_kernel
from pipeserve.engine.engine import Engine
from pipeserve.layers import indexer as indexer_mod
from pipeserve.layers import mla as mla_mod

PRESETS = ["tiny-deepseek-v3", "tiny-deepseek-v32"]
VOCAB = 512
PROMPT_LENS = (40, 600)
NEW_TOKENS = 24
LOGPROB_ATOL = 1e-4
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
LAYOUTS: dict[str, dict[str, Any]] = {
    "chunk128": {"chunked_prefill_size": 128},
    "chunk48-page16": {"chunked_prefill_size": 48, "page_size": 16},
    "pp2": {"chunked_prefill_size": 128, "pp_size": 2},
    "tp2": {"chunked_prefill_size": 128, "tp_size": 2},
    # the torch backend: decode steps gathered through its page table (V3.2's over their
    # chosen rows, selected all at once through it), prompt chunks chunk by chunk
    "torch-page16": {"chunked_prefill_size": 48, "page_size": 16, "attention_backend": "torch"},
}
# An index score gap at the top-k boundary below this (relative to the row's largest score)
# could let fp32 rounding pick a different key than transformers: the test's precondition.
MIN_RELATIVE_GAP = 1e-6
pytestmark = pytest.mark.timeout(600)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_saved(model_dir, tmp_path_factory: pytest.TempPathFactory):
    """preset -> (transformers model in float32, the checkpoint it saved)."""
    from transformers import AutoModelForCausalLM

    made: dict[str, tuple[Any, Path]] = {}

    def get(preset: str) -> tuple[Any, Path]:
        if preset not in made:
            src = model_dir(preset)
            model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
            out = tmp_path_factory.mktemp(preset)
            model.save_pretrained(out)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(src / name, out / name)
            made[preset] = model, out
        return made[preset]

    return get


def hf_run(model: Any, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    return test_hf_parity.hf_run(model, ids, NEW_TOKENS)


@pytest.fixture(scope="module")
def hf_reference(hf_saved):
    cache: dict[str, list[tuple[torch.Tensor, list[int]]]] = {}

    def get(preset: str) -> list[tuple[torch.Tensor, list[int]]]:
        if preset not in cache:
            model, _ = hf_saved(preset)
            cache[preset] = [hf_run(model, ids) for ids in prompts()]
        return cache[preset]

    return get


class BoundaryGaps:
    """Records, for every in-process indexer selection, the smallest gap between the last kept
    and the first dropped score, relative to the row's largest score."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.smallest = float("inf")
        self.rows = 0
        select = indexer_mod.causal_top_positions
        at_once = indexer_mod.select_segments

        def spy(q, w, k, prefix_len: int, scale: float, topk: int, kernels) -> torch.Tensor:  # type: ignore[no-untyped-def]
            self.record(q, w, k, prefix_len, scale, topk, kernels)
            return select(q, w, k, prefix_len, scale, topk, kernels)

        def spy_at_once(q, w, cache, segments, scale, topk, kernels) -> torch.Tensor:  # type: ignore[no-untyped-def]
            for seg in segments:  # the native backend's: every segment in one call
                if seg.length > topk:
                    k = seg.read(cache)
                    self.record(q[seg.rows], w[seg.rows], k, seg.prefix_len, scale, topk, kernels)
            return at_once(q, w, cache, segments, scale, topk, kernels)

        mp.setattr(indexer_mod, "causal_top_positions", spy)
        mp.setattr(indexer_mod, "select_segments", spy_at_once)

    def record(self, q, w, k, prefix_len: int, scale: float, topk: int, kernels) -> None:  # type: ignore[no-untyped-def]
        scores = indexer_mod.causal_index_scores(q, w, k, prefix_len, scale, kernels.index_scores)
        values = scores.sort(dim=-1, descending=True).values
        over = torch.isfinite(values).sum(-1) > topk  # rows that drop some key
        if over.any():
            v = values[over]
            gap = (v[:, topk - 1] - v[:, topk]) / v[:, 0].abs().clamp_min(1e-30)
            self.smallest = min(self.smallest, gap.min().item())
            self.rows += int(over.sum())


class SparseReads:
    """Records every in-process sparse attention (prompt chunks and decode steps) in the form
    `form` forces (mla.MLAttention.sparse_expands): "expanded" (up-projected keys, wherever
    the compiled kernel is built) or "latent", and checks its work: each query read
    min(visible, topk) positions (the kernels' own count)."""

    def __init__(self, mp: pytest.MonkeyPatch, form: str) -> None:
        self.calls = {"expanded": 0, "latent": 0}
        mp.setenv("PIPESERVE_SPARSE_ATTENTION_FORM", form)
        sparse = mla_mod.MLAttention.sparse

        def spy(layer, q, seg, cache, chosen, kernels, keys_read=None):  # type: ignore[no-untyped-def]
            read = torch.zeros(1, dtype=torch.long)
            expands = layer.sparse_expands(seg.q_len, seg.length, kernels, q.dtype)
            out = sparse(layer, q, seg, cache, chosen, kernels, read)
            visible = seg.prefix_len + 1 + torch.arange(seg.q_len)
            assert read.item() == int(visible.clamp(max=chosen.shape[1]).sum())
            self.calls["expanded" if expands else "latent"] += 1
            return out

        mp.setattr(mla_mod.MLAttention, "sparse", spy)
        at_once = mla_mod.MLAttention.sparse_latent_rows

        def spy_at_once(layer, q, parts, cache, kernels, keys_read=None):  # type: ignore[no-untyped-def]
            read = torch.zeros(1, dtype=torch.long)
            out = at_once(layer, q, parts, cache, kernels, read)
            want = 0
            for seg, chosen in parts:  # the batch's latent requests (decode steps), in one call
                assert not layer.sparse_expands(seg.q_len, seg.length, kernels, q.dtype)
                visible = seg.prefix_len + 1 + torch.arange(seg.q_len)
                want += int(visible.clamp(max=chosen.shape[1]).sum())
            assert read.item() == want
            self.calls["latent"] += 1
            return out

        mp.setattr(mla_mod.MLAttention, "sparse_latent_rows", spy_at_once)


def run_engine(path: Path, layout: dict[str, Any], ids: list[list[int]]) -> list[dict[str, Any]]:
    with Engine(str(path), dtype="float32", max_total_tokens=4096, **layout) as engine:
        out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    assert isinstance(out, list)
    return out


def assert_matches(outputs: list[dict[str, Any]], reference: list[tuple[torch.Tensor, list[int]]]):
    for out, (logprobs, tokens) in zip(outputs, reference, strict=True):
        got = torch.tensor(out["prompt_logprobs"])
        torch.testing.assert_close(got, logprobs, atol=LOGPROB_ATOL, rtol=0)
        assert out["output_ids"] == tokens


FORMS = [("chunk128", "latent"), ("chunk48-page16", "expanded")]  # V3.2's sparse attention


@pytest.mark.parametrize(("layout", "form"), FORMS)
@pytest.mark.parametrize("preset", PRESETS)
def test_matches_transformers(hf_saved, hf_reference, preset: str, layout: str, form: str) -> None:
    """V3.2's sparse attention in each form: latent in one layout, on up-projected keys in the
    other (where the compiled kernels are built; latent elsewhere)."""
    _, path = hf_saved(preset)
    with pytest.MonkeyPatch.context() as mp:
        gaps, reads = BoundaryGaps(mp), SparseReads(mp, form)
        outputs = run_engine(path, LAYOUTS[layout], prompts())
    if preset == "tiny-deepseek-v32":  # sparse attention really ran, on clear choices
        assert gaps.rows > 500 and gaps.smallest > MIN_RELATIVE_GAP, (gaps.rows, gaps.smallest)
        if native_sparse_expanded_kernel() is None:
            form = "latent"
        assert reads.calls[form] > 0, f"no prompt chunk attended sparsely in {form} form"
        assert sum(reads.calls.values()) == reads.calls[form]
    assert_matches(outputs, hf_reference(preset))


@pytest.mark.parametrize("layout", ["pp2", "tp2"])
@pytest.mark.parametrize("preset", PRESETS)
def test_parallel_layouts_match_transformers(hf_saved, hf_reference, preset: str, layout: str):
    _, path = hf_saved(preset)
    assert_matches(run_engine(path, LAYOUTS[layout], prompts()), hf_reference(preset))


@pytest.mark.parametrize("preset", PRESETS)
def test_torch_backend_s_batched_decode_steps_match_transformers(
    hf_saved, hf_reference, preset: str
) -> None:
    """The torch backend (what several GPUs run MLA on): every decode step of a batch in its
    batched latent decode (V3.2's past index_topk over their chosen rows), as transformers."""
    from pipeserve.backends.torch_backend import TorchBackend

    _, path = hf_saved(preset)
    calls = {"all": 0, "chosen": 0, "alone": 0, "layers with steps": 0}
    batched, alone = TorchBackend.latent_decode, mla_mod.MLAttention.absorbed
    forward = mla_mod.MLAttention.forward

    def spy_forward(self, x, rope, cache, segments, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["layers with steps"] += any(seg.q_len == 1 for seg in segments)
        return forward(self, x, rope, cache, segments, *args, **kwargs)

    def spy(self, q, cache, meta, chosen, *args):  # type: ignore[no-untyped-def]
        calls["all"] += 1
        calls["chosen"] += chosen is not None
        return batched(self, q, cache, meta, chosen, *args)

    def spy_alone(self, q, seg, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["alone"] += seg.q_len == 1
        return alone(self, q, seg, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TorchBackend, "latent_decode", spy)
        mp.setattr(mla_mod.MLAttention, "absorbed", spy_alone)
        mp.setattr(mla_mod.MLAttention, "forward", spy_forward)
        outputs = run_engine(path, LAYOUTS["torch-page16"], prompts())
    assert_matches(outputs, hf_reference(preset))
    # one batched call in every layer of every forward holding decode steps, none alone
    assert calls["all"] == calls["layers with steps"] >= NEW_TOKENS - 1
    assert calls["alone"] == 0
    # V3.2: every step over its indexer's choice (the 40-token request's: all it has)
    assert calls["chosen"] == (calls["all"] if preset == "tiny-deepseek-v32" else 0)


@pytest.mark.parametrize("preset", PRESETS)
def test_radix_cache_hits_match_transformers(hf_saved, preset: str) -> None:
    """A second prompt sharing the first 500 tokens of the first one reads 496 of them (whole
    pages of 16) from the radix cache and still decodes as transformers does. (A request that
    asks for prompt logprobs computes its whole prompt, so greedy tokens are what is compared.)"""
    model, path = hf_saved(preset)
    first = prompts()[1]
    second = first[:500] + [(t * 7 + 3) % VOCAB for t in first[500:560]]
    with Engine(
        str(path), dtype="float32", max_total_tokens=4096, chunked_prefill_size=128, page_size=16
    ) as engine:
        engine.generate(input_ids=[first], sampling_params=GREEDY)
        (out,) = engine.generate(input_ids=[second], sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 496
    assert out["output_ids"] == hf_run(model, second)[1]


def test_plain_query_projection_matches_transformers(model_dir, tmp_path: Path) -> None:
    """q_lora_rank null (a plain q_proj) and attention_bias on, saved by transformers."""
    from transformers import AutoModelForCausalLM

    src = model_dir("tiny-deepseek-v3", q_lora_rank=None, attention_bias=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    ids = prompts()
    assert_matches(run_engine(tmp_path, LAYOUTS["chunk128"], ids), [hf_run(model, p) for p in ids])


def test_deterministic_mode_is_refused_clearly(model_dir) -> None:
    with pytest.raises(ValueError, match=r"not available for multi-head latent attention"):
        Engine(str(model_dir("tiny-deepseek-v3")), enable_deterministic_inference=True)


@pytest.mark.skipif(not native_bf16_pairs(), reason="V3.2's bfloat16 kernel forms need AVX512-BF16")
def test_bfloat16_kernel_forms_are_as_close_as_torch_s_bfloat16(hf_saved, hf_reference) -> None:
    """DeepSeek-V3.2 in bfloat16 on the native kernels' vdpbf16ps forms (the indexer, and the
    sparse attention in each form) against transformers' float32: its prompt logprobs are no
    further off, on average, than the same run on torch's ops in bfloat16 (an independent
    bfloat16 reference). A wrong channel order or pairing in a form moves them by far more."""
    _, path = hf_saved("tiny-deepseek-v32")
    reference = hf_reference("tiny-deepseek-v32")

    def error(backend: str, form: str) -> float:
        with pytest.MonkeyPatch.context() as mp:
            reads = SparseReads(mp, form)
            with Engine(
                str(path),
                dtype="bfloat16",
                attention_backend=backend,
                max_total_tokens=4096,
                **LAYOUTS["chunk48-page16"],
            ) as engine:
                outs = engine.generate(
                    input_ids=prompts(), sampling_params=GREEDY, return_logprob=True
                )
        assert isinstance(outs, list) and reads.calls[form] > 0
        diffs = [
            (torch.tensor(out["prompt_logprobs"]) - logprobs).abs()
            for out, (logprobs, _) in zip(outs, reference, strict=True)
        ]
        return torch.cat(diffs).mean().item()

    torch_error = error("torch", "latent")
    for form in ("latent", "expanded"):
        native_error = error("native", form)  # here 0.208 / 0.222 against torch's 0.208
        assert native_error <= 1.25 * torch_error, (form, native_error, torch_error)
